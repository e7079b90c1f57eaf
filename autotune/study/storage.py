"""Where a study lives: studies/<name>/ (study.db, trials.parquet, provenance.json, logs/); creating
one for the tuner (`open_study`) and the one reader everything after the tuner uses (`load_study`)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import optuna
import pandas as pd

from autotune.bench.metric_registry import MAXIMIZE, Metric
from autotune.engines import get_adapter
from autotune.study import objectives, record
from autotune.study.parallel import fail_stale, open_storage


class StudyError(ValueError):
    """The study cannot be opened as asked (one-line message, nothing in storage is touched)."""


def studies_dir(chosen: str | Path | None = None) -> Path:
    """Where studies live: `chosen` (the CLI's --studies-dir), else $AUTOTUNE_STUDIES_DIR, else ./studies of the
    working directory; absolute, and looked up when asked, so that an installed autotune never writes into its
    own package or source tree."""
    return Path(chosen or os.environ.get("AUTOTUNE_STUDIES_DIR") or "studies").resolve()


def study_dir(name: str, root: str | Path | None = None) -> Path:
    return studies_dir(root) / name


def default_storage(name: str, root: str | Path | None = None) -> str:
    return f"sqlite:///{study_dir(name, root) / 'study.db'}"


def open_study(name: str, storage: str, metrics: list[Metric], sampler, pruner,
               resume: bool) -> tuple[optuna.Study, int]:
    """Create the study, or continue it with `resume`; returns (study, trials marked failed as stale).

    A run killed mid-trial leaves that trial RUNNING forever; on resume it is marked FAIL with the
    reason, so the sampler and the tables do not wait on it. Only trials whose runner is gone: with a
    shared storage other workers' live trials are left alone (autotune/study/parallel.py).
    `metrics`: the objective's summary metrics; their names are stored with the study (dashboards show them)."""
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
    directions = [m.direction for m in metrics]
    study = optuna.create_study(storage=backend, study_name=name, directions=directions, sampler=sampler,
                                pruner=pruner, load_if_exists=resume)
    if [d.name.lower() for d in study.directions] != directions:
        raise StudyError(f"study {name!r} was created with other objectives; resume it with the same --objective")
    if study.metric_names is None:
        study.set_metric_names([m.name for m in metrics])
    return study, fail_stale(study, resume=True)


def fail_waiting(study: optuna.Study, reason: str) -> int:
    """WAITING trials nobody reached (queued in the storage by another process, or left by a run that died
    between queueing and taking one) are closed as FAIL with status not_run, so the storage holds no WAITING
    trials nobody will run. A run's own seeds never get there: they enter the study only as they are taken."""
    waiting = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
    for _ in waiting:
        trial = study.ask()  # takes the oldest WAITING trial
        trial.set_user_attr("status", record.NOT_RUN)
        trial.set_user_attr("failure", reason)
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
    return len(waiting)


def write_trials(study: optuna.Study, path: Path) -> None:
    """One row per trial: number, state, values, params and user attrs (nested ones as JSON)."""
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


# -- reading a study back ----------------------------------------------------------------------------
LOAD_DEFAULTS = {"concurrency": 4, "num_requests": 8, "max_tokens": 48}  # when the study recorded none


@dataclass
class StudyContext:
    """A study as validation, export, the report, ci and the estimator read it."""
    name: str
    storage: str
    directory: Path
    study: optuna.Study
    engine: str
    objective: str
    workload: str
    model: str | None
    draft_model: str | None
    provenance: dict
    slo: str | None = None
    load: dict = field(default_factory=dict)  # concurrency, num_requests, max_tokens, seed
    run_options: dict = field(default_factory=dict)  # what `autotune run` was given (workers join with it)

    @property
    def best_dir(self) -> Path:
        return self.directory / "best"

    @property
    def adapter(self):
        adapter = get_adapter(self.engine)
        if self.run_options.get("engine_binary"):  # the study ran a user's own build: so do its checks
            adapter.use_binary(self.run_options["engine_binary"])
        return adapter

    def primary(self) -> Metric:
        return objectives.primary(self.objective)

    def ranked(self) -> list[optuna.trial.FrozenTrial]:
        """Measured trials that met every requirement, best first, one per distinct effective configuration."""
        trials = sorted((t for t in self.study.get_trials(deepcopy=False) if record.is_ok(t) and t.values),
                        key=lambda t: t.values[0], reverse=self.primary().direction == MAXIMIZE)
        seen, out = set(), []
        for t in trials:
            key = t.user_attrs.get("effective_key") or json.dumps(t.user_attrs.get("config"), sort_keys=True)
            if key not in seen:
                seen.add(key)
                out.append(t)
        return out


def load_study(study: str | Path, storage: str | None = None) -> StudyContext:
    """A study by name (under studies/) or by its directory, optionally in another storage (a database
    URL or a journal file); ValueError (one line) when there is none."""
    path = Path(study)
    directory = path if (path / "study.db").exists() or (path / "provenance.json").exists() else study_dir(str(study))
    url = storage or f"sqlite:///{directory / 'study.db'}"
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).exists():
        raise ValueError(f"no study {str(study)!r}: {url.removeprefix('sqlite:///')} does not exist")
    if "://" not in url and not Path(url).is_file():
        raise ValueError(f"--storage {url}: no such journal file (a database URL needs a scheme, e.g. postgresql://)")
    try:
        backend = open_storage(url)  # database URLs and journal files alike
        names = optuna.get_all_study_names(backend)
    except Exception as e:  # noqa: BLE001 - SQLAlchemy reports a bad URL or a refused connection in many ways
        raise ValueError(f"cannot open storage {url}: {str(e).splitlines()[0]}") from None
    # A folder may have been copied under another name: its storage's only study is the one meant.
    name = directory.name if directory.name in names else (names[0] if len(names) == 1 and path.is_dir() else None)
    if name is None:
        raise ValueError(f"no study {directory.name!r} in {url} (it holds: {', '.join(names) or 'none'}); "
                         f"create it with: autotune run --study {directory.name} --storage {url}")
    s = optuna.load_study(study_name=name, storage=backend)
    prov_path = directory / "provenance.json"
    provenance = json.loads(prov_path.read_text()) if prov_path.exists() else {}
    attrs = s.user_attrs
    engine = attrs.get("engine") or provenance.get("engine") or "embedded"
    model = get_adapter(engine).portable_model(attrs.get("model", provenance.get("model")))
    first = next((t.user_attrs["metrics"] for t in s.get_trials(deepcopy=False) if t.user_attrs.get("metrics")), {})
    mean_tokens = first.get("output_tokens_mean")
    # What load the trials ran: recorded by the tuner where it does, else read off a trial's benchmark.
    load = {"concurrency": attrs.get("concurrency") or first.get("concurrency") or LOAD_DEFAULTS["concurrency"],
            "num_requests": attrs.get("num_requests") or first.get("sent") or LOAD_DEFAULTS["num_requests"],
            "max_tokens": attrs.get("max_tokens") or (round(mean_tokens) if mean_tokens else None)
            or LOAD_DEFAULTS["max_tokens"],
            "seed": attrs.get("seed", first.get("seed", 0)), "min_measure_s": attrs.get("min_measure_s", 0.0)}
    return StudyContext(name, url, directory, s, engine, attrs.get("objective", "throughput"),
                        attrs.get("workload") or provenance.get("workload") or "code", model,
                        attrs.get("draft_model", provenance.get("draft_model")), provenance,
                        attrs.get("slo") or first.get("slo"), load, attrs.get("run_options") or {})
