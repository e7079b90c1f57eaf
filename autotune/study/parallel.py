"""Trials side by side, and one study shared by many processes and machines: how many run at once
on this machine (`arrange`), who runs a trial and whether it still does (heartbeats), stale trials.

The loop itself is loop.Fleet; `autotune worker` (worker.py) runs the same loop in another process
or on another machine. Optuna's storage is the only coordination: a runner asks the
study for a trial, runs it, tells the result. A runner that dies must not hold the study up: while
a trial runs, its runner records who it is and a heartbeat (Optuna's on RDB storages: PostgreSQL,
MySQL, SQLite; a timestamp attribute on a JournalStorage file, which has none), and every runner
fails the trials whose runner is gone, never a live one's.
"""
from __future__ import annotations

import os
import socket
import threading
import time
import warnings
from pathlib import Path

import optuna
from optuna.trial import TrialState

from autotune.space.constraints import cpu_cores
from autotune.study import optuna_compat, packing

HEARTBEAT_S = int(os.environ.get("AUTOTUNE_HEARTBEAT_S", "10"))  # tests shorten it
GRACE_S = 6 * HEARTBEAT_S  # silence after which a trial's runner counts as dead
RUNNER = "autotune:runner"  # trial system attr: "host pid-namespace pid" of the process running it
BEAT = "autotune:heartbeat"  # trial system attr: last heartbeat (JournalStorage only)
WAIT_S = 1.0  # between looks at the study while the trials in flight could still complete it


def open_storage(url: str):
    """The Optuna storage behind --storage: a database URL (sqlite:///, postgresql://, mysql://),
    with heartbeats, or a file path: Optuna's JournalStorage file, for a shared filesystem."""
    if "://" in url:
        kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # heartbeats since Optuna 2.9
            return optuna.storages.RDBStorage(url, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S,
                                              engine_kwargs=kwargs)
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    Path(url).parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(url))


# -- who runs a trial, and whether it still does ----------------------------------------------------
def _me() -> str:
    try:
        namespace = os.readlink("/proc/self/ns/pid")  # containers on one host may share a hostname
    except OSError:
        namespace = "-"
    return f"{socket.gethostname()} {namespace} {os.getpid()}"


def _gone(runner: str) -> bool:
    """The runner is a process of this host (and pid namespace) that no longer exists."""
    host, namespace, pid = runner.rsplit(" ", 2)
    here_host, here_namespace, _ = _me().rsplit(" ", 2)
    if (host, namespace) != (here_host, here_namespace):
        return False  # another machine's process: only its heartbeat can tell
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie runs nothing
    except OSError:
        return True


class Heartbeat:
    """`with Heartbeat(study, trial):` claims the trial for this process and beats while it runs."""

    def __init__(self, study: optuna.Study, trial: optuna.Trial):
        self.storage, self.trial_id = optuna_compat.storage_of(study), optuna_compat.trial_id(trial)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)

    def __enter__(self):
        self.storage.set_trial_system_attr(self.trial_id, RUNNER, _me())
        self.thread.start()
        return self

    def _beat(self):
        while True:
            try:
                if optuna_compat.has_heartbeat(self.storage):
                    optuna_compat.record_heartbeat(self.storage, self.trial_id)
                else:
                    self.storage.set_trial_system_attr(self.trial_id, BEAT, time.time())
            except Exception:  # noqa: BLE001, S110 - the trial just finished, or the database blinked: the next beat retries
                pass
            if self.done.wait(HEARTBEAT_S):
                return

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()


def stale_trials(study: optuna.Study, resume: bool = False) -> list:
    """RUNNING trials nobody runs any more: their runner process on this host is gone, or their
    heartbeat is older than GRACE_S. With `resume` also those no runner ever claimed (a bare
    `study.ask()`, or a run that predates heartbeats)."""
    silent = optuna_compat.stale_trial_ids(study)
    out = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        runner = t.system_attrs.get(RUNNER)
        if runner is None:
            stale = resume
        elif silent is not None:
            stale = optuna_compat.trial_id(t) in silent or _gone(runner)
        else:
            last = t.system_attrs.get(BEAT) or t.datetime_start.timestamp()
            stale = time.time() - last > GRACE_S or _gone(runner)
        if stale:
            out.append(t)
    return out


def fail_stale(study: optuna.Study, resume: bool = False) -> int:
    """Mark stale trials FAIL, with the reason; how many this call failed."""
    failed = 0
    for t in stale_trials(study, resume):
        runner = t.system_attrs.get(RUNNER)
        why = (f"its runner ({runner}) stopped: no heartbeat for {GRACE_S} s" if runner
               else "left running by a process that was killed")
        if fail(study, optuna_compat.trial_id(t), "stale", why):
            failed += 1
    return failed


def fail(study: optuna.Study, trial_id: int, kind: str, why: str, status: str = "failed") -> bool:
    """FAIL a running trial with its reason; False when it had finished meanwhile (another runner won)."""
    storage = optuna_compat.storage_of(study)
    try:
        for key, value in (("status", status), ("failure_kind", kind), ("failure", why)):
            storage.set_trial_user_attr(trial_id, key, value)
        return bool(storage.set_trial_state_values(trial_id, TrialState.FAIL))
    except optuna.exceptions.UpdateFinishedTrialError:
        return False


def wait_for_twins(study: optuna.Study, trial: optuna.Trial, key: str, servers) -> None:
    """Wait while an earlier trial with the same effective configuration runs elsewhere, so that its
    result is reused instead of measured twice (if its runner dies, the trial fails and ours runs)."""
    last_sweep = time.monotonic()
    while any(t.number < trial.number and t.user_attrs.get("effective_key") == key
              for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))):
        servers.stop()  # our idle server may hold the very GPUs the twin waits for
        if time.monotonic() - last_sweep > HEARTBEAT_S:
            last_sweep = time.monotonic()
            fail_stale(study)
        time.sleep(WAIT_S)


# -- how many side by side ---------------------------------------------------------------------------
def arrange(space, hardware, parallel: int | str, adapter):
    """(the space, trials run side by side). `auto`: as many as the GPUs hold at the smallest
    tensor-parallel size; 1 on a CPU (a trial there should measure the whole machine). With N > 1
    on a CPU every engine gets cores // N threads: the `threads` parameter is pinned to that."""
    gpus = len(packing.usable_gpus(hardware))
    smallest = 1
    if adapter.facts.tp_key in space.params:
        p = space.params[adapter.facts.tp_key]
        smallest = int(p.fixed if p.pinned else min(p.choices) if p.choices else p.low)
    if parallel == "auto":
        slots = max(1, gpus // smallest) if gpus else 1
    else:
        try:
            slots = int(parallel)
        except ValueError:
            slots = 0
        if slots < 1:
            raise ValueError(f"--parallel must be auto or a positive integer, got {parallel!r}")
    if gpus:
        return space, min(slots, gpus)  # every trial takes a GPU at least
    if slots > 1 and "threads" in space.params:
        cores, threads = cpu_cores(hardware), space.params["threads"]
        share = packing.cpu_share(cores, slots)
        if threads.pinned and threads.fixed and threads.fixed * slots > cores:
            raise ValueError(f"--parallel {slots} engines with threads={threads.fixed} need "
                             f"{threads.fixed * slots} CPU cores; this machine has {cores}")
        if not threads.pinned or not threads.fixed:
            space = space.narrowed({"threads": share})
    return space, slots
