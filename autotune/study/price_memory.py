"""What a run's first plan is priced at before its own first trial: what an earlier study paid on this machine.

A budget is re-planned from the study's own trials (budget.Prices.of), but until the first one has measured, the
run knows nothing of what a launch costs here; an engine whose launch takes minutes (SGLang on an H100: ~98 s)
then ran 39% past a 4-minute budget that could never hold a trial and its validation. The same command run
again knows better: the newest earlier study in the same studies folder with the same fingerprint (machine,
driver, torch, engine version, model files: provenance.json) and the same load priced it.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from autotune.study.budget import Prices
from autotune.study.storage import load_study

SAME_LOAD = ("workload", "concurrency", "num_requests", "max_tokens", "min_measure_s", "load_profile")
NEWEST = 20  # earlier studies looked at, newest first: the folder may hold hundreds


def earlier_prices(directory: Path, fingerprint: dict, load: dict) -> Prices | None:
    """The prices of the newest other study beside `directory` that ran on `fingerprint` (provenance's) under
    `load` (SAME_LOAD's values), with `source` naming it; None where there is none."""
    candidates = [d for d in directory.parent.iterdir() if d != directory and (d / "study.db").is_file()
                  and read_fingerprint(d) == fingerprint]
    for other in sorted(candidates, key=lambda d: (d / "study.db").stat().st_mtime, reverse=True)[:NEWEST]:
        try:
            ctx = load_study(other)
        except ValueError:  # a folder that is not a readable study
            continue
        attrs = ctx.study.user_attrs
        if any(attrs.get(key) != load.get(key) for key in SAME_LOAD):
            continue
        prices = Prices.of(ctx.study.get_trials(deepcopy=False), attrs.get("concurrency") or 1)
        if prices is not None:
            return replace(prices, source=other.name)
    return None


def read_fingerprint(directory: Path) -> dict | None:
    try:
        return json.loads((directory / "provenance.json").read_text()).get("fingerprint")
    except (OSError, ValueError):
        return None
