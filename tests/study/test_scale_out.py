"""Scale out: GPU packing on synthetic 8-GPU machines, CPU thread sharing, and one study shared by
worker processes on a real PostgreSQL server (and a JournalStorage file), on the embedded engine."""
import errno
import glob
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import optuna
import pytest
from conftest import plain_bind
from optuna.trial import TrialState
from typer.testing import CliRunner

from autotune.cli import app
from autotune.engines import get_adapter
from autotune.hardware import CpuInfo, Hardware, classify_from_fixture, probe
from autotune.space.space import load_space
from autotune.study import loop, packing, parallel, plan

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hardware")


def eight_gpus(topology=None) -> Hardware:
    hw = classify_from_fixture(os.path.join(FIXTURES, "a100-sxm4-80gb-8gpu"))  # NVSwitch: one NVLink domain
    if topology is not None:
        hw.topology = topology
    return hw


def two_islands() -> dict:
    """GPUs 0-3 and 4-7 joined by NVLink within each group, PCIe/SMP between the groups."""
    links = [["X" if i == j else "NV4" if i // 4 == j // 4 else "SYS" for j in range(8)] for i in range(8)]
    return {"source": "test", "devices": [f"GPU{i}" for i in range(8)], "links": links}


def cpu_machine(cores: int) -> Hardware:
    return Hardware(gpus=[], topology=None, driver_version=None, cuda_driver_version=None, nvml_version=None,
                    versions={}, cpu=CpuInfo(cores=cores), profile=None, source="test")


# -- packing ---------------------------------------------------------------------------------------------
def test_mixed_tp_sizes_on_8_gpus_never_overlap_or_oversubscribe():
    pool = packing.GpuPool.for_hardware(eight_gpus())
    assert pool.domains == [list(range(8))]
    busy: set[int] = set()
    lock, seen, errors = threading.Lock(), [], []

    def trial_runner(sizes):
        for n in sizes:
            gpus = pool.acquire(n)
            with lock:
                if len(gpus) != n or busy & set(gpus) or len(busy) + n > 8:
                    errors.append((n, gpus, set(busy)))
                busy.update(gpus)
                seen.append(gpus)
            time.sleep(0.002)  # holds its GPUs a moment, as a trial does, so that the runners overlap
            with lock:
                busy.difference_update(gpus)
            pool.release(gpus)

    runners = [threading.Thread(target=trial_runner, args=([1, 2, 4, 8, 2, 1, 4, 1] * 5,)) for _ in range(6)]
    for t in runners:
        t.start()
    for t in runners:
        t.join(30)
    assert not errors and len(seen) == 6 * 40
    assert all(tuple(range(8)) == g for g in seen if len(g) == 8)
    assert pool.free == set(range(8)) and not pool.waiting()


def wait_until(condition, timeout: float = 30.0, what: str = "condition"):
    """Poll until `condition()` holds (a deadline, not a guess at how long a thread takes to get there)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        time.sleep(0.005)


def test_tp8_waits_for_all_and_later_requests_queue_behind_it():
    pool = packing.GpuPool.for_hardware(eight_gpus())
    one = pool.acquire(1)
    got = {}
    big = threading.Thread(target=lambda: got.setdefault("tp8", pool.acquire(8)))
    big.start()
    wait_until(lambda: len(pool.queue) == 1 or got, what="the TP=8 request queued")
    small = threading.Thread(target=lambda: got.setdefault("tp1", pool.acquire(1)))
    small.start()
    wait_until(lambda: len(pool.queue) == 2 or "tp1" in got, what="the TP=1 request queued (or served)")
    assert got == {} and pool.waiting()  # 7 GPUs free, yet the TP=1 request does not jump the TP=8 one
    pool.release(one)
    big.join(30)
    assert got["tp8"] == tuple(range(8)) and "tp1" not in got
    pool.release(got["tp8"])
    small.join(30)
    assert got["tp1"] == (0,)
    with pytest.raises(ValueError, match="needs 16 GPUs"):
        pool.acquire(16)


def test_nvlink_domains_are_preferred_and_never_split():
    hw = eight_gpus(two_islands())
    pool = packing.GpuPool.for_hardware(hw)
    assert pool.domains == [[0, 1, 2, 3], [4, 5, 6, 7]]
    a = pool.acquire(1)
    b = pool.acquire(4)
    c = pool.acquire(2)
    assert (a, b, c) == ((0,), (4, 5, 6, 7), (2, 3))  # TP=4 in the untouched island; TP=2 an aligned pair
    assert pool.place(2) is None  # GPUs 1 and nothing else free in island A: a TP=2 waits, no PCIe pair
    pool.release(b)
    assert pool.place(2) == (4, 5)
    pool.release(a)
    pool.release(c)
    assert pool.place(8) == tuple(range(8))  # larger than any island: whole islands
    # No NVLink at all (PCIe-only topology) or no topology: all GPUs alike, one domain.
    pcie = {"links": [["X" if i == j else "PIX" for j in range(4)] for i in range(4)]}
    assert packing.nvlink_domains([0, 1, 2, 3], pcie) == [[0, 1, 2, 3]]
    assert packing.nvlink_domains([0, 1], None) == [[0, 1]]
    bridge = classify_from_fixture(os.path.join(FIXTURES, "rtx-a6000-2gpu-nvlink-bridge"))
    assert packing.nvlink_domains([0, 1], bridge.topology) == [[0, 1]]


def test_cuda_visible_devices_per_trial_and_ports():
    hw = eight_gpus()
    assert packing.usable_gpus(hw, {"CUDA_VISIBLE_DEVICES": "1,3,5,7"}) == [1, 3, 5, 7]
    with pytest.raises(ValueError, match="indices"):
        packing.usable_gpus(hw, {"CUDA_VISIBLE_DEVICES": "GPU-4f1c"})
    pool, ports = packing.GpuPool(list(range(8))), packing.PortBook()
    first, second = packing.Slot(pool, ports, adapter=get_adapter("sglang")), packing.Slot(pool, ports, adapter=get_adapter("vllm"))
    assert first.acquire({"tp_size": 4}) == {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert second.acquire({"tensor_parallel_size": 2}) == {"CUDA_VISIBLE_DEVICES": "4,5",
                                                           "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert second.acquire({}) == {"CUDA_VISIBLE_DEVICES": "4", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}  # relaunch: re-placed
    first.release()
    assert pool.free == {0, 1, 2, 3, 5, 6, 7}
    assert packing.Slot(packing.GpuPool([]), ports, adapter=get_adapter("sglang")).acquire({"tp_size": 2}) == {}  # CPU machine: no GPU environment
    held = [ports.reserve() for _ in range(40)]
    assert len(set(held)) == 40
    assert all(plain_bind(port) == errno.EADDRINUSE for port in held)  # held against other processes too
    ports.release(held[0])  # a slot that never launched on it: the hold goes with it
    assert held[0] not in ports.taken and plain_bind(held[0]) == 0
    for port in held[1:]:
        ports.release(port)


def test_parallel_count_and_cpu_thread_share():
    SGLANG, EMBEDDED = get_adapter("sglang"), get_adapter("embedded")  # noqa: N806
    sglang = load_space("sglang")
    assert parallel.arrange(sglang, eight_gpus(), "auto", SGLANG)[1] == 8  # TP=1 fits eight at once
    assert parallel.arrange(sglang.narrowed({"tp_size": 4}), eight_gpus(), "auto", SGLANG)[1] == 2
    assert parallel.arrange(sglang, eight_gpus(), "32", SGLANG)[1] == 8  # never more runners than GPUs
    embedded = load_space("embedded")
    space, slots = parallel.arrange(embedded, cpu_machine(8), 4, EMBEDDED)
    assert slots == 4 and space.params["threads"].fixed == 2  # each engine gets its share of the cores
    assert parallel.arrange(embedded, cpu_machine(8), "auto", EMBEDDED)[1] == 1  # a CPU trial measures the whole machine
    assert parallel.arrange(embedded.narrowed({"threads": 2}), cpu_machine(8), 4, EMBEDDED)[0].params["threads"].fixed == 2
    with pytest.raises(ValueError, match="need 8 CPU cores"):
        parallel.arrange(embedded.narrowed({"threads": 4}), cpu_machine(6), 2, EMBEDDED)
    with pytest.raises(ValueError, match="at least 3 CPU cores"):
        parallel.arrange(embedded, cpu_machine(2), 3, EMBEDDED)
    with pytest.raises(ValueError, match="--parallel must be"):
        parallel.arrange(embedded, cpu_machine(2), "many", EMBEDDED)


# -- a real PostgreSQL server ------------------------------------------------------------------------------
def _pg_bin(tool: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{tool}")) or [shutil.which(tool)]
    if not found[-1]:
        pytest.fail(f"PostgreSQL's {tool} is not installed: `bash setup.sh dev` (or apt-get install postgresql)")
    return found[-1]


@pytest.fixture(scope="module")
def postgres():
    """A throwaway PostgreSQL cluster on a free port; yields the URL of a fresh database."""
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []  # postgres refuses to run as root
    if as_user:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            pytest.fail("the `postgres` system user is missing: `bash setup.sh dev` (or apt-get install postgresql)")
    home = tempfile.mkdtemp(prefix="autotune-pg-")
    if as_user:
        shutil.chown(home, "postgres")
    data, port = os.path.join(home, "data"), packing.PortBook().reserve()
    run = {"capture_output": True, "timeout": 120}
    subprocess.run([*as_user, _pg_bin("initdb"), "-D", data, "-U", "postgres", "--auth=trust", "--no-sync",
                    "--no-locale", "-E", "UTF8"], check=True, **run)
    subprocess.run([*as_user, _pg_bin("pg_ctl"), "-D", data, "-l", os.path.join(home, "log"), "-w", "-t", "60",
                    "-o", f"-p {port} -k {home} -c listen_addresses=127.0.0.1 -c fsync=off", "start"], check=True, **run)
    try:
        subprocess.run([*as_user, _pg_bin("createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres",
                        "autotune"], check=True, **run)
        yield f"postgresql+psycopg2://postgres@127.0.0.1:{port}/autotune"
    finally:
        subprocess.run([*as_user, _pg_bin("pg_ctl"), "-D", data, "-m", "immediate", "stop"], capture_output=True,
                       timeout=60, check=False)
        shutil.rmtree(home, ignore_errors=True)


# Tiny benchmarks, one launch configuration per worker (draft_length is changed on the running server). The
# space holds twice the configurations a test asks for: with only as many, the sampler's repeats of measured ones
# can use up the idle-ask limit before it finds the last one (a worker then stops a trial short).
SMALL = {"workload": "code", "num_requests": 2, "quick_requests": 1, "concurrency": 2, "max_tokens": 8, "live": False,
         "min_measure_s": 0}
ONE_SERVER = ["drafter=ngram", "draft_policy=fixed", "ngram_min=1", "ngram_max=4", "prefill_ubatch=256",
              "dtype=float32", "quantization=none", "compile=none", "threads=1", "verify_slots=2", "draft_length=1..16"]


@pytest.fixture
def studies(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_STUDIES_DIR", str(tmp_path))
    return tmp_path


def create_study(name: str, url: str, trials: int = 1, **options) -> optuna.Study:
    """What `autotune run --storage URL` does, in this process: create the study and run its first trials."""
    outcome = loop.run_study(plan.build(plan.RunOptions(
        trials=trials, study=name, storage=url, **{"sets": ONE_SERVER, **SMALL, **options})))
    assert outcome.best is not None
    return optuna.load_study(study_name=name, storage=parallel.open_storage(url))


def start_worker(name: str, url: str, trials: int, studies_dir) -> subprocess.Popen:
    # Heartbeats every 10 s, a grace of a minute (parallel.GRACE_S): a live worker that a busy machine delays by
    # seconds is never taken for dead. A killed worker on this host needs no grace: its pid is gone
    # (parallel._gone), which the next sweep (every heartbeat interval) sees.
    env = {**os.environ, "AUTOTUNE_STUDIES_DIR": str(studies_dir), "AUTOTUNE_HEARTBEAT_S": "10"}
    return subprocess.Popen([sys.executable, "-m", "autotune.cli", "worker", "--study", name, "--storage", url,
                             "--trials", str(trials)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)


def check_accounted(study: optuna.Study, trials: int) -> list:
    """Every trial finished (none left RUNNING), ran by exactly one runner, and no configuration
    measured twice; the study reached its count."""
    all_trials = study.get_trials()
    assert [t.number for t in all_trials] == list(range(len(all_trials)))
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL) for t in all_trials)
    measured = [t for t in all_trials if t.user_attrs.get("measured")]
    assert trials <= len(measured) <= trials + 1  # two runners may both take the last one
    keys = [t.user_attrs["effective_key"] for t in all_trials if t.state != TrialState.FAIL
            and t.user_attrs.get("status") not in ("duplicate", "rejected")]
    assert len(keys) == len(set(keys)), "a configuration was measured twice"
    assert all(t.system_attrs.get(parallel.RUNNER) for t in measured)
    return all_trials


def wait(proc: subprocess.Popen, timeout: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"worker did not finish in {timeout} s:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    return out


def children(pid: int) -> list[int]:
    out = []
    for entry in (e for e in os.listdir("/proc") if e.isdigit()):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry))
        except OSError:
            continue
    return out


@pytest.mark.slow
def test_two_workers_share_a_postgres_study_one_is_killed_the_other_finishes(postgres, studies):
    study = create_study("shared", postgres)

    def victims():
        return [t for t in study.get_trials() if t.system_attrs.get(parallel.RUNNER, "").endswith(f" {victim.pid}")]

    # 8 trials: room for the victim to measure one and be killed in the next. The survivor starts once the
    # victim has claimed its first trial: it would have to launch and measure the other six before the victim,
    # ahead of it, asks for its second, which no scheduling of the two makes happen (started together, a
    # victim slowed by the freezes below could lose that race on a loaded machine).
    victim = start_worker("shared", postgres, 8, studies)
    deadline = time.monotonic() + 300  # a hang guard: launching an engine takes seconds
    while not victims():
        assert victim.poll() is None and time.monotonic() < deadline, "the victim never claimed a trial"
        time.sleep(0.2)  # between looks at the study
    survivor = start_worker("shared", postgres, 8, studies)
    # Kill the victim (SIGKILL: no chance to clean up) in a later trial, once it has measured one (a
    # duplicate or a rejected trial finishes without a measurement). Once it has, it is frozen (SIGSTOP)
    # while its trials are read, so a trial seen running cannot finish before the kill.
    running = []
    while not running and time.monotonic() < deadline and victim.poll() is None:
        if not any(t.state.is_finished() and t.user_attrs.get("measured") for t in victims()):
            time.sleep(0.2)
            continue
        victim.send_signal(signal.SIGSTOP)
        running = [t for t in victims() if t.state == TrialState.RUNNING]
        if not running:
            victim.send_signal(signal.SIGCONT)
            time.sleep(0.2)
    assert running, "the victim never got to a second trial"
    engines = children(victim.pid)
    victim.kill()
    victim.wait()
    for pid in engines:  # its engine server outlives it in its own process group
        os.killpg(pid, signal.SIGKILL)
    out = wait(survivor, 600)  # a hang guard: a launch, six small trials and a sweep
    assert "worker joined study shared" in out

    trials = check_accounted(study, 8)
    runners = {t.system_attrs[parallel.RUNNER].rsplit(" ", 1)[1] for t in trials if t.user_attrs.get("measured")}
    assert {str(victim.pid), str(survivor.pid)} <= runners, "both workers measured trials"
    dead = trials[running[0].number]
    assert dead.state == TrialState.FAIL and dead.user_attrs["failure_kind"] == "stale"
    assert str(victim.pid) in dead.user_attrs["failure"]

    # What any machine reads from the shared storage: the summary and the winner's launch script.
    show = CliRunner().invoke(app, ["show", "shared", "--storage", postgres])
    assert show.exit_code == 0 and "trial" in show.output, show.output
    export = CliRunner().invoke(app, ["export", "shared", "--storage", postgres, "--format", "sh",
                                      "--out", str(studies / "out")])
    assert export.exit_code == 0 and "--drafter ngram" in (studies / "out" / "launch.sh").read_text(), export.output


def recorded_heartbeat(rdb, trial: optuna.Trial):
    """The trial's last heartbeat as the database holds it (None before the first)."""
    from optuna.storages._rdb.models import TrialHeartbeatModel
    from optuna.storages._rdb.storage import _create_scoped_session

    with _create_scoped_session(rdb.scoped_session) as session:
        beat = TrialHeartbeatModel.where_trial_id(trial._trial_id, session)
        return None if beat is None else beat.heartbeat


def test_heartbeats_keep_a_live_remote_trial_and_fail_a_silent_one(postgres, monkeypatch):
    # A beat every second, a grace of a minute: a live runner that a busy machine delays by seconds is
    # never taken for dead. The silent runner's last beat is written an hour back, as a runner that
    # stopped an hour ago leaves it: no sleeping through the grace period.
    monkeypatch.setattr(parallel, "HEARTBEAT_S", 1)
    monkeypatch.setattr(parallel, "GRACE_S", 60)
    rdb = parallel.open_storage(postgres)
    study = optuna.create_study(study_name="beats", storage=rdb)
    remote, silent, unclaimed = study.ask(), study.ask(), study.ask()
    for trial in (remote, silent):  # runners on another machine: only their heartbeat can tell
        study._storage.set_trial_system_attr(trial._trial_id, parallel.RUNNER, "elsewhere pid:[1] 7")
    study._storage.record_heartbeat(silent._trial_id)
    from sqlalchemy import text

    with rdb.engine.begin() as db:
        db.execute(text("UPDATE trial_heartbeats SET heartbeat = heartbeat - interval '1 hour' WHERE trial_id = :id"),
                   {"id": silent._trial_id})
    with parallel.Heartbeat(study, remote):
        study._storage.set_trial_system_attr(remote._trial_id, parallel.RUNNER, "elsewhere pid:[1] 7")
        beats, deadline = set(), time.monotonic() + 60
        while len(beats) < 3 and time.monotonic() < deadline:  # it keeps beating: three distinct beats
            beats.add(recorded_heartbeat(rdb, remote))
            beats.discard(None)
            time.sleep(0.05)
        assert len(beats) >= 3, beats
        assert [t.number for t in parallel.stale_trials(study)] == [silent.number]
        # Resuming (autotune run --resume) also fails the trial nobody claimed, never the live one.
        assert [t.number for t in parallel.stale_trials(study, resume=True)] == [silent.number, unclaimed.number]
        assert parallel.fail_stale(study, resume=True) == 2
    states = {t.number: t.state for t in study.get_trials()}
    assert states == {remote.number: TrialState.RUNNING, silent.number: TrialState.FAIL,
                      unclaimed.number: TrialState.FAIL}


@pytest.mark.slow
def test_parallel_run_then_two_workers_on_a_journal_file(studies):
    url = str(studies / "shared-fs" / "journal.log")
    # `autotune run --parallel 2`: two engines side by side, the CPU cores split between them.
    study = create_study("journal", url, trials=2, parallel=2, sets=[s for s in ONE_SERVER if s != "threads=1"])
    first, cores = study.get_trials()[:2], probe("cpu").cpu.cores
    assert all(t.user_attrs["launch"] == "launched" and t.user_attrs["config"]["threads"] == cores // 2 for t in first)
    assert first[1].datetime_start < first[0].datetime_complete and first[0].datetime_start < first[1].datetime_complete
    ports = {t.user_attrs["argv"][t.user_attrs["argv"].index("--port") + 1] for t in first}
    assert len(ports) == 2
    workers = [start_worker("journal", url, 3, studies) for _ in range(2)]  # one trial left: one runs it, one waits
    for w in workers:
        wait(w, 240)
    trials = check_accounted(study, 3)
    assert len([t for t in trials if t.number > 1 and t.user_attrs.get("measured")]) == 1
