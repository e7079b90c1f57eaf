"""`autotune ci`: a small real study (embedded engine, SQLite), validated and exported, then checked
under an unchanged and a changed fingerprint, with a regression, a broken flag and a renamed SGLang flag.

Each test works on its own copy of the study (the directory keeps the study's name: it is how the
study is found in its study.db)."""
import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import optuna
import pytest
import yaml

from autotune import ci, export, provenance
from autotune.engines import get_adapter
from autotune.study import loop, plan
from autotune.study.storage import load_study
from autotune.validate.run import validate
from autotune.validate.settings import ValidationSettings

SETS = ["drafter=none,ngram", "draft_length=2", "draft_policy=fixed", "ngram_min=1", "ngram_max=4", "verify_slots=2",
        "prefill_ubatch=256", "dtype=float32", "quantization=none", "compile=none", "threads=1"]
# min_measure_s 0: the asked requests, not multiplied to fill MEASURE_S (these tests are about plumbing)
LOAD = {"concurrency": 2, "num_requests": 2, "max_tokens": 8, "min_measure_s": 0}
NAME = "cistudy"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """The study as `autotune run` leaves it, with the full fingerprint in provenance.json."""
    root = tmp_path_factory.mktemp("studies")
    opts = plan.RunOptions(trials=2, study=NAME, studies_root=str(root), workload="chat", quick_requests=1,
                             live=False, sets=SETS, **LOAD)
    loop.run_study(plan.build(opts))
    directory = root / NAME
    # one round whatever the speeds (a close race added up to 5 more, 14 launches in all): the race has its own tests
    one_round = ValidationSettings(top=1, repeats=1, max_repeats=1, quality_prompts=1, quality_tokens=8)
    validate(directory, settings=one_round, load=LOAD, progress=False)
    export.export(directory)
    prov = json.loads((directory / "provenance.json").read_text())
    prov["fingerprint"] = provenance.fingerprint(get_adapter("embedded"), prov["model"])
    (directory / "provenance.json").write_text(json.dumps(prov))
    return directory


@pytest.fixture
def study(recorded, tmp_path):
    shutil.copytree(recorded, tmp_path / NAME)
    return tmp_path / NAME


def edit(path, change):
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def autotune(*args):
    return subprocess.run([sys.executable, "-m", "autotune.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, check=False)


@pytest.mark.slow
def test_unchanged_environment_exits_at_once_without_launching(study):
    done = autotune("ci", study, "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["status"] == "unchanged" and result["changes"] == []
    assert result["fingerprint"]["model_sha256"] == json.loads((study / "provenance.json").read_text())["model_sha256"]
    assert not (study / "ci").exists()  # nothing was launched
    assert "environment unchanged" in ci.describe(result)[0]


@pytest.mark.slow
def test_changed_thread_count_relaunches_and_refreshes_provenance(study):
    now = provenance.fingerprint(get_adapter("embedded"), json.loads((study / "provenance.json").read_text())["model"])
    edit(study / "provenance.json", lambda p: p["fingerprint"].update(torch_threads=now["torch_threads"] + 7))
    # The re-check compares this machine's speed now with the recorded median: a recorded number set here, which
    # any real measurement beats, keeps the verdict from hanging on the machine's load between the two (the
    # regression test below sets it out of reach instead).
    edit(study / "best" / "validation.json", lambda v: v["winner"]["stats"]["output_tok_s"].update(median=1e-6))
    result = ci.check(study, tolerance=0.05)
    assert result["status"] == "within_tolerance" and result["exit_code"] == 0, result
    assert result["changes"] == [{"key": "torch_threads", "recorded": now["torch_threads"] + 7, "now": now["torch_threads"]}]
    assert result["recheck"]["median"] > 0 and result["recheck"]["verdict"] == "ok"
    prov = json.loads((study / "provenance.json").read_text())
    assert prov["fingerprint"]["torch_threads"] == now["torch_threads"]  # refreshed: the next run is unchanged
    assert prov["ci"]["previous"]["fingerprint"]["torch_threads"] == now["torch_threads"] + 7
    assert ci.check(study)["status"] == "unchanged"
    assert not (study / "ci-summary.md").exists()


@pytest.mark.slow
def test_regression_retunes_warm_started_and_exits_1_with_a_summary(study):
    before = json.loads((study / "best" / "launch.json").read_text())
    # A dtype no torch knows: no machine's fingerprint can match what is recorded.
    edit(study / "provenance.json", lambda p: p["fingerprint"].update(fast_dtypes=["no-such-dtype"]))
    edit(study / "best" / "validation.json", lambda v: v["winner"]["stats"]["output_tok_s"].update(median=1e6))
    # A configuration that crashed under the old environment: the re-tune must not launch it again.
    source = optuna.load_study(study_name=NAME, storage=f"sqlite:///{study / 'study.db'}")
    crashed = {**source.trials[0].user_attrs, "status": "failed", "failure": "launch crash: segfault",
               "effective_key": "crashed-config"}
    source.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.PRUNED, params=source.trials[0].params,
                                               distributions=source.trials[0].distributions, user_attrs=crashed,
                                               constraints={"feasible": 1.0}))

    result = ci.check(study, tolerance=0.05, retune_trials=1, retune_budget_s=600)
    assert result["exit_code"] == 1 and result["recheck"]["verdict"] == "regressed"
    assert "vs 1e+06 recorded" in result["recheck"]["reason"]
    assert result["changes"][0]["key"] == "fast_dtypes"
    tuned = result["retune"]
    assert tuned["enqueued"] >= 1 and tuned["remembered_failures"] == 1 and tuned["measured"] >= 1
    retune = optuna.load_study(study_name=tuned["study"], storage=f"sqlite:///{study / 'study.db'}")
    assert [t.user_attrs["remembered_from"] for t in retune.trials if "remembered_from" in t.user_attrs] \
        == [f"{NAME} trial {len(source.trials) - 1}"]
    space = yaml.safe_load((study / "ci" / f"{tuned['study']}.space.yaml").read_text())
    assert space["drafter"] == ["none", "ngram"] and space["threads"] == 1  # the study's --set, read off its trials
    first = next(t for t in retune.trials if t.user_attrs.get("warm_start"))
    assert first.user_attrs["config"] == before["config"]  # the exported configuration is measured first, afresh
    assert result["status"] == "retuned", tuned
    after = json.loads((study / "best" / "launch.json").read_text())
    assert after["study"] == tuned["study"]
    assert json.loads((study / "best" / "validation.json").read_text())["winner"]["median"] == result["new"]["median"] < 1e6
    summary = (study / "ci-summary.md").read_text()
    assert f"study `{NAME}` re-tuned" in summary and "| fast_dtypes |" in summary and "**regressed**" in summary
    assert f"`{tuned['study']}` warm-started from `{NAME}`" in summary
    # finished as `autotune run` finishes, validated under the settings the study was validated with
    settings = json.loads((Path(tuned["directory"]) / "best" / "validation.json").read_text())["settings"]
    assert (settings["top"], settings["repeats"], settings["quality_tokens"]) == (1, 1, 8)
    assert Path(tuned["report"]).is_file() and f"Report: `{tuned['report']}`" in summary
    # The next run compares with the re-tuned numbers under this environment: unchanged.
    assert ci.check(study)["status"] == "unchanged"


@pytest.mark.slow
def test_a_broken_flag_fails_the_relaunch_with_the_engine_reason(study):
    edit(study / "best" / "launch.json", lambda d: d["argv"].__setitem__(d["argv"].index("--drafter") + 1, "bogus"))
    ctx = load_study(study)
    out = ci.recheck(ctx, ci.reference(ctx), tolerance=0.05)
    assert out["verdict"] == "broken" and out["translated"] == []
    assert "drafter must be one of" in out["reason"] and "got 'bogus'" in out["reason"]


def test_renamed_sglang_flag_in_an_exported_launch_is_translated(tmp_path):
    best = tmp_path / "best"
    best.mkdir()
    old = ["/opt/old/bin/python3", "-m", "sglang.launch_server", "--model-path", "/models/llama", "--host", "127.0.0.1",
           "--port", "30000", "--cuda-graph-max-bs", "32", "--disable-cuda-graph"]  # exported for sglang 0.5.9
    (best / "launch.json").write_text(json.dumps({"engine": "sglang", "argv": old,
                                                  "env": {"SGLANG_FORCE_FP8_MARLIN": "1"}}))
    argv, env, source = ci.stored_command(best)
    assert argv == [sys.executable, *old[1:]]  # this machine's Python runs the module
    assert env == {"SGLANG_FORCE_FP8_MARLIN": "1"} and source.endswith("launch.json")
    adapter = get_adapter("sglang")
    assert any("--cuda-graph-max-bs does not exist" in e for e in adapter.validate_flags(argv))
    # sglang is not installed here, so the launch fails both times; what matters is the translation.
    server, used, notes, failure = ci.start(adapter, argv, env, tmp_path / "launch.log", timeout_s=60)
    assert server is None and "also after translating renamed flags" in failure
    assert used[-6:] == ["--cuda-graph-max-bs-decode", "32", "--cuda-graph-backend-decode", "disabled",
                         "--cuda-graph-backend-prefill", "disabled"]
    assert [n.split(":")[0] for n in notes] == ["--cuda-graph-max-bs", "--disable-cuda-graph"]
    assert adapter.validate_flags(used) == []


def test_fingerprint_read_off_an_older_provenance_and_compared():
    prov = {"engine": "embedded", "model_sha256": "abc", "versions": {"torch": "2.12.0", "autotune": "0.1.0"},
            "hardware": {"gpus": [], "driver_version": None, "cpu": {"model": "AMD EPYC"}}}
    recorded = ci.recorded_fingerprint(prov)
    now = {**recorded, "torch": "2.13.0", "torch_threads": 2}
    changes, unrecorded = ci.compare(recorded, now)
    assert changes == [{"key": "torch", "recorded": "2.12.0", "now": "2.13.0"}] and unrecorded == ["torch_threads"]
    assert ci.parse_tolerance("5%") == pytest.approx(0.05) and ci.parse_tolerance("0.1") == 0.1
    with pytest.raises(ValueError, match="--tolerance"):
        ci.parse_tolerance("5")


@pytest.mark.slow
def test_bad_input_is_one_line_and_exit_2(tmp_path):
    for args, message in ((["ci", tmp_path / "nosuch"], "no study"),
                          (["ci", tmp_path / "nosuch", "--tolerance", "lots"], "--tolerance"),
                          (["ci", tmp_path / "nosuch", "--retune-budget", "soon"], "--retune-budget")):
        done = autotune(*args)
        assert done.returncode == 2 and done.stderr.startswith("error: ") and message in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


def test_summary_when_the_retune_found_no_replacement(tmp_path):
    result = {"changes": [{"key": "driver", "recorded": "550.54", "now": "570.86"}],
              "recorded": {"metric": "output_tok_s", "direction": "maximize", "median": 120.0, "validated": True},
              "recheck": {"source": "/s/best/launch.json", "verdict": "broken", "median": None, "translated": [],
                          "reason": "launch oom: out of memory (exit -9)"},
              "retune": {"study": "s-ci-1", "from": "s", "enqueued": 3, "remembered_failures": 2, "measured": 0,
                         "problem": "no configuration measured within the re-tune budget met the study's requirements"}}
    path = ci.write_summary(types.SimpleNamespace(name="s", directory=tmp_path), result)
    text = path.read_text()
    assert text.startswith("# autotune ci: study `s` regressed, and the re-tune found no validated replacement")
    assert "| driver | `550.54` | `570.86` |" in text and "**broken**: launch oom" in text
    assert "| median | 120 | - | - |" in text and "Problem: no configuration measured" in text
    assert "Flags changed" not in text
