"""Where a study lives: studies/<name>/ (study.db, trials.parquet, provenance.json, logs/)."""
from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path

import optuna

from autotune import PROJECT_ROOT, __version__

STUDIES_DIR = Path(os.environ.get("AUTOTUNE_STUDIES_DIR") or PROJECT_ROOT / "studies")  # tests point it elsewhere


class StudyError(ValueError):
    """The study cannot be opened as asked (one-line message, nothing in storage is touched)."""


def study_dir(name: str, root: Path | None = None) -> Path:
    return Path(root or STUDIES_DIR) / name


def default_storage(name: str, root: Path | None = None) -> str:
    return f"sqlite:///{study_dir(name, root) / 'study.db'}"


def open_study(name: str, storage: str, metrics: list[tuple[str, str]], sampler, pruner,
               resume: bool) -> tuple[optuna.Study, int]:
    """Create the study, or continue it with `resume`; returns (study, trials marked failed as stale).

    A run killed mid-trial leaves that trial RUNNING forever; on resume it is marked FAIL with the
    reason, so the sampler and the tables do not wait on it. Only trials whose runner is gone: with a
    shared storage other workers' live trials are left alone (autotune/study/parallel.py).
    `metrics`: [(summary metric, direction)]; the names are stored with the study (dashboards show them)."""
    from autotune.study.parallel import fail_stale, open_storage

    if storage.startswith("sqlite:///"):
        Path(storage.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    try:
        backend = open_storage(storage)  # a database URL, or a JournalStorage file path
        existing = {s.study_name for s in optuna.get_all_study_summaries(backend, include_best_trial=False)}
    except Exception as e:  # any storage URL: SQLAlchemy reports a bad one in many ways
        raise StudyError(f"cannot open storage {storage}: {str(e).splitlines()[0]}") from None
    if name in existing and not resume:
        raise StudyError(f"study {name!r} already exists in {storage}; add --resume to continue it or pick another --study")
    if name not in existing and resume:
        raise StudyError(f"no study {name!r} in {storage} to resume")
    directions = [d for _, d in metrics]
    study = optuna.create_study(storage=backend, study_name=name, directions=directions, sampler=sampler,
                                pruner=pruner, load_if_exists=resume)
    if [d.name.lower() for d in study.directions] != directions:
        raise StudyError(f"study {name!r} was created with other objectives; resume it with the same --objective")
    if study.metric_names is None:
        study.set_metric_names([n for n, _ in metrics])
    return study, fail_stale(study, resume=True)


def fail_waiting(study: optuna.Study, reason: str) -> int:
    """Queued trials the run ended before reaching are closed as FAIL with status not_run, so the storage
    holds no WAITING trials nobody will run; `--resume` queues their seed configs again."""
    waiting = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
    for _ in waiting:
        trial = study.ask()  # takes the oldest WAITING trial
        trial.set_user_attr("status", "not_run")
        trial.set_user_attr("failure", reason)
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
    return len(waiting)


def write_trials(study: optuna.Study, path: Path) -> None:
    """One row per trial: number, state, values, params and user attrs (nested ones as JSON)."""
    import pandas as pd

    rows = []
    for t in study.get_trials(deepcopy=False):
        row = {"number": t.number, "state": t.state.name,
               "datetime_start": t.datetime_start, "datetime_complete": t.datetime_complete}
        for i, v in enumerate(t.values or []):
            row[f"value_{i}"] = v
        row.update({f"params_{k}": json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in t.params.items()})
        row.update({k: v if isinstance(v, (int, float, str, bool)) or v is None else json.dumps(v)
                    for k, v in t.user_attrs.items()})
        rows.append(row)
    frame = pd.DataFrame(rows)
    for column in frame.columns:  # mixed-type columns (None next to numbers and text) as text for parquet
        if frame[column].dtype == object and frame[column].map(type).nunique() > 1:
            frame[column] = frame[column].map(lambda v: None if v is None else str(v))
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")  # workers on one host rewrite the same file
    frame.to_parquet(partial, index=False)
    os.replace(partial, path)


def write_provenance(path: Path, *, hardware, engine: str, model: str | None, draft_model: str | None,
                     workload: str, space_source: str) -> dict:
    """What `autotune ci` compares later: the machine, the software versions and the exact model."""
    import torch

    from autotune import ci

    # The environment `autotune ci` compares (thread count and dtypes included); it hashes the model
    # files, which for a large checkpoint takes minutes: done once, its digests reused below.
    fingerprint = ci.fingerprint(engine, model, draft_model, hardware)
    info = {
        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "hardware": _plain(hardware),
        "engine": engine, "space": space_source, "workload": workload,
        "model": model, "model_sha256": fingerprint["model_sha256"],
        "draft_model": draft_model, "draft_model_sha256": fingerprint["draft_model_sha256"],
        "versions": {"autotune": __version__, "optuna": optuna.__version__, "torch": torch.__version__,
                     "cuda": torch.version.cuda, "python": platform.python_version()},
        "host": platform.node(),
        "fingerprint": fingerprint,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(info, indent=2, default=str))
    return info


def _digest(path: str | None) -> str | None:
    """sha256 of a model file; for a checkpoint directory, of its files' contents in name order."""
    if not path or not Path(path).exists():
        return None
    p = Path(path)
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    h = hashlib.sha256()
    for f in files:
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _plain(obj):
    """A dataclass tree (the hardware probe) as JSON-ready data."""
    import dataclasses

    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    return obj if isinstance(obj, (int, float, str, bool)) or obj is None else str(obj)
