"""The tuner facing an engine that hangs mid-benchmark (alive, answering nothing): a real `autotune serve`
launched by the study is stopped with SIGSTOP while its full benchmark is in flight (as the client reads the
benchmark's first chunk). The trial must end at its deadline with the reason recorded, the engine's process
group must be gone (SIGKILL: a stopped process never acts on SIGTERM), and the next trial must launch on a free
port and measure. And a stopped server that
is stopped the polite way (Launcher.stop) is continued, so it acts on the SIGTERM at once."""
import os
import signal
import time

import optuna
import pytest
from conftest import serve_argv
from optuna.trial import TrialState

from autotune.engines.launcher import Launcher, free_port
from autotune.study import loop, plan, record
from autotune.study import trial as trial_life

SMALL = {"workload": "code", "num_requests": 4, "quick_requests": 2, "concurrency": 2, "max_tokens": 8, "live": False,
         "min_measure_s": 0}
# One launch configuration but for verify_slots, so the second trial is a new effective config (not a duplicate).
SETS = ["drafter=ngram", "draft_policy=fixed", "ngram_min=1", "ngram_max=4", "prefill_ubatch=256", "dtype=float32",
        "quantization=none", "compile=none", "threads=1", "draft_length=3", "verify_slots=4,3"]


def stop_at_the_full_benchmarks_first_chunk(monkeypatch, stopped: dict):
    """SIGSTOP trial 0's server as the client reads the first chunk of its full benchmark: requests of the
    benchmark are in flight then by construction (that one mid-stream, the rest not yet answered), whatever
    this machine's speed; no thread polls the study and the server, racing a benchmark a fast machine
    finishes first."""
    from autotune.bench import client

    real_measure, real_read_chunk, armed = trial_life.measure, client.read_chunk, {}

    def measure(p, servers, num_requests, request_timeout=None, deadline_s=None):
        if deadline_s is not None and not armed:  # the first full benchmark: trial 0's, after its quick wave
            armed["pgid"] = servers.server.proc.pid  # start_new_session: the group id is the leader's pid
        return real_measure(p, servers, num_requests, request_timeout=request_timeout, deadline_s=deadline_s)

    def read_chunk(rec, chunk, t):
        real_read_chunk(rec, chunk, t)
        if armed and not stopped:
            os.killpg(armed["pgid"], signal.SIGSTOP)
            stopped.update(pgid=armed["pgid"], at=time.time())

    monkeypatch.setattr(trial_life, "measure", measure)
    monkeypatch.setattr(client, "read_chunk", read_chunk)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.mark.slow
def test_engine_stopped_mid_benchmark_ends_the_trial_at_its_deadline_and_the_next_one_measures(tmp_path, monkeypatch):
    p = plan.build(plan.RunOptions(trials=2, study="hang", studies_root=str(tmp_path), sets=SETS, **SMALL))
    stopped: dict = {}
    stop_at_the_full_benchmarks_first_chunk(monkeypatch, stopped)
    try:
        outcome = loop.run_study(p)
    finally:
        if stopped.get("pgid") and group_alive(stopped["pgid"]):  # the behaviour under test failed: clean up
            os.killpg(stopped["pgid"], signal.SIGKILL)
    assert stopped, "trial 0's full benchmark was never seen in flight"
    hung, *rest = optuna.load_study(study_name=outcome.name, storage=outcome.storage).get_trials()

    # Ended at its deadline, with the reason recorded.
    attrs = hung.user_attrs
    assert hung.state == TrialState.PRUNED and hung.constraints["feasible"] > 0
    assert attrs["status"] == record.FAILED and attrs["failure_kind"] == "timeout"
    assert "benchmark still running at its deadline" in attrs["failure"] and "process group was killed" in attrs["failure"]
    deadline = attrs["timings"]["bench_deadline_s"]
    quick_n, full_n = SMALL["quick_requests"], SMALL["num_requests"]
    assert deadline == max(trial_life.BENCH_DEADLINE_FLOOR_S,
                           trial_life.BENCH_DEADLINE_FACTOR * attrs["quick"]["duration_s"] * full_n / quick_n)
    timings = attrs["timings"]
    benchmarked = timings["total_s"] - sum(timings.get(k) or 0 for k in ("launch_s", "warmup_s", "quick_s"))
    # At its deadline: not before it (a lower bound on the watchdog's wait, which a slower machine only
    # exceeds), and not each request's 2-minute client timeout in turn. The 15 s over the deadline are a hang
    # guard for what follows the kill (the client seeing the closed sockets, the trial's records: about a
    # second on this loaded 2-core machine); the failure message above says the watchdog ended it.
    assert deadline - 1 <= benchmarked < deadline + 15
    assert 0 < hung.datetime_complete.timestamp() - stopped["at"] < deadline + 15

    # The process group is gone: SIGKILL ended the stopped processes.
    assert not group_alive(stopped["pgid"])

    # The next trial launched (on a port free at the time) and measured.
    nxt = next(t for t in rest if t.user_attrs.get("status") != record.DUPLICATE)
    assert nxt.user_attrs["status"] == record.OK and nxt.user_attrs["launch"] == "launched", nxt.user_attrs
    assert nxt.user_attrs["metrics"]["completed"] == full_n
    assert nxt.user_attrs["config"]["verify_slots"] != attrs["config"]["verify_slots"]
    assert outcome.launches == 2


@pytest.mark.slow
def test_stopping_a_stopped_server_continues_it_so_sigterm_ends_it_cleanly(tmp_path):
    port = free_port()
    server = Launcher(serve_argv(port, {"drafter": "none", "verify_slots": 1, "max_seq_len": 256}),
                      log_path=tmp_path / "serve.log", health_url=f"http://127.0.0.1:{port}/health")
    server.start(timeout=300)
    pgid = server.proc.pid
    os.killpg(pgid, signal.SIGSTOP)
    code = server.stop(grace_s=120)
    # Exit 0 is autotune serve's own SIGTERM shutdown, within the grace period (no wall clock needed to say so);
    # without SIGCONT the SIGTERM would wait, pending, for the whole grace period and SIGKILL would end it (-9).
    assert code == 0, server.log_tail()
    assert not group_alive(pgid)
