"""study/optuna_compat.py against a real Optuna storage: each private name it wraps still means what
autotune needs. A failure here after an Optuna upgrade names the wrapper to change."""
import warnings

import optuna
import pytest
from optuna.storages import JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState
from sqlalchemy import text

from autotune.study import optuna_compat


def rdb(tmp_path, **kwargs) -> RDBStorage:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # heartbeat arguments
        return RDBStorage(f"sqlite:///{tmp_path / 'study.db'}", **kwargs)


def ask(study: optuna.Study) -> optuna.Trial:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=optuna_compat.ASK_WITH_HEARTBEAT_WARNING)
        return study.ask()


def test_storage_of_is_the_storage_the_study_was_built_on(tmp_path):
    storage = rdb(tmp_path)
    study = optuna.create_study(study_name="s", storage=storage)
    behind = optuna_compat.storage_of(study)  # Optuna wraps an RDBStorage in its cache: the same database
    assert isinstance(behind, optuna.storages.BaseStorage)
    assert behind.get_study_id_from_name("s") == storage.get_study_id_from_name("s")
    # Loading the study again over that storage finds the same study (what `autotune worker` does).
    again = optuna.load_study(study_name="s", storage=optuna_compat.storage_of(study))
    assert optuna_compat.study_id(again) == optuna_compat.study_id(study)
    assert optuna_compat.study_id(study) == storage.get_study_id_from_name("s")


def test_trial_id_is_the_storage_key_of_a_live_and_a_frozen_trial(tmp_path):
    storage = rdb(tmp_path)
    first = optuna.create_study(study_name="first", storage=storage)
    first.ask()  # takes trial id 1 of the storage: the second study's trial 0 is not id 0
    study = optuna.create_study(study_name="second", storage=storage)
    trial = study.ask()
    tid = optuna_compat.trial_id(trial)
    assert trial.number == 0 and tid != trial.number
    storage.set_trial_user_attr(tid, "mark", "here")
    frozen = study.get_trials()[0]
    assert frozen.user_attrs == {"mark": "here"}
    assert optuna_compat.trial_id(frozen) == tid


def test_heartbeat_is_reported_only_where_enabled(tmp_path):
    assert optuna_compat.has_heartbeat(rdb(tmp_path, heartbeat_interval=1, grace_period=2))
    assert not optuna_compat.has_heartbeat(rdb(tmp_path))
    assert not optuna_compat.has_heartbeat(JournalStorage(JournalFileBackend(str(tmp_path / "journal.log"))))


def test_stale_trial_ids_names_the_running_trial_whose_heartbeat_is_old(tmp_path):
    storage = rdb(tmp_path, heartbeat_interval=1, grace_period=60)
    study = optuna.create_study(study_name="s", storage=storage)
    live, silent, finished = ask(study), ask(study), ask(study)
    for trial in (live, silent, finished):
        optuna_compat.record_heartbeat(storage, optuna_compat.trial_id(trial))
    study.tell(finished, 1.0)
    assert optuna_compat.stale_trial_ids(study) == set()  # every beat is fresh
    # The silent runner's last beat an hour older than the grace period, as if it had died then.
    with storage.engine.begin() as db:
        db.execute(text("UPDATE trial_heartbeats SET heartbeat = datetime(heartbeat, '-1 hour') WHERE trial_id = :id"),
                   {"id": optuna_compat.trial_id(silent)})
    assert optuna_compat.stale_trial_ids(study) == {optuna_compat.trial_id(silent)}
    assert study.get_trials()[1].state == TrialState.RUNNING  # named, not failed: the caller fails it with a reason


def test_stale_trial_ids_is_none_without_heartbeats(tmp_path):
    study = optuna.create_study(storage=rdb(tmp_path))
    study.ask()
    assert optuna_compat.stale_trial_ids(study) is None


def test_record_heartbeat_needs_a_heartbeat_storage(tmp_path):
    study = optuna.create_study(storage=JournalStorage(JournalFileBackend(str(tmp_path / "journal.log"))))
    with pytest.raises(AttributeError):
        optuna_compat.record_heartbeat(optuna_compat.storage_of(study), optuna_compat.trial_id(study.ask()))
