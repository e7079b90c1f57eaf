"""Trials side by side, and one study shared by many processes and machines.

`Fleet` runs a study's trials on N threads of this process, each thread with its own engine server
on its own GPUs or CPU cores (packing.py); `autotune worker` (worker.py) runs the same loop in
another process or on another machine. Optuna's storage is the only coordination: a runner asks the
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
from optuna.storages._heartbeat import BaseHeartbeat, is_heartbeat_enabled
from optuna.trial import TrialState

from autotune.study import packing

HEARTBEAT_S = int(os.environ.get("AUTOTUNE_HEARTBEAT_S", "10"))  # tests shorten it
GRACE_S = 6 * HEARTBEAT_S  # silence after which a trial's runner counts as dead
RUNNER = "autotune:runner"  # trial system attr: "host pid-namespace pid" of the process running it
BEAT = "autotune:heartbeat"  # trial system attr: last heartbeat (JournalStorage only)
WAIT_S = 1.0  # between looks at the study while the trials in flight could still complete it

# We heartbeat ask/tell loops ourselves; Optuna warns that its heartbeat is meant for optimize().
warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")


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
        self.storage, self.trial_id = study._storage, trial._trial_id
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)

    def __enter__(self):
        self.storage.set_trial_system_attr(self.trial_id, RUNNER, _me())
        self.thread.start()
        return self

    def _beat(self):
        while True:
            try:
                if isinstance(self.storage, BaseHeartbeat):
                    self.storage.record_heartbeat(self.trial_id)
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
    storage = study._storage
    silent = set(storage._get_stale_trial_ids(study._study_id)) if is_heartbeat_enabled(storage) else None
    out = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        runner = t.system_attrs.get(RUNNER)
        if runner is None:
            stale = resume
        elif silent is not None:
            stale = t._trial_id in silent or _gone(runner)
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
        if fail(study, t._trial_id, "stale", why):
            failed += 1
    return failed


def fail(study: optuna.Study, trial_id: int, kind: str, why: str, status: str = "failed") -> bool:
    """FAIL a running trial with its reason; False when it had finished meanwhile (another runner won)."""
    storage = study._storage
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
def arrange(space, hardware, parallel: int | str):
    """(the space, trials run side by side). `auto`: as many as the GPUs hold at the smallest
    tensor-parallel size; 1 on a CPU (a trial there should measure the whole machine). With N > 1
    on a CPU every engine gets cores // N threads: the `threads` parameter is pinned to that."""
    from autotune.space.constraints import TP_NAMES, _cpu_cores

    gpus = len(packing.usable_gpus(hardware))
    smallest = 1
    for name in (n for n in TP_NAMES if n in space.params):
        p = space.params[name]
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
        cores, threads = _cpu_cores(hardware), space.params["threads"]
        share = packing.cpu_share(cores, slots)
        if threads.pinned and threads.fixed and threads.fixed * slots > cores:
            raise ValueError(f"--parallel {slots} engines with threads={threads.fixed} need "
                             f"{threads.fixed * slots} CPU cores; this machine has {cores}")
        if not threads.pinned or not threads.fixed:
            space = space.narrowed({"threads": share})
    return space, slots


# -- the runners -------------------------------------------------------------------------------------
class Fleet:
    """N trial runners in this process, each with its own engine server (`driver.Servers`) on its own
    slot of the machine. Stands in for one `Servers` in the driver: `.stop()`, `.launches`, `.saved`."""

    def __init__(self, p, slots: int | None = None):
        from autotune.study import driver

        self.p = p
        self.pool, self.ports = packing.GpuPool.for_hardware(p.hardware), packing.PortBook()
        self.aborted = False  # Ctrl-C twice, or a runner failed: stop at once
        self.out_of_time = False
        self.servers = [driver.Servers(p, slot=packing.Slot(self.pool, self.ports, lambda: self.aborted))
                        for _ in range(slots or p.opts.parallel)]
        self.running: dict[int, optuna.Trial] = {}  # runner index -> its trial in flight
        self.lock = threading.Lock()
        self.durations: list[float] = []
        self.idle = 0
        self.errors: list[BaseException] = []
        self.last_sweep = 0.0

    @property
    def launches(self) -> int:
        return sum(s.launches for s in self.servers)

    @property
    def saved(self) -> int:
        return sum(s.saved for s in self.servers)

    def stop(self):
        for s in self.servers:
            s.stop()

    def run(self, study: optuna.Study, view, stop, deadline: float | None = None) -> None:
        """Run trials until the study holds opts.trials measured ones, the deadline (time.time())
        would be overrun, or `stop.requested`. A second Ctrl-C fails our trials in flight as
        interrupted and stops their servers."""
        if deadline is None and self.p.opts.budget_s:
            deadline = time.time() + self.p.opts.budget_s
        self.study, self.view, self.stop_request, self.deadline = study, view, stop, deadline
        threads = [threading.Thread(target=self._runner, args=(i,), daemon=True) for i in range(len(self.servers))]
        for t in threads:
            t.start()
        try:
            for t in threads:
                while t.is_alive():  # short joins: Ctrl-C reaches the main thread
                    t.join(0.2)
        except KeyboardInterrupt:
            self.aborted = True
            for trial in list(self.running.values()):
                fail(study, trial._trial_id, "interrupted", "stopped by the user", status="interrupted")
            self.stop()
            raise
        if self.errors:
            raise self.errors[0]

    def _runner(self, i: int):
        from autotune.study import driver, storage

        servers = self.servers[i]
        try:
            while (trial := self._next_trial(servers)) is not None:
                self.running[i] = trial
                t0 = time.monotonic()
                try:
                    with Heartbeat(self.study, trial):
                        frozen = driver.run_trial(self.study, trial, self.p, servers, self.view)
                except Exception as e:  # an abort (packing.Cancelled) or a storage error mid-trial
                    aborted = self.aborted
                    fail(self.study, trial._trial_id, "interrupted" if aborted else "error", f"{type(e).__name__}: {e}",
                         status="interrupted" if aborted else "failed")
                    if aborted:
                        return
                    raise
                finally:
                    self.running.pop(i, None)
                with self.lock:
                    if frozen.user_attrs.get("measured"):
                        self.idle = 0
                        self.durations.append(time.monotonic() - t0)
                    else:
                        self.idle += 1
                    self.view.finished(frozen, self.study)
                    storage.write_trials(self.study, self.p.directory / "trials.parquet")
                if self.pool.waiting():  # an idle server must not hold GPUs another trial waits for
                    servers.stop()
        except Exception as e:  # noqa: BLE001 - reported by run() in the main thread
            self.errors.append(e)
            self.aborted = True
        finally:
            servers.stop()

    def _next_trial(self, servers) -> optuna.Trial | None:
        """Ask the study for one more trial, wait while the trials in flight may still complete it, or stop."""
        from autotune.study.driver import MAX_IDLE_ASKS

        opts = self.p.opts
        while True:
            with self.lock:
                if self.aborted or self.stop_request.requested or self.idle >= MAX_IDLE_ASKS:
                    return None
                if self.deadline and self.durations:
                    typical = sorted(self.durations)[len(self.durations) // 2]
                    if self.deadline - time.time() < typical:  # the next trial would overrun
                        if not self.out_of_time:
                            self.view.note("budget reached: no new trials")
                        self.out_of_time = True
                        return None
                if time.monotonic() - self.last_sweep > HEARTBEAT_S:
                    self.last_sweep = time.monotonic()
                    fail_stale(self.study)
                trials = self.study.get_trials(deepcopy=False)
                measured = sum(bool(t.user_attrs.get("measured")) for t in trials)
                running = sum(t.state == TrialState.RUNNING for t in trials)
                if measured >= opts.trials:
                    return None
                if measured + running < opts.trials:
                    return self.study.ask()
            if self.pool.waiting():  # a trial in flight may wait for the GPUs our idle server holds
                servers.stop()
            time.sleep(WAIT_S)
