"""The end of `autotune run`, the design's diagram in code: the study's winners are proven on fresh
launches (validate), handed over as a script (export), the per-request acceptance the trials measured
becomes a draft-length estimator with its runtime stop rule (estimator fit; a short traced pass where the
setup runs on the embedded engine) and is measured against every fixed k (estimator eval), and all of it
is explained (report, which draws the acceptance-vs-entropy curve).

Each step's failure is reported and the next still runs: a report without a validated winner still
helps, and nothing the study recorded is lost.
"""
from __future__ import annotations

from pathlib import Path

from rich.console import Console

from autotune import export, report, validate
from autotune.estimator import evaluate_for_study, fit_from_study
from autotune.study.storage import load_study

LOAD_KEYS = ("concurrency", "num_requests", "max_tokens", "seed")


def finish(study: str | Path, storage: str | None = None, *, run_options=None, top: int = validate.DEFAULT_TOP,
           repeats: int = validate.DEFAULT_REPEATS, slo: str | None = None, load: dict | None = None,
           console=None, estimator: bool = True, **validate_options) -> dict:
    """validate -> export -> estimator fit -> estimator eval -> report. `run_options` (the tuner's RunOptions)
    supplies the study's SLO and load. Returns {"validation": doc | None, "exported": [paths], "report": path
    | None, "estimator": path | None, "estimator_eval": eval.json path | None, "problems": [lines]}."""
    console = console or Console(stderr=True)
    if run_options is not None:
        slo = slo or run_options.slo
        load = {**{k: getattr(run_options, k) for k in LOAD_KEYS}, **(load or {})}
    ctx = load_study(study, storage)
    steps = [("validation", lambda: validate.validate(ctx, top=top, repeats=repeats, slo=slo, load=load,
                                                       console=console, **validate_options)),
             ("exported", lambda: export.export(ctx))]
    if estimator:  # the per-request draft-length policy and stop rule, from the acceptance the trials measured
        steps += [("estimator", lambda: fit_from_study(ctx.directory, stop_rule=True)),
                  ("estimator_eval", lambda: out["estimator"] and evaluate_for_study(out["estimator"]))]
    steps.append(("report", lambda: report.write_report(ctx)))  # last: it shows the estimator's curve
    out = {"validation": None, "exported": [], "report": None, "estimator": None, "estimator_eval": None,
           "problems": []}
    for name, step in steps:
        try:
            out[name] = step()
        except (ValueError, OSError) as e:
            problem = str(e).splitlines()[0] if str(e) else type(e).__name__
            out["problems"].append(f"{name}: {problem}")
            console.print(f"[yellow]{name}:[/] {problem}")
    return out
