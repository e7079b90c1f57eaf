"""The study behind `autotune run`: real embedded engine over HTTP, real Optuna SQLite storage."""
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from types import SimpleNamespace

import optuna
import pandas as pd
import pytest
import yaml
from optuna.trial import TrialState

from autotune.engines.embedded import EmbeddedAdapter
from autotune.study import loop, objectives, plan, price_memory, record, storage
from autotune.study import trial as trial_life
from autotune.bench import runner
from autotune.bench.runner import MAX_LOAD_FACTOR, sized_load
from autotune.study import budget as budget_mod
from autotune.study.budget import Budget, Finish, Prices
from autotune.study.live import LiveView
from autotune.validate.race import fitting_round

# Tiny benchmarks: these tests are about the loop, not the numbers.
SMALL = dict(workload="code", num_requests=2, quick_requests=1, concurrency=2, max_tokens=8, live=False, min_measure_s=0)
# One launch configuration (only the runtime knob draft_length and the crash switch vary).
ONE_SERVER = ["drafter=ngram", "draft_policy=fixed", "ngram_min=1", "ngram_max=4", "prefill_ubatch=256",
              "dtype=float32", "quantization=none", "compile=none", "threads=1"]


# A stand-in for a hopelessly slow engine: healthy, lists a model, answers the warm-up wave (SMALL's
# concurrency, 2 requests) at once, then never answers a completion in time.
STALLING_SERVER = """
import http.server, json, sys, time
class H(http.server.BaseHTTPRequestHandler):
    posts = 0
    def do_GET(self):
        body = json.dumps({"data": [{"id": "slow"}]}).encode() if self.path == "/v1/models" else b"ok"
        self.send_response(200 if self.path in ("/health", "/v1/models") else 404)
        self.end_headers()
        self.wfile.write(body)
    def do_POST(self):
        H.posts += 1
        if H.posts <= 2:
            self.send_response(503)
            self.end_headers()
            return
        time.sleep(60)  # the behaviour under test: a completion that never comes within the quick timeout
        # then the handler returns without answering: a client still waiting gets a broken stream, not a timeout
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


class SlowOnThreeSlots(EmbeddedAdapter):
    """The real engine, except that verify_slots=3 starts a server that never finishes a request:
    real configurations are not slow by a reliable factor on a shared machine."""

    def command(self, config, *, port, **kw):
        if config.get("verify_slots") == 3:
            return [sys.executable, "-c", STALLING_SERVER, str(port)], {}
        return super().command(config, port=port, **kw)


class CrashOnThreeSlots(EmbeddedAdapter):
    """The real engine, except that verify_slots=3 starts a process that dies at startup: a failure
    the real engine cannot be made to produce on demand."""

    def command(self, config, **kw):
        if config.get("verify_slots") == 3:
            return [sys.executable, "-c", "import sys; print('fake engine: cannot start'); sys.exit(3)"], {}
        return super().command(config, **kw)


def trials_of(outcome):
    return optuna.load_study(study_name=outcome.name, storage=outcome.storage).get_trials()


@pytest.fixture
def studies(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_STUDIES_DIR", str(tmp_path))
    return tmp_path


@pytest.mark.slow
def test_small_study_records_reuses_dedupes_and_resumes(studies):
    opts = plan.RunOptions(trials=3, study="small", sets=ONE_SERVER + ["draft_length=3,5", "verify_slots=2"],
                             **SMALL)
    outcome = loop.run_study(plan.build(opts))
    trials = trials_of(outcome)
    by_status = {}
    for t in trials:
        by_status.setdefault(t.user_attrs.get("status"), []).append(t)

    # Real measurements, recorded with argv, log and metrics in the SQLite file.
    assert (studies / "small" / "study.db").exists()
    ok = by_status["ok"]
    assert {t.user_attrs["config"]["draft_length"] for t in ok} == {3, 5}
    for t in ok:
        assert t.state == TrialState.COMPLETE and t.values[0] == t.user_attrs["metrics"]["output_tok_s"] > 0
        assert "--drafter" in t.user_attrs["argv"] and os.path.exists(t.user_attrs["log"])
        assert t.user_attrs["effective"]["drafter"] == "ngram"
    # Only the runtime knob differed between the two good configs: one launch, one reuse.
    assert {t.user_attrs["launch"] for t in ok} == {"launched", "reused"}
    assert outcome.launches_saved >= 1
    # Only two distinct configurations exist: further trials reuse recorded results, no launch.
    dupes = by_status["duplicate"]
    assert dupes and all(trials[d.user_attrs["duplicate_of"]].user_attrs["effective_key"]
                         == d.user_attrs["effective_key"] for d in dupes)
    assert outcome.launches == 1
    assert (studies / "small" / "trials.parquet").exists()
    # Each measured trial's per-request table, with what an acceptance estimator fits on.
    requests = pd.read_parquet(ok[0].user_attrs["requests_file"])
    assert requests["accept_length"].gt(0).all() and requests["spec_draft_tokens"].gt(0).all()
    assert {"spec_accepted_tokens", "spec_verify_steps", "prompt_entropy", "prompt", "temperature", "top_p"} <= set(requests)
    assert (requests["trial"] == ok[0].number).all() and requests["prompt"].str.len().gt(0).all()
    # The run options validation re-runs the winners with.
    recorded = optuna.load_study(study_name="small", storage=outcome.storage).user_attrs
    assert {k: recorded[k] for k in ("concurrency", "num_requests", "max_tokens", "seed", "workload", "slo")} == \
        {"concurrency": 2, "num_requests": 2, "max_tokens": 8, "seed": 0, "workload": "code", "slo": None}
    assert json.loads((studies / "small" / "provenance.json").read_text())["model_sha256"]

    # A killed run leaves a RUNNING trial; --resume marks it failed and continues the study.
    study = optuna.load_study(study_name="small", storage=outcome.storage)
    stale = study.ask()
    resumed = loop.run_study(plan.build(plan.RunOptions(**{**opts.__dict__, "resume": True, "trials": 4})))
    after = trials_of(resumed)
    assert resumed.stale_failed == 1
    assert after[stale.number].state == TrialState.FAIL and after[stale.number].user_attrs["failure_kind"] == "stale"
    assert len(after) > stale.number + 1 and not any(t.state == TrialState.RUNNING for t in after)


@pytest.mark.slow
def test_engine_crash_at_startup_is_recorded_and_study_goes_on(studies):
    p = plan.build(plan.RunOptions(trials=3, study="crash", sets=ONE_SERVER + ["draft_length=3,5", "verify_slots=3"],
                                      **SMALL))
    p.adapter = CrashOnThreeSlots()
    outcome = loop.run_study(p)
    failed = [t for t in trials_of(outcome) if t.user_attrs.get("status") == "failed"]
    # Both configurations were tried: the first crash did not end the study.
    assert {t.user_attrs["config"]["draft_length"] for t in failed} == {3, 5} and outcome.launches == 2
    for t in failed:
        assert t.user_attrs["failure_kind"] == "crash" and "cannot start" in t.user_attrs["failure"]
        assert t.constraints["feasible"] > 0 and t.state == TrialState.PRUNED  # infeasible: TPE samples away
        assert "fake engine" in open(t.user_attrs["log"]).read()


@pytest.mark.slow
def test_hardware_and_memory_violations_rejected_before_launch(studies):
    # --gpu cpu: CUDA graphs are refused because the run is told it has no GPU, whatever this machine has.
    outcome = loop.run_study(plan.build(plan.RunOptions(
        trials=1, study="cuda-on-cpu", gpu="cpu", sets=["cuda_graph_batch_sizes=[1,2]", "verify_slots=100000"],
        **SMALL)))
    trials = trials_of(outcome)
    assert outcome.launches == 0 and outcome.best is None
    assert trials and all(t.user_attrs["status"] == "rejected" and t.state == TrialState.PRUNED for t in trials)
    assert "CUDA" in trials[0].user_attrs["failure"] and trials[0].user_attrs["failure_kind"] == "hardware"
    # 100,000 slots x 2048 tokens of KV cache (~9 TB) fit no machine's RAM: the prediction says so, with numbers.
    memory = trials[0].user_attrs["memory"]
    assert not memory["fits"] and memory["weights_gb"] > 0 and memory["kv_gb_per_1k_tokens"] > 0
    assert "memory: does not fit" in trials[0].user_attrs["failure"] and "GB" in memory["reason"]
    assert not list((studies / "cuda-on-cpu" / "logs").iterdir())


@pytest.mark.slow
def test_hopelessly_slow_config_is_pruned_by_the_quick_timeout(studies, monkeypatch):
    monkeypatch.setattr(trial_life, "QUICK_TIMEOUT_FLOOR_S", 1.0)  # the tiny defaults wave sets the limit alone
    p = plan.build(plan.RunOptions(trials=2, study="slow", sets=ONE_SERVER + ["draft_length=3", "verify_slots=4,3"],
                                      **SMALL))
    p.adapter = SlowOnThreeSlots()
    trials = trials_of(loop.run_study(p))
    assert trials[0].user_attrs["config"]["verify_slots"] == 4 and trials[0].user_attrs["status"] == "ok"  # the defaults
    slow = next(t for t in trials if t.user_attrs.get("config", {}).get("verify_slots") == 3)
    reference = trials[0].user_attrs["quick"]["duration_s"]
    limit = max(trial_life.QUICK_TIMEOUT_FLOOR_S, trial_life.QUICK_TIMEOUT_FACTOR * reference)
    assert slow.state == TrialState.PRUNED and slow.user_attrs["failure_kind"] == "timeout"
    # The limit the requests were given is the defaults trial's quick wave times the factor (the numbers the
    # trial recorded, not a reading of this machine's clock) ...
    assert f"took over {limit:.0f} s ({trial_life.QUICK_TIMEOUT_FACTOR:g}x the defaults trial 0's {reference:.1f} s)" \
        in slow.user_attrs["failure"] and slow.constraints["feasible"] > 0
    # ... and every request ended at a timeout, before the stalling server gave up on it at 60 s (a broken
    # stream): not the client's 2 minutes.
    assert (pd.read_parquet(studies / "slow" / "requests" / f"trial-{slow.number}.parquet")["error_kind"] == "timeout").all()


@pytest.mark.slow
def test_predicted_configurations_are_new_and_fit(studies):
    p = plan.build(plan.RunOptions(gpu="h100-sxm5", study="predicted", **SMALL))
    study = optuna.create_study(direction="maximize")
    first = loop.predicted_configs(p, study)
    assert len(first) == loop.PREDICTED_SEEDS
    for config, prediction in first:
        assert all(p.space.params[k].contains(v) for k, v in config.items() if v is not None)
        assert prediction["memory"]["fits"] and prediction["speed"]["single_tok_s"] > 0
    # Once the best is queued, it is not proposed again.
    study.enqueue_trial(p.space.trial_params(first[0][0]), user_attrs={"seed_config": first[0][0]})
    again = [record.effective_key(p.adapter, c) for c, _ in loop.predicted_configs(p, study)]
    assert record.effective_key(p.adapter, first[0][0]) not in again and len(again) == loop.PREDICTED_SEEDS
    # No GPU (--gpu cpu, whatever this machine has): the roofline's CPU ranking is flat, nothing is proposed.
    assert loop.predicted_configs(plan.build(plan.RunOptions(study="cpu", gpu="cpu", **SMALL)), study) == []


def test_predicted_configurations_on_a_gpu_are_compiled_and_the_first_reuses_a_seeds_server():
    """On the H200 the uncompiled engine runs 10-20x below the compiled one (benchmarks/results/h200-2026-12-02):
    the model reads compile and CUDA graphs, so no predicted pick is eager; and among picks it cannot tell
    apart, the first is a runtime-only change of a queued seed (a running server), not a new launch."""
    for concurrency in (1, 4):
        p = plan.build(plan.RunOptions(gpu="h200-sxm", study="queue", concurrency=concurrency, live=False))
        queued = loop.planned_queue(p)
        seeds = [c for kind, c in queued if kind == "seed"]
        predicted = [c for kind, c in queued if kind == "predicted"]
        assert len(predicted) == loop.PREDICTED_SEEDS
        assert all(c["compile"] == "inductor" and c["cuda_graph_batch_sizes"] for c in predicted), predicted
        assert min(loop.launch_distance(p.adapter, predicted[0], s) for s in seeds) == 0, (predicted[0], seeds)


def cli(*args, env_dir, **kw):
    env = {**os.environ, "AUTOTUNE_STUDIES_DIR": str(env_dir)}
    return subprocess.Popen([sys.executable, "-m", "autotune.cli", "run", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **kw)


@pytest.mark.slow
def test_bad_input_is_one_line_exit_2_and_study_intact(tmp_path):
    db = tmp_path / "keep" / "study.db"
    db.parent.mkdir()
    storage = f"sqlite:///{db}"
    study = optuna.create_study(study_name="keep", storage=storage, direction="maximize")
    study.tell(study.ask(), 1.0)
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    bad_space = tmp_path / "bad.yaml"
    bad_space.write_text("parameters: {k: {type: int, low: 1}}\n")
    for args in (["--set", "nope=1"], ["--space", str(bad_space)], ["--slo", "p95_ttft_ms<<5"],
                 ["--engine", "vllm", "--engine-binary", "/nonexistent"], ["--budget", "soon"]):
        proc = cli("--study", "keep", "--storage", storage, "--resume", *args, env_dir=tmp_path)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, (args, err)
        assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, (args, err)
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before
    proc = cli("--study", "keep", "--storage", storage, "--set", "drafter=none", env_dir=tmp_path)  # no --resume
    assert proc.communicate(timeout=120)[1].startswith("error: study 'keep' already exists") and proc.returncode == 2


@pytest.mark.slow
def test_sigint_stops_after_current_trial(tmp_path):
    proc = cli("--study", "interrupted", "--trials", "10", "--num-requests", "2", "--concurrency", "2", "--min-measure", "0",
               "--max-tokens", "8", *[a for s in ONE_SERVER + ["verify_slots=2"] for a in ("--set", s)],
               env_dir=tmp_path)
    log = tmp_path / "interrupted" / "logs" / "trial-0.log"
    deadline = time.monotonic() + 180
    while not log.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)  # mid-trial: the server is starting
    out, err = proc.communicate(timeout=240)
    assert "stopping after the current trial" in out
    trials = optuna.load_study(study_name="interrupted", storage=f"sqlite:///{tmp_path / 'interrupted' / 'study.db'}").trials
    assert len(trials) == 1 and trials[0].user_attrs["status"] == "ok"  # that trial ran to the end; the seeds it
    # never reached left no placeholder trial behind
    assert not any(t.state == TrialState.RUNNING for t in trials)
    assert proc.returncode == 0 and (tmp_path / "interrupted" / "trials.parquet").exists()


@pytest.mark.slow
def test_seeds_the_run_never_reached_leave_no_trial_and_run_on_resume(studies, tmp_path):
    space = yaml.safe_load(open(plan.load_space("embedded").source))
    space["seeds"] = [{"drafter": "ngram", "draft_length": k} for k in (3, 5, 7)]
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(space, sort_keys=False))
    opts = plan.RunOptions(trials=1, study="queued", space=str(path), sets=ONE_SERVER, **SMALL)
    outcome = loop.run_study(plan.build(opts))
    study = optuna.load_study(study_name="queued", storage=outcome.storage)
    assert study.metric_names == ["output_tok_s"]  # named in the storage, for the optuna CLI and dashboards
    # Only what ran is a trial: no WAITING or FAIL placeholders for the seeds the trial count left out.
    assert [(t.state, t.user_attrs["seed_config"]["draft_length"]) for t in study.trials] == [(TrialState.COMPLETE, 3)]
    resumed = loop.run_study(plan.build(plan.RunOptions(**{**opts.__dict__, "resume": True, "trials": 2})))
    after = trials_of(resumed)
    measured = [t.user_attrs["config"]["draft_length"] for t in after if t.user_attrs.get("status") == "ok"]
    assert measured == [3, 5]  # the resumed run measured the first seed it had not reached
    assert len(after) == 2


# -- autotune run --plan (issue 16 point 1) ----------------------------------------------------------------
def planned(*args, env_dir):
    proc = cli("--plan", *args, env_dir=env_dir)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    assert not any(env_dir.iterdir())  # nothing launched, no study created
    space = dict(line.split(None, 1) for line in out.split("space:\n")[1].split("\n\n")[0].splitlines())
    queued = out.split("queued first")[1].splitlines()[1:]
    return space, [line for line in queued if line.strip()]


@pytest.mark.slow
def test_plan_prints_the_space_and_seeds_fitted_to_an_h200_and_the_load(tmp_path):
    for concurrency, sizes in ((4, "[1, 2, 4]"), (8, "[1, 2, 4, 8]")):
        space, queued = planned("--gpu", "h200-sxm", "--concurrency", str(concurrency), env_dir=tmp_path)
        assert space["cuda_graph_batch_sizes"] == f"[] | {sizes}"
        assert "inductor" in space["compile"] and "bfloat16" in space["dtype"]
        assert space["verify_slots"].startswith(f"1..{max(4, concurrency)}") and space["threads"] == "= None"
        assert "gguf" not in space["quantization"]
        assert "seed      (the defaults)" in queued[3]  # after the fitted seeds on a GPU (validation measures it)
        fast = [q for q in queued if "compile=inductor" in q and " predicted " not in q]
        assert fast == queued[:3] and all(f"cuda_graph_batch_sizes={sizes}" in q and "dtype=bfloat16" in q for q in fast)
        assert "drafter" not in fast[0] and all("drafter=ngram" in q for q in fast[1:])
        assert ("verify_slots=8" in fast[0]) == (concurrency == 8)  # 4 slots are the default: not a change
        assert any(" predicted " in q for q in queued)  # the roofline's picks after the seeds, on a GPU profile


def test_the_defaults_seed_is_marked_and_is_the_baseline_wherever_it_is_queued(studies):
    """On a GPU the fitted seeds are queued before the defaults; validation's baseline is still the defaults
    (with speculation off), found by the seed's mark rather than its place; on a CPU the defaults stay first."""
    from autotune.validate.baseline import baseline_config

    p = plan.build(plan.RunOptions(gpu="h200-sxm", study="order", **{**SMALL, "concurrency": 4}))
    study = optuna.create_study(direction="maximize")
    queued = [attrs for _, attrs in loop.seed_queue(p, study, p.space.seed_configs())]
    defaults = p.space.defaults()
    marked = [i for i, attrs in enumerate(queued) if attrs.get("defaults_seed")]
    assert marked == [3] and queued[3]["seed_config"] == defaults
    assert all(attrs["seed_config"]["compile"] == "inductor" for attrs in queued[:3])
    # The run records the defaults seed on the study: the baseline before (or without) its trial running.
    study.set_user_attr("defaults_seed_config", defaults)
    study.enqueue_trial(p.space.trial_params(queued[0]["seed_config"]), user_attrs=queued[0])  # a fitted seed ran
    config, trial = baseline_config(SimpleNamespace(study=study, adapter=p.adapter))
    assert config == {**defaults, **p.adapter.facts.speculation_off} and trial is None  # queued, not yet measured
    cpu = plan.build(plan.RunOptions(gpu="cpu", study="order-cpu", **SMALL))
    assert cpu.space.seed_configs()[0] == cpu.space.defaults()


@pytest.mark.slow
def test_plan_for_a_cpu_keeps_threads_and_gguf(tmp_path):
    from autotune.hardware import probe

    space, queued = planned("--gpu", "cpu", env_dir=tmp_path)
    assert space["compile"] == "= 'none'" and space["cuda_graph_batch_sizes"] == "= []"
    assert space["threads"] == f"1..{probe('cpu').cpu.cores}"
    assert "gguf" in space["quantization"] and any("quantization=gguf" in q for q in queued)
    assert not any("inductor" in q or "predicted" in q for q in queued)
    other, _ = planned("--gpu", "a100-80gb-sxm4", "--concurrency", "2", env_dir=tmp_path)
    assert other["cuda_graph_batch_sizes"] == "[] | [1, 2]"


# -- compile is launch cost (issue 16 point 2) -----------------------------------------------------------
# The embedded engine compiles at start-up, so what a compile costs at the first requests (where an engine
# compiles lazily, or captures its graphs) is made the input here: the compiled server's first request is held
# for a fixed time, longer than the quick limit. Whether the warm-up absorbs it is then the pipeline's doing,
# whatever this machine's speed; a real compile's cost against a measured wave is not a comparison that holds
# on every machine.
FIRST_REQUEST_HOLD = """
import sys, time
from autotune.embedded import scheduler
hold, submit = [float(sys.argv.pop(1))], scheduler.Engine.submit
def held_submit(self, *args, **kwargs):
    if hold[0]:  # the one-time cost, at the first request as a lazy compile pays it
        time.sleep(hold[0])
        hold[0] = 0.0
    return submit(self, *args, **kwargs)
scheduler.Engine.submit = held_submit
from autotune.cli import app
app()
"""


class FirstRequestHeld(EmbeddedAdapter):
    """The real engine; a compiled one (`compile` set) also holds its first request for `hold_s`."""

    def __init__(self, hold_s: float):
        super().__init__()
        self.hold_s = hold_s

    def command(self, config, **kw):
        argv, env = super().command(config, **kw)
        if config.get("compile", "none") != "none":
            assert argv[1:3] == ["-m", "autotune.cli"], argv
            argv = [argv[0], "-c", FIRST_REQUEST_HOLD, str(self.hold_s), *argv[3:]]
        return argv, env


@pytest.mark.slow
def test_compile_is_warmed_up_not_pruned_for_its_compile_time(studies, tiny_checkpoint):
    """A plain trial sets the quick timeout (3x its quick wave, at least the 10 s floor); a torch.compile trial
    after it pays a one-time cost at its first request longer than that. That is launch cost: the trial is
    measured, its warm-up seconds recorded and counted in its time, and not pruned."""
    # One stream, no drafter, a 2-layer model: the fewest shapes and layers to compile on a CPU (torch.compile is
    # slow there); the held first request is the cost that matters here. Chat prompts fit its 128 positions.
    pins = ["drafter=none", "verify_slots=1", "prefill_ubatch=256", "dtype=float32", "quantization=none", "threads=1"]
    load = {**SMALL, "workload": "chat", "concurrency": 1, "launch_timeout_s": 900.0}
    plain = plan.RunOptions(trials=1, study="compiled", sets=[*pins, "compile=none"], model=tiny_checkpoint, **load)
    first = trials_of(loop.run_study(plan.build(plain)))[0]
    assert first.user_attrs["status"] == "ok" and first.user_attrs["warmup_s"] > 0
    assert first.user_attrs["timings"]["compile_s"] == 0.0  # the engine's own report: nothing compiled at start-up
    limit = max(trial_life.QUICK_TIMEOUT_FLOOR_S, trial_life.QUICK_TIMEOUT_FACTOR * first.user_attrs["quick"]["duration_s"])
    hold = limit + 1.0  # longer than the limit by construction: a quick wave that paid it would time out
    compiled = plan.build(plan.RunOptions(**{**plain.__dict__, "sets": [*pins, "compile=aot_eager"], "resume": True,
                                             "trials": 2}))
    compiled.adapter = FirstRequestHeld(hold)
    trial = trials_of(loop.run_study(compiled))[1]
    a = trial.user_attrs
    assert a["config"]["compile"] == "aot_eager" and "--compile" in a["argv"]
    assert trial.state == TrialState.COMPLETE and a["status"] == "ok", a.get("failure")
    # The hold was paid in the warm-up's first wave (a wait: at least `hold` on any machine), not in the quick wave.
    assert a["warmup_waves_s"][0] >= hold - 1e-3 and a["timings"]["warmup_s"] == a["warmup_s"] >= hold - 1e-3
    assert a["timings"]["total_s"] > a["timings"]["launch_s"] + a["warmup_s"]  # in the trial's time: what the budget counts
    # the engine compiled before it answered and said so on /metrics: the part a relaunch's cache saves
    assert 0 < a["timings"]["compile_s"] < a["timings"]["launch_s"]


# -- the budget and launch sharing (issues 16 point 6, 30 points 1-2) ---------------------------------------
def priced_trial(warmup_s: float, launch_s: float = 10.0, tokens: int = 16, **reported) -> optuna.trial.FrozenTrial:
    """A measured trial as the loop records it: launched (by default in 10 s), warmed up, 16 tokens (by default)
    benchmarked in 8 s; `reported`: timings the engine gave (compile_s)."""
    return optuna.trial.create_trial(value=1.0, user_attrs={
        "status": record.OK, "launch": "launched", "metrics": {"total_output_tokens": tokens},
        "timings": {"launch_s": launch_s, "warmup_s": warmup_s, "bench_s": 8.0, **reported}})


def test_prices_charge_a_cold_compile_once_and_the_finish_is_held_back():
    """A first launch's cold compile is not the price of every next one (at concurrency 8 on the H200 a 184 s
    first launch, compiled before the engine answered, stopped an 8-minute search after one trial): the next
    launch is charged the warm launches seen since, none while only the cold one is known (the deadline cuts
    a trial that overruns), and until a warm one is known a third of the budget is held back for the finish.
    Then the finish (validation's first round and the estimator's passes) is held back at those prices."""
    cold_only = Prices.of([priced_trial(150.0)], concurrency=2)
    assert cold_only.trial_s(reuses_server=False) == pytest.approx(1.2 * 8)
    assert cold_only.launch_s == 160.0  # validation relaunches: the only launch seen, in full
    finish = Finish(top=3, repeats=3, quality_prompts=4, estimator_passes=True)
    assert Budget(3600, finish, start=0.0).search_deadline(cold_only) == pytest.approx(2400)
    prices = Prices.of([priced_trial(150.0), priced_trial(20.0)], concurrency=2)
    assert prices.trial_s(reuses_server=True) == pytest.approx(9.6)
    assert prices.trial_s(reuses_server=False) == pytest.approx(9.6 + 10 + 20) and prices.launch_s == 30.0
    assert prices.request_s == pytest.approx(8.0 * 2 / 16 * 32)  # two streams side by side, 32 tokens alone
    assert finish.validation_s(prices) == pytest.approx(4 * (30 + 4 * prices.request_s) + 4 * 3 * 8)
    assert finish.estimator_s(prices) == pytest.approx(2 * 30 + 80 * prices.request_s)
    assert Budget(3600, finish, start=0.0).search_deadline(None) == pytest.approx(2400)
    assert Budget(9000, finish, start=0.0).search_deadline(prices) == pytest.approx(9000 - finish.seconds(prices))
    # a full finish (3363 s here) takes at most half; validation then shrinks to what is left
    assert Budget(3600, finish, start=0.0).search_deadline(prices) == pytest.approx(1800)
    # never below validation's floor (the best one and the baseline, twice each: 363 s), nor past the start
    assert Budget(600, finish, start=0.0).search_deadline(prices) == pytest.approx(600 - finish.floor_s(prices))
    assert finish.floor_s(prices) == pytest.approx(2 * (30 + 4 * prices.request_s) + 2 * 2 * 8 + 15)
    assert Budget(300, finish, start=0.0).search_deadline(prices) == 0.0
    assert Budget(3600, None, start=0.0).search_deadline(prices) == 3600  # a worker's: all of it for trials
    # where the defaults lead the study, validation launches them alone: less is held back
    assert finish.validation_s(prices, configs=1) == pytest.approx(30 + 4 * prices.request_s + 3 * 8)
    assert Budget(9000, finish, start=0.0).search_deadline(prices, configs=1) == pytest.approx(
        9000 - finish.seconds(prices, configs=1))
    assert Finish(3, 3, 4, estimator_passes=False).estimator_s(prices) == 0.0
    # validation's first round shrinks to what is left: configurations go first, then repeats, never below
    # the best one and the baseline twice each
    assert fitting_round(prices, finish.validation_s(prices), 3, 3, 4) == (3, 3)
    assert fitting_round(prices, finish.validation_s(prices, 2, 3), 3, 3, 4) == (1, 3)
    assert fitting_round(prices, finish.validation_s(prices, 2, 2), 3, 3, 4) == (1, 2)
    assert fitting_round(prices, 1.0, 3, 3, 4) == (1, 2)


def test_a_first_launch_that_compiled_does_not_price_validations_relaunches():
    """The H100 at concurrency 8 (2026-12-06): the first launch took 180 s, 161 s of it compiling before the
    engine answered; validation priced each relaunch at 180 s, held 6.6 of 10 minutes back for its floor and
    stopped the search after that one trial (the relaunch then took 52 s: inductor's cache). With the compile
    the engine reported, a relaunch is priced without it, and the deadline holds back the unpriced third."""
    finish = Finish(top=2, repeats=2, quality_prompts=4, estimator_passes=True)
    reported = Prices.of([priced_trial(2.0, 178.0, 16000, compile_s=161.0)], concurrency=8)
    assert reported.launch_s == pytest.approx(180.0 - 161.0) and reported.cold_launch_s == 180.0
    assert Budget(600, finish, start=0.0).search_deadline(reported) == pytest.approx(400)
    unreported = Prices.of([priced_trial(2.0, 178.0, 16000)], concurrency=8)  # an engine that says nothing
    assert unreported.launch_s == 180.0
    assert Budget(600, finish, start=0.0).search_deadline(unreported) == pytest.approx(600 - finish.floor_s(unreported))
    assert 600 - finish.floor_s(unreported) < 240  # what the H100 run did: a deadline before its second trial
    # once a second launch is seen, it prices the relaunch, whatever the first compiled
    both = Prices.of([priced_trial(2.0, 178.0, 16000, compile_s=161.0),
                      priced_trial(2.0, 56.0, 16000, compile_s=38.0)], 8)
    assert both.launch_s == 58.0


def test_a_benchmark_is_sized_to_last_its_least_length_at_the_pace_its_wave_showed():
    """At concurrency 4, 8 requests whose wave of 4 took 0.6 s (the H200's 0.6 s trials) become the 67 that fill
    10 s; a wave of one took one request's time, the benchmark keeps 4 in flight; a load already long enough is
    measured as asked; never more than MAX_LOAD_FACTOR times it."""
    assert sized_load(8, 0.6, 4, 4, min_s=10.0) == 67
    assert sized_load(8, 0.6, 1, 4, min_s=10.0) == 67
    assert sized_load(8, 1.2, 8, 4, min_s=10.0) == 67  # a wave of 8 at concurrency 4: two requests' time, same pace
    assert sized_load(8, 30.0, 4, 4, min_s=10.0) == 8
    assert sized_load(8, 0.001, 4, 4, min_s=10.0) == 8 * MAX_LOAD_FACTOR
    assert sized_load(8, None, 4, 4) == sized_load(8, 0.6, 4, 4, min_s=0.0) == 8


def test_the_default_requests_follow_the_concurrency_the_user_chose():
    """SGLang's default load is 128 requests at concurrency 32; at --concurrency 1 the H200 run kept all 128 as the
    benchmark's floor (41 s a trial, one trial in a 3-minute budget). Per stream now, never under 8; what the
    user asks for stays."""
    def opts(engine, **given):
        return plan.options_from_cli(engine=engine, budget=None, trials=None, resume=False, study=None, **given)
    assert opts("sglang", concurrency=None).num_requests == 128 and opts("sglang", concurrency=None).concurrency == 32
    assert opts("sglang", concurrency=1).num_requests == plan.MIN_DEFAULT_REQUESTS == 8
    assert opts("sglang", concurrency=64).num_requests == 256
    assert opts("sglang", concurrency=1, num_requests=3).num_requests == 3
    assert opts("embedded", concurrency=1).num_requests == opts("embedded", concurrency=4).num_requests == 8
    assert opts("embedded", concurrency=8).num_requests == 16


@pytest.mark.slow
def test_a_trial_measures_the_requests_that_fill_its_least_length(studies):
    """The full benchmark sends what the quick wave's pace says fills min_measure_s (here 6 s from 2 asked
    requests), records that count, and its per-request rows are those requests."""
    opts = plan.RunOptions(trials=1, study="sized", sets=ONE_SERVER + ["draft_length=3", "verify_slots=2"],
                           **{**SMALL, "min_measure_s": 6.0})
    t = trials_of(loop.run_study(plan.build(opts)))[0]
    timings = t.user_attrs["timings"]
    assert t.user_attrs["status"] == record.OK
    assert timings["bench_requests"] == sized_load(2, timings["quick_s"], 1, 2, min_s=6.0) > 2
    rows = pd.read_parquet(t.user_attrs["requests_file"])
    assert len(rows) == timings["bench_requests"] * timings["bench_rounds"] == t.user_attrs["metrics"]["completed"]


@pytest.mark.slow
def test_a_benchmark_whose_interval_is_wide_is_repeated_and_pooled(studies, monkeypatch):
    """Issue 30 point 3: a trial's benchmark goes on while its throughput's 90% interval is wider than TIGHT_CI
    (here every interval is: -1), at most MORE_ROUNDS more times; the figure is the pooled requests' tokens over
    the rounds' summed load time. Where there is no room for more (the search deadline), none is run."""
    monkeypatch.setattr(runner, "TIGHT_CI", -1.0)
    opts = plan.RunOptions(trials=1, study="tight", sets=ONE_SERVER + ["draft_length=3", "verify_slots=2"],
                           **{**SMALL, "min_measure_s": 1.0})
    t = trials_of(loop.run_study(plan.build(opts)))[0]
    metrics, timings = t.user_attrs["metrics"], t.user_attrs["timings"]
    assert t.user_attrs["status"] == record.OK and timings["bench_rounds"] == runner.MORE_ROUNDS + 1
    assert metrics["completed"] == timings["bench_requests"] * timings["bench_rounds"]
    assert metrics["output_tok_s"] == pytest.approx(metrics["total_output_tokens"] / metrics["load_s"])
    assert metrics["duration_s"] == timings["bench_s"] > metrics["load_s"]
    wide = {"completed": 8, "output_tok_s_ci": 0.5, "duration_s": 10.0, "load_s": 9.0}
    assert runner.tightened(None, wide, None, room=lambda last_s: False)[0]["rounds"] == 1  # no room: not called


@pytest.mark.slow
def test_a_trial_still_running_at_the_search_deadline_is_cut_without_a_verdict(studies):
    """A trial that outlasts the search's deadline (a cold compile, an engine that stops answering) is cut
    there: its server is killed, the trial is FAIL with status budget (TPE learns nothing about its
    configuration from it), it does not count as measured, and the loop goes on to the finish on time."""
    p = plan.build(plan.RunOptions(trials=1, study="cut", sets=ONE_SERVER + ["draft_length=3", "verify_slots=3"],
                                   **SMALL))
    p.adapter = SlowOnThreeSlots()  # its server answers nothing in time: only the deadline can end the trial
    study, _ = storage.open_study(p.name, p.storage, objectives.metrics("throughput"),
                                  optuna.samplers.RandomSampler(seed=0), None, resume=False)
    servers = trial_life.Servers(p)
    started = time.time()
    try:
        cut = trial_life.run_trial(study, study.ask(), p, servers, LiveView("throughput", enabled=False),
                                   deadline=started + 8.0)
    finally:
        servers.stop()
    assert cut.state == TrialState.FAIL and cut.user_attrs["status"] == record.BUDGET, cut.user_attrs
    assert cut.user_attrs["failure_kind"] == "budget" and not cut.user_attrs["measured"] and not cut.constraints
    assert cut.user_attrs["launch"] == "launched" and cut.user_attrs["failure"].startswith("cut at the run's budget")
    assert 8.0 <= time.time() - started < 8.0 + 30.0  # ended by the deadline, not the client's 2-minute timeout


def test_a_stop_for_budget_says_what_a_trial_costs_here_and_which_budget_holds_more():
    """SGLang on the H100 (2026-12-05): every trial a launch of ~98 s, and a 6-minute budget held one trial;
    the run said only "budget reached". The stop now gives the machine's prices, and its suggested budget,
    started afresh after the same time spent, has a search deadline leaving room for that many more launched
    trials, with any number of configurations for validation."""
    def launched(warmup_s: float) -> optuna.trial.FrozenTrial:
        return optuna.trial.create_trial(value=1.0, user_attrs={
            "status": record.OK, "launch": "launched", "metrics": {"total_output_tokens": 1600},
            "timings": {"launch_s": 95.0, "warmup_s": warmup_s, "bench_s": 17.0}})

    finish = Finish(top=3, repeats=2, quality_prompts=4, estimator_passes=False)
    for prices in (Prices.of([launched(3.0)], concurrency=4), Prices.of([launched(3.0), launched(1.0)], 4)):
        budget = Budget(360.0, finish, start=time.time() - 134.0)
        line = budget.stop_line(prices, measured=1, configs=2)
        wanted = budget.budget_for(prices, budget_mod.MORE_TRIALS)
        assert line.startswith("budget reached after 1 trial:") and f"--budget {math.ceil(wanted / 60)}m" in line
        assert f"a launch {prices.launch_s:.0f} s" in line
        for configs in (1, 2, 4):
            bigger = Budget(wanted, finish, start=budget.start)
            room = bigger.search_deadline(prices, configs) - budget.start - 134.0
            assert room >= budget_mod.MORE_TRIALS * (1.2 * prices.bench_s + prices.launch_s) - 1.0
        assert budget.search_deadline(prices, configs=2) - budget.start < 134.0  # the stop was right
    assert Budget(360.0, finish).stop_line(None, measured=0) == "budget reached: no new trials"


def test_a_budget_an_earlier_run_here_shows_too_small_is_refused_before_any_trial(studies):
    """SGLang on the H100 (2026-12-05): a 4-minute budget could not hold a trial (a launch ~98 s) and its
    validation, which the run learnt only from its own first trial, and it ended 39% past the budget. The same
    command run again now knows this machine's prices from the earlier study (same fingerprint, same load): it
    says them in its plan, and refuses a budget that cannot hold one trial and the finish's floor."""
    first = loop.run_study(plan.build(plan.RunOptions(trials=1, study="first", sets=ONE_SERVER, **SMALL)))
    paid = Prices.of(trials_of(first), SMALL["concurrency"])
    assert paid is not None and paid.source is None

    again = plan.build(plan.RunOptions(trials=1, study="again", sets=ONE_SERVER, **SMALL))
    finish = Finish(top=1, repeats=2, quality_prompts=4, estimator_passes=False)
    budget = Budget(paid.launched_trial_s / 2, finish)
    with pytest.raises(ValueError, match=r"^--budget \d+ s cannot hold one trial and its validation on this "
                                         r"machine: .*as study first paid: a launch \d+ s.*--budget \d+m holds"):
        loop.run_study(again, budget=budget)
    assert budget.prior == replace(paid, source="first")  # the earlier study's own prices
    assert len(trials_of(SimpleNamespace(storage=again.storage, name=again.name))) == 0  # nothing ran

    # a budget that holds it: planned at those prices, the source named
    line = Budget(3600.0, finish, prior=budget.prior).plan_line(None)
    assert f"a launch {paid.launch_s:.0f} s" in line and "as study first paid" in line
    # another load (longer requests) is not priced by that study
    load = {key: getattr(again.opts, key) for key in price_memory.SAME_LOAD}
    fingerprint = price_memory.read_fingerprint(again.directory)
    assert price_memory.earlier_prices(again.directory, fingerprint, {**load, "max_tokens": 16}) is None
    assert price_memory.earlier_prices(again.directory, fingerprint, load) == budget.prior


@pytest.mark.slow
def test_the_budget_counts_no_launch_for_a_queued_trial_that_reuses_the_running_server(studies, monkeypatch):
    """With less time left than a trial with its launch but more than one without, the next queued trial runs
    when it changes only runtime knobs of the live server (draft_length), and none runs when it needs a
    launch (verify_slots). On the H200 a compiled launch was 45-58 s of a 60 s trial: charging every trial a
    launch stopped a 150 s study before its second n-gram seed, which needed none."""
    p = plan.build(plan.RunOptions(trials=5, study="reuse-budget", sets=ONE_SERVER + ["draft_length=3,5",
                                                                                         "verify_slots=1,2"], **SMALL))
    study, _ = storage.open_study(p.name, p.storage, objectives.metrics("throughput"),
                                  optuna.samplers.RandomSampler(seed=0), None, resume=False)
    for warmup_s in (150.0, 20.0):  # two trials so far: a trial costs 9.6 s on a running server, 39.6 s with a launch
        study.add_trial(priced_trial(warmup_s))
    first = {**p.space.defaults(), "draft_length": 3, "verify_slots": 1}
    fleet = loop.Fleet(p)
    servers, notes = fleet.servers[0], []
    fleet.study, fleet.view, fleet.stop_request = study, type("View", (), {"note": notes.append})(), loop.Stop(None)
    servers.ensure(first, studies / "first.log", 300)
    try:
        fleet.queue = loop.seed_queue(p, study, [{**first, "draft_length": 5}, {**first, "verify_slots": 2}])
        # 30 s left on a clock that stands still: the budget's arithmetic, not how long this machine takes to
        # get from here to the check.
        monkeypatch.setattr(loop, "time", SimpleNamespace(time=lambda: 1e9, monotonic=time.monotonic, sleep=time.sleep))
        fleet.budget = Budget(30.0, start=1e9)
        reusing = fleet._next_trial(servers)
        assert reusing is not None and p.space.suggest(reusing)["draft_length"] == 5 and notes[1:] == []
        study.tell(reusing, 1.0)
        assert fleet._next_trial(servers) is None and notes[-1].startswith("budget reached after")
    finally:
        servers.stop()


def test_a_budget_the_user_gives_is_the_limit_and_the_search_says_why_it_ended(studies):
    """llama.cpp at concurrency 8 on the H100 (2026-12-06): launches of 2 s, and the default count of 25 measured
    trials ended a `--budget 10m` search at 3.8 minutes, the run at 5.0, with no word why. A budget given without
    --trials is now the only limit; a count, given or the default without a budget, still ends the search, and
    the run says which limit ended it."""
    def opts(**given):
        return plan.options_from_cli(engine="embedded", resume=False, study=None, **given).trials
    assert opts(budget="10m", trials=None) is None
    assert opts(budget=None, trials=None) == plan.DEFAULT_TRIALS and opts(budget="10m", trials=3) == 3
    for trials, ended in ((2, "search ended: the study holds 2 measured trials (--trials 2)"), (None, None)):
        p = plan.build(plan.RunOptions(trials=trials, study=f"count-{trials}", sets=ONE_SERVER, **SMALL))
        study, _ = storage.open_study(p.name, p.storage, objectives.metrics("throughput"),
                                      optuna.samplers.RandomSampler(seed=0), None, resume=False)
        for _ in range(2):
            study.add_trial(optuna.trial.create_trial(value=1.0, user_attrs={"status": record.OK, "measured": True}))
        fleet, notes = loop.Fleet(p), []
        fleet.study, fleet.view, fleet.stop_request = study, type("View", (), {"note": notes.append})(), loop.Stop(None)
        asked = fleet._next_trial(fleet.servers[0])
        assert (asked is None) == (trials is not None) and notes == ([ended] if ended else [])
        if trials is not None:  # every runner asks again: said once
            assert fleet._next_trial(fleet.servers[0]) is None and len(notes) == 1
