"""The end of `autotune run`, the design's diagram in code: the study's winners are proven on fresh
launches (validate), handed over as a script (export), explained (report), and the per-request
acceptance the trials measured becomes a draft-length estimator (estimator fit).

Each step's failure is reported and the next still runs: a report without a validated winner still
helps, and nothing the study recorded is lost.
"""
from __future__ import annotations

from pathlib import Path

from rich.console import Console

from autotune import export, report, validate
from autotune.estimator import fit_from_study
from autotune.study.storage import load_study

LOAD_KEYS = ("concurrency", "num_requests", "max_tokens", "seed")


def finish(study: str | Path, storage: str | None = None, *, run_options=None, top: int = validate.DEFAULT_TOP,
           repeats: int = validate.DEFAULT_REPEATS, slo: str | None = None, load: dict | None = None,
           console=None, estimator: bool = True, **validate_options) -> dict:
    """validate -> export -> report -> estimator. `run_options` (the tuner's RunOptions) supplies the
    study's SLO and load. Returns {"validation": doc | None, "exported": [paths], "report": path | None,
    "estimator": path | None, "problems": [lines]}."""
    console = console or Console(stderr=True)
    if run_options is not None:
        slo = slo or run_options.slo
        load = {**{k: getattr(run_options, k) for k in LOAD_KEYS}, **(load or {})}
    ctx = load_study(study, storage)
    steps = [("validation", lambda: validate.validate(ctx, top=top, repeats=repeats, slo=slo, load=load,
                                                       console=console, **validate_options)),
             ("exported", lambda: export.export(ctx)),
             ("report", lambda: report.write_report(ctx))]
    if estimator:  # the per-request draft-length policy, from the acceptance every trial measured
        steps.append(("estimator", lambda: fit_from_study(ctx.directory)))
    out = {"validation": None, "exported": [], "report": None, "estimator": None, "problems": []}
    for name, step in steps:
        try:
            out[name] = step()
        except (ValueError, OSError) as e:
            problem = str(e).splitlines()[0] if str(e) else type(e).__name__
            out["problems"].append(f"{name}: {problem}")
            console.print(f"[yellow]{name}:[/] {problem}")
    return out
