"""The estimator step at the end of `autotune run`: a study's rows (or a collection pass) -> fit -> files."""
from pathlib import Path

from autotune.estimator.collect import collect, study_rows
from autotune.estimator.fit import fit
from autotune.estimator.live import DEFAULT_CONFIG


def fit_from_study(study_dir: str | Path, out: str | Path | None = None, *, collect_if_missing: bool = False,
                   config: dict | None = None) -> Path:
    """The end-of-run hook: fit on the study's per-request data; writes estimator.json and
    draft_length_estimator.py into `out` (default: the study directory). Returns estimator.json's path.

    Without per-request data, collect_if_missing runs a collection pass with `config` (default: ngram, k=4)."""
    study_dir = Path(study_dir)
    out = Path(out) if out else study_dir
    try:
        rows, setup = study_rows(study_dir)
        source = f"study {study_dir}"
    except ValueError:
        if not collect_if_missing:
            raise
        out.mkdir(parents=True, exist_ok=True)
        setup = config or dict(DEFAULT_CONFIG)
        rows, source = collect(setup, out), "collection pass (code, chat, repetitive; k 1..8; temperatures 0..1)"
        rows.to_parquet(out / "estimator-data.parquet", index=False)
    estimator = fit(rows, source=source)
    estimator.info["engine_config"] = setup
    return estimator.write(out)
