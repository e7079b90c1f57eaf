"""A load that changes (issue 34 point 1): the profile spec, its phases run back to back against the real
embedded engine, and a study whose every benchmark runs the profile."""
import json

import optuna
import pandas as pd
import pytest
from typer.testing import CliRunner

from autotune.bench.load_profile import LoadProfile, Phase, parse_load_profile
from autotune.bench.runner import run_profile
from autotune.bench.server_metrics import scrape
from autotune.cli import app
from autotune.study import loop, plan, record


@pytest.mark.parametrize("spec, phases", [
    ("1:20s,2:20s,4:1.5m", [Phase(1, None, 20.0), Phase(2, None, 20.0), Phase(4, None, 90.0)]),
    ("2/s:10req, 8:64req", [Phase(None, 2.0, None, 10), Phase(8, None, None, 64)]),
    ("ramp", [Phase(c, None, 20.0) for c in (1, 2, 4, 8, 16)]),
    ("ramp:1-12:60s", [Phase(c, None, 12.0) for c in (1, 2, 4, 8, 12)]),
    ("ramp:3-3:1m", [Phase(3, None, 60.0)]),
])
def test_good_specs_parse_to_their_phases_and_print_back(spec, phases):
    profile = parse_load_profile(spec)
    assert list(profile.phases) == phases
    assert parse_load_profile(str(profile)) == profile  # the printed form is a spec of the same profile


@pytest.mark.parametrize("spec, names", [
    ("", "preset"), ("1:20", "'1:20'"), ("4", "'4'"), ("x:20s", "'x:20s'"), ("1:20s,", "''"), ("0:5s", "'0:5s'"),
    ("2:0req", "'2:0req'"), ("-1:5s", "'-1:5s'"), ("2/m:5s", "'2/m:5s'"), ("ramp:8-2:10s", "goes up"),
    ("ramp:1-8:40req", "a time"), ("ramp:1-8", "'ramp:1-8'"),
])
def test_a_bad_spec_is_one_line_naming_the_bad_part(spec, names):
    with pytest.raises(ValueError) as e:
        parse_load_profile(spec)
    assert names in str(e.value) and "\n" not in str(e.value)


def test_levels_and_the_deadline_pace_follow_the_phases():
    profile = parse_load_profile("4:10s,1:6req,4:2s,3/s:6req")
    assert profile.concurrencies() == [1, 4] and [p.label for p in profile.phases] == ["c4", "c1", "c4", "r3"]
    # one request takes 0.5 s at 2 streams: 4 streams drain in 1 s; 6 requests one at a time take 6 waves of
    # 0.5 s; 6 arrivals at 3/s take 2 s plus a request's time
    assert profile.expected_s(0.5, 2) == pytest.approx((10 + 1) + 6 * 0.5 + (2 + 1) + (2 + 0.5))


def peak_in_flight(frame: pd.DataFrame) -> int:
    """Most requests outstanding at once, from each request's send time and end (client-side timestamps)."""
    events = [(s, 1) for s in frame["start_s"]] + [(s + e / 1000, -1) for s, e in zip(frame["start_s"], frame["e2e_ms"])]
    peak = now = 0
    for _, step in sorted(events):  # an end sorts before a send at the same instant
        now += step
        peak = max(peak, now)
    return peak


@pytest.mark.slow
def test_live_phases_hold_their_concurrency_are_tagged_and_pool_into_the_overall(embedded_server):
    profile = parse_load_profile("1:3req,3:1s")
    before = scrape(embedded_server)
    result = run_profile(embedded_server, "repetitive", profile, max_tokens=6, progress=False)
    after = scrape(embedded_server)
    frame, s = result.requests, result.summary
    assert frame["ok"].all() and (frame["output_tokens"] == 6).all()
    # every request carries its phase; the first phase is bound by its count, the second sent at least a wave
    assert [p.summary["sent"] for p in result.phases] == frame.groupby("load_phase").size().tolist()
    assert result.phases[0].summary["sent"] == 3 and result.phases[1].summary["sent"] >= 3
    assert frame.groupby("load_phase")["load_level"].unique().map(list).tolist() == [["c1"], ["c3"]]
    # each phase had exactly its concurrency in flight at its peak, and a phase starts after the last ends
    for number, phase in enumerate(profile.phases):
        assert peak_in_flight(frame[frame["load_phase"] == number]) == phase.concurrency
    first, second = frame[frame["load_phase"] == 0], frame[frame["load_phase"] == 1]
    assert second["start_s"].min() > (first["start_s"] + first["e2e_ms"] / 1000).max()
    assert peak_in_flight(frame) == 3
    # the server saw every request once and generated what the phases count; the overall is their pool
    assert after["autotune_requests_total"] - before["autotune_requests_total"] == len(frame) == s["sent"]
    generated = after["autotune_generation_tokens_total"] - before["autotune_generation_tokens_total"]
    assert generated == s["total_output_tokens"] == sum(p.summary["total_output_tokens"] for p in result.phases)
    assert s["duration_s"] == pytest.approx(sum(p.summary["duration_s"] for p in result.phases))
    assert s["output_tok_s"] == pytest.approx(s["total_output_tokens"] / s["duration_s"])
    assert s["phase_c3_output_tok_s"] == result.phases[1].summary["output_tok_s"]
    assert s["phase_c1_completed"] == 3
    # accept length per phase from the responses equals the server's counters over that phase alone
    for p in result.phases:
        assert p.summary["accept_length"] == pytest.approx(p.summary["server_accept_length"], rel=1e-9)
    assert s["accept_length"] == pytest.approx(s["server_accept_length"], rel=1e-9)


@pytest.mark.slow
def test_cli_bench_prints_a_row_per_phase_and_the_pooled_line(embedded_server, tmp_path):
    out = tmp_path / "profile.json"
    run = CliRunner().invoke(app, ["bench", "--url", embedded_server, "--workload", "chat", "--max-tokens", "4",
                                   "--load-profile", "1:1req,2:2req", "--out", str(out)], env={"COLUMNS": "200"})
    assert run.exit_code == 0, run.output
    assert "1:1req" in run.output and "2:2req" in run.output and "overall: 12 tokens" in run.output
    doc = json.loads(out.read_text())
    assert [p["sent"] for p in doc["summary"]["phases"]] == [1, 2] and doc["summary"]["load_profile"] == "1:1req,2:2req"
    assert [r["load_phase"] for r in doc["requests"]] == [0, 1, 1]
    for args, says in ((["--load-profile", "1:5x"], "phase '1:5x'"),
                       (["--load-profile", "1:2req", "--concurrency", "2"], "drop --concurrency")):
        bad = CliRunner().invoke(app, ["bench", "--url", embedded_server, *args])
        assert bad.exit_code == 2 and says in bad.output and "Traceback" not in bad.output


@pytest.mark.slow
def test_a_study_under_a_profile_warms_every_level_and_records_each_levels_throughput(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_STUDIES_DIR", str(tmp_path))
    opts = plan.RunOptions(trials=1, study="profiled", workload="code", quick_requests=1, concurrency=1, max_tokens=6,
                           live=False, load_profile="1:2req,3:3req",
                           sets=["drafter=ngram", "draft_policy=fixed", "draft_length=3", "verify_slots=4",
                                 "dtype=float32", "quantization=none", "compile=none", "threads=1"])
    p = plan.build(opts)
    assert p.load_profile == LoadProfile((Phase(1, None, None, 2), Phase(3, None, None, 3)))
    outcome = loop.run_study(p)
    t = optuna.load_study(study_name=outcome.name, storage=outcome.storage).get_trials()[0]
    attrs = t.user_attrs
    assert attrs["status"] == record.OK, attrs.get("failure")
    assert attrs["warmup_waves_s"] and len(attrs["warmup_waves_s"]) >= 4  # at least two waves at each of 1 and 3
    # the objective is the throughput pooled over the phases; each level's is a flat attribute of its own
    metrics = attrs["metrics"]
    assert t.values == [metrics["output_tok_s"]] and metrics["load_profile"] == "1:2req,3:3req"
    assert [ph["sent"] for ph in metrics["phases"]] == [2, 3] and metrics["completed"] == 5
    assert attrs["phase_c1_output_tok_s"] == metrics["phases"][0]["output_tok_s"] > 0
    assert attrs["phase_c3_output_tok_s"] == metrics["phases"][1]["output_tok_s"] > 0
    rows = pd.read_parquet(attrs["requests_file"])
    assert rows.loc[rows["phase"] == "full", "load_phase"].tolist() == [0, 0, 1, 1, 1]
