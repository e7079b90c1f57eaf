"""The estimator step at the end of `autotune run`: a study's rows (or a collection pass) -> fit -> files,
then a short held-out evaluation where the setup runs on the embedded engine."""
import json
from contextlib import contextmanager
from pathlib import Path

import httpx

from autotune.engines.launcher import LaunchError
from autotune.estimator.collect import collect, study_rows
from autotune.estimator.evaluate import evaluate
from autotune.estimator.fit import fit, traced
from autotune.estimator.live import DEFAULT_CONFIG, measurable

# The end-of-run passes: small (a few minutes on one CPU core), as the study already measured the setup.
TRACE_PASS = {"limit": 6, "max_tokens": 32}
EVAL_PASS = {"limit": 8, "repeats": 1, "max_tokens": 32}


@contextmanager
def live_errors_as_value_errors(what: str):
    """A server that would not start or a request that failed: one line for the end-of-run problems list."""
    try:
        yield
    except (LaunchError, httpx.HTTPError) as e:
        raise ValueError(f"{what} on the embedded engine failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e


def fit_from_study(study_dir: str | Path, out: str | Path | None = None, *, collect_if_missing: bool = False,
                   config: dict | None = None, stop_rule: bool = False) -> Path:
    """The end-of-run hook: fit on the study's per-request data; writes estimator.json and
    draft_length_estimator.py into `out` (default: the study directory). Returns estimator.json's path.

    Without per-request data, collect_if_missing runs a collection pass with `config` (default: ngram, k=4).
    stop_rule: where the study's rows carry no proposal traces and its setup runs on the embedded engine, a
    small traced collection pass of that setup (k = 0, 1, 2, 4 and the study's k) is what the fit (k table
    and stop rule, stop.py) uses instead."""
    study_dir = Path(study_dir)
    out = Path(out) if out else study_dir
    try:
        rows, setup = study_rows(study_dir)
        source = f"study {study_dir}"
    except ValueError:
        if not collect_if_missing:
            raise
        setup = config or dict(DEFAULT_CONFIG)
        rows, source = None, "collection pass (code, chat, repetitive; k 0..8; temperatures 0..1)"
    if rows is None or (stop_rule and not traced(rows) and measurable(setup)):
        out.mkdir(parents=True, exist_ok=True)
        ks = tuple(sorted({0, 1, 2, 4, int(setup.get("draft_length", 4))}))
        passes = {} if rows is None else {**TRACE_PASS, "ks": ks}
        if rows is not None:
            source = f"traced collection pass of study {study_dir}'s setup (k {', '.join(map(str, ks))})"
        with live_errors_as_value_errors("collection pass"):
            rows = collect(setup, out, **passes)
        rows.to_parquet(out / "estimator-data.parquet", index=False)
    estimator = fit(rows, source=source)
    estimator.info["engine_config"] = setup
    return estimator.write(out)


def evaluate_for_study(estimator_path: str | Path) -> Path | None:
    """`autotune run`'s last step: the fitted estimator (k table + stop rule) against every fixed k its traced
    pass measured (else its table's) and k = 0 on the held-out mixed workload, briefly (EVAL_PASS). Returns eval.json's path; None where
    the study's setup is another engine's (nothing to measure it on here)."""
    path = Path(estimator_path)
    doc = json.loads(path.read_text())
    if not measurable(doc["engine_config"]):
        return None
    measured = (doc.get("width_costs") or {}).get("measured_widths") or []
    fixed = [w - 1 for w in measured if w > 1] or None  # every k the traced pass measured (None: the table's)
    with live_errors_as_value_errors("evaluation"):
        evaluate(path, path.parent / "estimator-eval", fixed=fixed, **EVAL_PASS)
    return path.parent / "estimator-eval" / "eval.json"
