"""llama.cpp's llama-server as an engine, against the real binary (`bash setup.sh dev` builds it): a live
study with validation, export and report; the exported launch.sh serving; acceptance read from the engine's
`timings` and `/metrics`; `autotune ci` translating a renamed flag; a server killed mid-trial; bad input
refused before any launch; `autotune probe` naming the build and its backends; the adapter's rules,
effective-config dedupe and argv checked by the binary's own parser.

Loads are tiny (SmolLM2-135M, one thread, 2-4 requests of 24 tokens): the claims are about the plumbing
and about what the server reports, not about speed.
"""
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import optuna
import pandas as pd
import pytest
import yaml
from conftest import exported_server
from optuna.trial import TrialState

from autotune import ci, pipeline
from autotune.bench import server_metrics
from autotune.bench.client import timings_usage
from autotune.engines import get_adapter
from autotune.engines.base import load_schema
from autotune.engines.launcher import launch
from autotune.engines.llamacpp import LlamaCppAdapter, binary_version, find_binary
from autotune.hardware import gather, get_profile
from autotune.hardware.probe import llama_server_facts
from autotune.predict import load_model, predict_memory
from autotune.space.space import load_space
from autotune.study import loop, plan, record
from autotune.study.storage import load_study
from autotune.validate.settings import ValidationSettings

BINARY = find_binary()
pytestmark = pytest.mark.skipif(not BINARY or binary_version(BINARY) is None,
                                reason="llama-server not built: bash setup.sh llamacpp")
ADAPTER = LlamaCppAdapter()
# One thread and two slots: two servers never fight over this machine's cores more than they must.
LIGHT = ["threads=1", "parallel=2"]
SLOTS_LOG = re.compile(r"n_slots = (\d+), n_ctx_slot = (\d+)")
# The code workload's prompts repeat their own text: a short lookup n-gram finds matches within 24 tokens.
NGRAM = ["spec_type=none,ngram-simple", "spec_ngram_simple_size_n=3"]
SMALL = {"engine": "llamacpp", "workload": "code", "concurrency": 2, "num_requests": 4, "quick_requests": 1, "min_measure_s": 0,
         "max_tokens": 24, "live": False}
STARTUP_S = 120


def trials_of(outcome):
    """The trials the run reached (queued seeds it never reached are closed as not_run)."""
    trials = optuna.load_study(study_name=outcome.name, storage=outcome.storage).get_trials()
    return [t for t in trials if t.user_attrs.get("status") != record.NOT_RUN]


def autotune(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "autotune.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, check=False, env={**os.environ, **(env or {})})


# -- one small live study, validated, exported and reported (shared by the module) ---------------------
@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = tmp_path_factory.mktemp("studies")
    opts = plan.RunOptions(trials=2, study="llama", studies_root=str(root), sets=NGRAM + LIGHT, **SMALL)
    outcome = loop.run_study(plan.build(opts))
    one_round = ValidationSettings(top=2, repeats=1, max_repeats=1, quality_prompts=1, quality_tokens=8)  # no race
    done = pipeline.finish(outcome.directory, outcome.storage, run_options=opts, progress=False, settings=one_round)
    return outcome, done


@pytest.mark.slow
def test_live_study_finishes_with_validation_export_and_report(study):
    outcome, done = study
    trials = trials_of(outcome)
    assert [t.user_attrs["config"]["spec_type"] for t in trials] == ["none", "ngram-simple"]
    for t in trials:
        assert t.state == TrialState.COMPLETE and t.user_attrs["status"] == record.OK, t.user_attrs.get("failure")
        assert t.user_attrs["argv"][0] == BINARY and t.user_attrs["launch"] == "launched"
        assert t.values[0] == t.user_attrs["metrics"]["output_tok_s"] > 0
        assert "llama_server" in Path(t.user_attrs["log"]).read_text()  # the real server wrote this log
        # the KV cells the server allocated ("n_slots = 2, n_ctx_slot = 8192": no --ctx-size, so each slot the
        # model's training context) are the memory model's, exactly
        slots, per_slot = map(int, SLOTS_LOG.search(Path(t.user_attrs["log"]).read_text()).groups())
        predicted = predict_memory(load_model(None), t.user_attrs["config"], get_profile("cpu"), engine=ADAPTER)
        assert predicted.kv_tokens == slots * per_slot
    assert done["problems"] == [], done["problems"]
    winner = done["validation"].winner
    assert winner is not None and winner.trial in (0, 1)
    assert done["validation"].baseline.config["spec_type"] == "none"
    best = outcome.directory / "best"
    assert {p.name for p in done["exported"]} >= {"launch.sh", "launch.json", "config.yaml"}
    assert json.loads((best / "launch.json").read_text())["config"] == winner.config
    assert ADAPTER.validate_flags(json.loads((best / "launch.json").read_text())["argv"]) == []
    assert done["report"] and "ngram-simple" in Path(done["report"]).read_text()


@pytest.mark.slow
def test_exported_launch_script_starts_llama_server_and_answers(study, tmp_path):
    outcome, done = study
    config = done["validation"].winner.config
    with exported_server(outcome.directory / "best" / "launch.sh", tmp_path / "launch-sh.log", STARTUP_S) as (proc, url):
        assert os.path.realpath(f"/proc/{proc.pid}/exe") == os.path.realpath(BINARY)  # exec'd: the real server
        r = httpx.post(url + "/v1/completions", timeout=120,
                       json={"prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1 and r.json()["choices"][0]["text"]
        assert httpx.get(url + "/props", timeout=10).json()["total_slots"] == config["parallel"] == 2


@pytest.mark.slow
def test_acceptance_is_read_from_timings_and_agrees_with_metrics(study):
    outcome, _ = study
    by_type = {t.user_attrs["config"]["spec_type"]: t for t in trials_of(outcome)}
    ngram = by_type["ngram-simple"].user_attrs["metrics"]
    rows = pd.read_parquet(by_type["ngram-simple"].user_attrs["requests_file"])
    drafted, accepted = rows["spec_draft_tokens"].sum(), rows["spec_accepted_tokens"].sum()
    # Each response's timings.draft_n / draft_n_accepted: drafts were made and some were accepted.
    assert ngram["accept_source"] == "usage" and ngram["accept_length"] > 1 and accepted > 0
    # The server's own counters over the same run (scraped before and after it) count the same tokens.
    assert ngram["server_metrics_source"] == "llamacpp"
    assert ngram["server_accept_rate"] == pytest.approx(accepted / drafted) == pytest.approx(ngram["accept_rate"])
    # /metrics counts only verify steps that carried a draft, the timings every step: never fewer tokens a step.
    assert ngram["server_accept_length"] >= ngram["accept_length"]
    plain = by_type["none"].user_attrs["metrics"]
    # Plain decoding: one token a step, nothing drafted (the k = 0 rows the estimator's cost fit anchors on).
    assert plain["accept_length"] == 1.0 and plain["accept_rate"] is None and plain["server_accept_length"] is None
    rows = pd.read_parquet(by_type["none"].user_attrs["requests_file"])
    assert (rows["spec_draft_tokens"] == 0).all() and (rows["spec_verify_steps"] == rows["output_tokens"] - 1).all()


# -- one n-gram server asked to copy code: every decode step drafts --------------------------------------
COPY_PROMPT = "Copy this code exactly.\n\n" + "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n" \
              "def mul(a, b):\n    return a * b\n" * 2


@pytest.fixture(scope="module")
def copying(tmp_path_factory):
    """An ngram-simple server launched with spec_draft_n_max=1, one greedy copy request, /metrics around it."""
    config = {"spec_type": "ngram-simple", "spec_ngram_simple_size_n": 3, "spec_draft_n_max": 1, "threads": 1,
              "parallel": 1}
    server = launch(ADAPTER, config, log_path=tmp_path_factory.mktemp("copy") / "server.log", timeout_s=STARTUP_S)
    try:
        assert "--spec-draft-n-max" in server.argv
        before = server_metrics.scrape(server.base_url)
        r = httpx.post(server.base_url + "/v1/completions", timeout=120,
                       json={"prompt": COPY_PROMPT, "max_tokens": 40, "temperature": 0})
        after = server_metrics.scrape(server.base_url)
    finally:
        server.stop()
    assert r.status_code == 200, r.text
    names = ADAPTER.facts.spec_counters
    steps, drafted, accepted = (after[n] - before.get(n, 0.0) for n in names)
    return r.json()["timings"], {"steps": steps, "drafted": drafted, "accepted": accepted}


@pytest.mark.slow
def test_ngram_drafts_ignore_spec_draft_n_max_so_dedupe_drops_it(copying):
    timings, counted = copying
    # The request's timings and the server's counters agree token for token.
    assert (timings["draft_n"], timings["draft_n_accepted"]) == (counted["drafted"], counted["accepted"])
    # Drafts run far past spec_draft_n_max=1 (ngram-simple drafts up to its size_m): the knob is inert here ...
    assert counted["drafted"] / counted["steps"] > 2
    # ... and every decode step drafted: the prefill's token, then steps x (accepted + the target's own).
    assert timings["predicted_n"] == 1 + counted["steps"] + counted["accepted"]
    # So two configurations that differ only there are one engine run; a draft model does read it.
    key = record.effective_key
    assert key(ADAPTER, {"spec_type": "ngram-simple", "spec_draft_n_max": 1}) == \
        key(ADAPTER, {"spec_type": "ngram-simple", "spec_draft_n_max": 8})
    assert key(ADAPTER, {"spec_type": "draft-simple", "spec_draft_n_max": 1}) != \
        key(ADAPTER, {"spec_type": "draft-simple", "spec_draft_n_max": 8})


@pytest.mark.slow
def test_timings_verify_steps_exclude_the_prefill_token(copying):
    timings, counted = copying
    assert timings_usage(timings)["spec_verify_steps"] == counted["steps"]


# -- autotune ci: a flag this build renamed ---------------------------------------------------------------
@pytest.mark.slow
def test_ci_translates_removed_draft_max_and_the_server_starts(study, tmp_path):
    outcome, _ = study
    copy = tmp_path / outcome.name
    shutil.copytree(outcome.directory, copy)
    doc = json.loads((copy / "best" / "launch.json").read_text())
    doc["argv"] += ["--draft-max", "8"]  # how an older build spelled the draft length
    (copy / "best" / "launch.json").write_text(json.dumps(doc))
    assert any("--draft-max does not exist" in e for e in ADAPTER.validate_flags(doc["argv"]))
    ctx = load_study(copy)
    out = ci.recheck(ctx, ci.reference(ctx), tolerance=0.99)
    assert out["verdict"] != "broken", out.get("reason")
    assert [n.split(":")[0] for n in out["translated"]] == ["--draft-max"]
    # The old flag set both lengths (a draft model's and ngram-mod's): the server takes both.
    assert out["argv"][-4:] == ["--spec-draft-n-max", "8", "--spec-ngram-mod-n-max", "8"]
    assert "--draft-max" not in out["argv"] and ADAPTER.validate_flags(out["argv"]) == []
    first = Path(out["log"]).read_text()
    assert 'error while handling argument "--draft-max": the argument has been removed' in first  # refused, then
    assert out["runs"] and out["runs"][0]["completed"] > 0  # started, and served the validated load


# -- a server killed mid-trial ---------------------------------------------------------------------------
def kill_when_serving(log: Path, killed: dict, deadline_s: float = 300.0):
    """Once the server of `log` is processing a request, SIGKILL its process group (found by its argv, the
    log's first line, in the process table)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        if "processing task" in text:
            argv = shlex.split(text.splitlines()[0][2:])
            for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
                except OSError:
                    continue
                if [a.decode() for a in cmdline] == argv:
                    os.killpg(pid, signal.SIGKILL)
                    killed["pid"] = pid
                    return
        time.sleep(0.02)


@pytest.mark.slow
def test_server_killed_mid_trial_is_a_failed_trial_and_the_study_goes_on(tmp_path):
    killed: dict = {}
    killer = threading.Thread(target=kill_when_serving, args=(tmp_path / "killed" / "logs" / "trial-0.log", killed),
                              daemon=True)
    killer.start()
    outcome = loop.run_study(plan.build(plan.RunOptions(trials=2, study="killed", studies_root=str(tmp_path),
                                                        sets=NGRAM + LIGHT, **SMALL)))
    killer.join(10)
    assert killed.get("pid"), "the benchmark of trial 0 never started"
    first, second = trials_of(outcome)
    assert first.user_attrs["status"] == record.FAILED and first.state == TrialState.PRUNED
    # killed at its first request: the trial's warm-up wave, or the benchmark where the warm-up was short
    assert first.user_attrs["failure_kind"] == "crash" and "server exited during the" in first.user_attrs["failure"]
    assert first.constraints["feasible"] > 0  # infeasible: the sampler moves away from it
    assert second.user_attrs["status"] == record.OK and second.user_attrs["launch"] == "launched"
    assert second.user_attrs["config"]["spec_type"] == "ngram-simple" and outcome.launches == 2


# -- bad input ------------------------------------------------------------------------------------------
@pytest.fixture
def kept(tmp_path):
    """An existing llamacpp study that bad input must leave byte for byte as it was."""
    db = tmp_path / "keep" / "study.db"
    db.parent.mkdir()
    study = optuna.create_study(study_name="keep", storage=f"sqlite:///{db}", direction="maximize")
    study.tell(study.ask(), 1.0)
    return db


def space_file(tmp_path, name, change):
    space = yaml.safe_load(Path(load_space("llamacpp").source).read_text())
    change(space["parameters"])
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(space, sort_keys=False))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["--set", "no_such_option=1"], "unknown parameter 'no_such_option' for llamacpp"),
    (["--set", "cache_type_v=q9_9"], "cache_type_v: 'q9_9' is not one of"),
    (["--engine-binary", "/nonexistent"], "--engine-binary /nonexistent: not a llama-server"),
    (["--space", "unknown-option"], "no_such_option"),
])
def test_bad_input_is_one_line_exit_2_before_any_launch(kept, tmp_path, args, message):
    if args == ["--space", "unknown-option"]:
        args = ["--space", space_file(tmp_path, "unknown-option", lambda p: p.update(
            no_such_option={"type": "int", "low": 1, "high": 2, "default": 1}))]
    before = hashlib.sha256(kept.read_bytes()).hexdigest()
    done = autotune("run", "--engine", "llamacpp", "--study", "keep", "--storage", f"sqlite:///{kept}", "--resume",
                    "--trials", "1", *args, env={"AUTOTUNE_STUDIES_DIR": str(tmp_path)})
    assert done.returncode == 2 and done.stderr.startswith("error: ") and message in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert hashlib.sha256(kept.read_bytes()).hexdigest() == before
    assert not (tmp_path / "keep" / "logs").exists()  # no server was launched


@pytest.mark.slow
def test_rule_and_value_violations_are_recorded_on_the_trial_not_launched(tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "MAX_IDLE_ASKS", 3)  # every ask is refused alike: three make the point
    # A quantized V cache without flash attention: the server would refuse to create its context.
    outcome = loop.run_study(plan.build(plan.RunOptions(
        trials=1, study="rules", studies_root=str(tmp_path), sets=["cache_type_v=q4_0", "flash_attn=off", *LIGHT],
        **SMALL)))
    trials = trials_of(outcome)
    assert outcome.launches == 0 and outcome.best is None and trials
    for t in trials:
        assert t.user_attrs["status"] == record.REJECTED and t.state == TrialState.PRUNED
        assert t.user_attrs["failure_kind"] == "rule"
        assert "cache_type_v q4_0: a quantized V cache needs flash attention" in t.user_attrs["failure"]
    assert not list((tmp_path / "rules" / "logs").iterdir())
    # A space file offering a value this build does not have: refused by the schema's choices, not launched.
    path = space_file(tmp_path, "q9", lambda p: p.update(
        cache_type_v={"type": "categorical", "choices": ["q9_9"], "default": "q9_9"}))
    outcome = loop.run_study(plan.build(plan.RunOptions(trials=1, study="q9", studies_root=str(tmp_path),
                                                        space=str(path), sets=LIGHT, **SMALL)))
    trials = trials_of(outcome)
    assert outcome.launches == 0 and trials and all(t.user_attrs["status"] == record.REJECTED for t in trials)
    assert "cache_type_v 'q9_9' is not one of this build's values" in trials[0].user_attrs["failure"]


@pytest.mark.slow
def test_missing_engine_binary_is_one_line_exit_2(tmp_path):
    done = autotune("run", "--engine", "llamacpp", "--engine-binary", tmp_path / "nope" / "llama-server",
                    env={"AUTOTUNE_STUDIES_DIR": str(tmp_path)})
    assert done.returncode == 2 and done.stderr.startswith("error: --engine-binary ") and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not list(tmp_path.iterdir())


# -- the adapter ----------------------------------------------------------------------------------------
def test_cross_flag_rules():
    check = ADAPTER.check
    assert check({}) == [] and check({"cache_type_v": "q4_0", "flash_attn": "on"}) == []
    assert check({"cache_type_v": "q8_0"}) == []  # flash_attn auto: the server turns it on for a quantized V cache
    assert any("quantized V cache needs flash attention" in v for v in check({"cache_type_v": "q4_0", "flash_attn": "off"}))
    assert check({"cache_type_k": "q4_0", "flash_attn": "off"}) == []  # only V needs it
    assert any("must be <= batch_size" in v for v in check({"ubatch_size": 1024, "batch_size": 512}))
    assert any("needs --draft-model" in v for v in check({"spec_type": "draft-simple"}, has_draft_model=False))
    assert check({"spec_type": "draft-simple"}, has_draft_model=True) == []
    low_high = {"spec_draft_n_min": 5, "spec_draft_n_max": 2}
    assert any("spec_draft_n_min 5 must be <= spec_draft_n_max 2" in v
               for v in check({"spec_type": "draft-simple", **low_high}, has_draft_model=True))
    assert check({"spec_type": "ngram-simple", **low_high}) == []  # n-gram types read neither
    assert any("would draft nothing" in v for v in check({"spec_type": "ngram-simple", "spec_ngram_simple_size_n": 12,
                                                          "spec_ngram_simple_size_m": 8}))
    assert any("tokens a slot" in v for v in check({"ctx_size": 1024, "parallel": 4}))
    assert check({"ctx_size": 4096, "parallel": 4}) == []
    assert any("q9_9" in v for v in check({"cache_type_v": "q9_9"}))


def test_effective_config_drops_inert_knobs_and_defaults():
    key = record.effective_key
    same = [({"spec_type": "ngram-simple", "spec_ngram_map_k_size_n": 4},  # another family's knob
             {"spec_type": "ngram-simple", "spec_ngram_map_k_size_n": 8}),
            ({"spec_type": "ngram-simple", "spec_draft_p_min": 0.5}, {"spec_type": "ngram-simple"}),
            ({"spec_type": "none", "spec_ngram_simple_size_n": 3}, {"spec_type": "none"}),
            ({"threads": None, "ubatch_size": 512, "flash_attn": "auto"}, {})]  # unset and the server's defaults
    for a, b in same:
        assert key(ADAPTER, a) == key(ADAPTER, b), (a, b)
    different = [({"spec_type": "ngram-simple", "spec_ngram_simple_size_n": 3}, {"spec_type": "ngram-simple"}),
                 ({"spec_type": "draft-simple", "spec_draft_p_min": 0.5}, {"spec_type": "draft-simple"}),
                 ({"cache_type_v": "q8_0"}, {}), ({"spec_type": "ngram-simple"}, {})]
    for a, b in different:
        assert key(ADAPTER, a) != key(ADAPTER, b), (a, b)


def parser_verdict(argv: list[str]) -> str | None:
    """None if llama-server's own parser takes argv (it then fails loading a model that is not there),
    else its complaint. Parsing comes before the model, so this costs milliseconds."""
    argv = list(argv)
    argv[argv.index("--model") + 1] = "/nonexistent/model.gguf"
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    text = done.stdout + done.stderr
    if "failed to load model" in text:
        return None
    return next((ln for ln in text.splitlines() if "argument" in ln or "error" in ln), text[-300:])


def test_every_argv_from_the_space_passes_the_binarys_own_parser():
    space = load_space("llamacpp")
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    configs = space.seed_configs()
    while len(configs) < 40:
        configs.append(space.suggest(study.ask()))
    assert len({c["spec_type"] for c in configs}) >= 4
    for config in configs:
        argv, _ = ADAPTER.command(config, model=ADAPTER.default_model(), draft_model="/drafts/small.gguf",
                                  host="127.0.0.1", port=9)
        assert ADAPTER.validate_flags(argv) == [], config
        assert parser_verdict(argv) is None, (config, parser_verdict(argv))
    # The check itself: a flag this build does not have is refused by the same parser.
    bad, _ = ADAPTER.command({}, model=ADAPTER.default_model(), draft_model=None, host="127.0.0.1", port=9,
                             extra_args=["--draft-max", "8"])
    assert "the argument has been removed" in parser_verdict(bad)


@pytest.mark.slow
def test_space_seeds_start_healthy(tmp_path):
    for i, seed in enumerate(load_space("llamacpp").seed_configs()):
        config = {**seed, "threads": 1, "parallel": 1}
        server = launch(ADAPTER, config, log_path=tmp_path / f"seed-{i}.log", timeout_s=STARTUP_S)  # raises if not
        try:
            assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
        finally:
            server.stop()


def test_renames_of_the_draft_lengths_set_both_new_lengths():
    schema = load_schema("llamacpp", ADAPTER.version)
    renamed = schema["renamed"]
    # --draft-max set the draft model's length and ngram-mod's (build 11434 split them); n-gram-simple reads neither.
    for old in ("--draft", "--draft-n", "--draft-max"):
        assert renamed[old]["new"] == ["--spec-draft-n-max", "--spec-ngram-mod-n-max"]
    for old in ("--draft-min", "--draft-n-min"):
        assert renamed[old]["new"] == ["--spec-draft-n-min", "--spec-ngram-mod-n-min"]
    argv, notes = ADAPTER.translate_renamed([BINARY, "--spec-type", "ngram-mod", "--draft-min", "4", "--draft-max", "16"])
    assert argv == [BINARY, "--spec-type", "ngram-mod", "--spec-draft-n-min", "4", "--spec-ngram-mod-n-min", "4",
                    "--spec-draft-n-max", "16", "--spec-ngram-mod-n-max", "16"]
    assert len(notes) == 2 and ADAPTER.validate_flags(argv) == []


# -- autotune probe: the llama.cpp build and its backends -------------------------------------------------
def test_probe_reports_the_llama_server_build_and_backends():
    assert gather.llama_server_binary() == find_binary()  # found where the engine finds it
    report = json.loads(autotune("probe", "--json", "--gpu", "cpu", timeout=120).stdout)
    assert report["versions"]["llamacpp"] == binary_version(BINARY) == get_adapter("llamacpp").installed_version()
    note = next(n for n in report["notes"] if n.startswith("llama-server "))
    version = re.search(r"version: (\S+) \(build (\d+)", subprocess.run(
        [BINARY, "--version"], capture_output=True, text=True, timeout=60, check=False).stderr)
    assert f"llama-server {version.group(1)} (build {version.group(2)}) at {BINARY}" in note
    listed = subprocess.run([BINARY, "--list-devices"], capture_output=True, text=True, timeout=60, check=False).stdout
    devices = re.findall(r"^\s+(\w+?)\d*: ", listed, re.MULTILINE)
    assert f"backends {', '.join(['CPU', *dict.fromkeys(devices)])};" in note  # the CPU build: CPU alone
    # A CUDA build lists its GPUs beside the CPU (common/arg.cpp common_print_available_devices' format).
    cuda = "Available devices:\n  CUDA0: NVIDIA H200 (143166 MiB, 142544 MiB free)\n  CUDA1: NVIDIA H200 (143166 MiB, " \
           "142544 MiB free)\n"
    build, text = llama_server_facts({"path": "/b/llama-server", "devices": cuda,
                                      "version": "version: 0.6.0-dev (build 11434, commit x)\nbuilt with GNU"})
    assert build == "11434" and "backends CPU, CUDA; devices: NVIDIA H200 139.8 GiB, NVIDIA H200 139.8 GiB" in text
