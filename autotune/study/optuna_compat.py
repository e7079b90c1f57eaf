"""The few private Optuna names autotune needs, in one place (checked against Optuna 5.1).

autotune runs its own ask/tell loop across processes (parallel.py, worker.py), so it needs the
storage behind a study, a trial's storage id, and heartbeats outside `Study.optimize`, which
Optuna's public API only offers inside `optimize`. When Optuna renames one of these, only this
module changes; tests/study/test_optuna_compat.py says which.
"""
from __future__ import annotations

import optuna
from optuna.storages import BaseStorage
from optuna.storages._heartbeat import is_heartbeat_enabled

# Optuna (ask(), 5.x) warns on every ask/tell with a heartbeat storage, since its heartbeat is meant for
# optimize(); ours beats from parallel.Heartbeat. The CLI filters it (cli.configure_output) by this text.
ASK_WITH_HEARTBEAT_WARNING = "Heartbeat of storage is supposed to be used with Study.optimize"


def storage_of(study: optuna.Study) -> BaseStorage:
    """`Study._storage` (Optuna 2-5): a study built by load_study/create_study from a URL keeps its
    storage object private; workers load the same study into a new Study over that storage."""
    return study._storage


def study_id(study: optuna.Study) -> int:
    """`Study._study_id` (Optuna 2-5): the storage methods take the id; Study exposes only the name."""
    return study._study_id


def trial_id(trial: optuna.Trial | optuna.trial.FrozenTrial) -> int:
    """`Trial._trial_id` / `FrozenTrial._trial_id` (Optuna 2-5): the storage's key of a trial (its
    public `number` counts within the study); needed to FAIL or heartbeat a trial through the storage."""
    return trial._trial_id


def has_heartbeat(storage: BaseStorage) -> bool:
    """`optuna.storages._heartbeat.is_heartbeat_enabled` (Optuna 2.9-5): an RDBStorage opened with a
    heartbeat_interval; no public predicate says so."""
    return is_heartbeat_enabled(storage)


def record_heartbeat(storage: BaseStorage, trial: int) -> None:
    """`BaseHeartbeat.record_heartbeat` (public method of a private base class, Optuna 2.9-5):
    optimize() calls it from its own thread; our ask/tell runners call it themselves."""
    storage.record_heartbeat(trial)


def stale_trial_ids(study: optuna.Study) -> set[int] | None:
    """`RDBStorage._get_stale_trial_ids` (Optuna 2.9-5): the RUNNING trials whose heartbeat is older than
    the storage's grace period, or None on a storage without heartbeats. The public
    `optuna.storages.fail_stale_trials` fails them itself, without our reason and runner check."""
    storage = storage_of(study)
    if not has_heartbeat(storage):
        return None
    return set(storage._get_stale_trial_ids(study_id(study)))
