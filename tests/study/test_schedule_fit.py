"""The draft-length schedule fit (autotune/study/schedule.py, issue 34 points 2 and 6): the choice on
measurement rows with a known optimum, the sweep on a live embedded engine writing a schedule the engine
reads, and `autotune run --fit-schedule`'s finish exporting a launch.sh that runs it."""
import httpx
from conftest import exported_server

from autotune import export, pipeline, report
from autotune.bench import load_workload
from autotune.embedded.draft_schedule import DraftSchedule
from autotune.engines import get_adapter
from autotune.engines.launcher import launch
from autotune.study import loop, schedule
from autotune.study import plan as planning
from autotune.study.budget import ESTIMATOR_TOKENS, Budget, Finish, Prices, Sweep
from autotune.study.schedule import Measurement, Phase
from autotune.study.storage import load_study

# A small study (see tests/study/test_study.py): one launch configuration that drafts, so both trials share a server.
SMALL = {"workload": "code", "num_requests": 2, "quick_requests": 1, "concurrency": 2, "max_tokens": 8, "live": False,
         "min_measure_s": 0}
ONE_SERVER = ["drafter=ngram", "draft_length=4", "draft_policy=fixed", "ngram_min=1", "ngram_max=4",
              "prefill_ubatch=256", "dtype=float32", "quantization=none", "compile=none", "threads=1"]


def rows(k: int, batch: int, values: list[float], drafter: str = "ngram") -> list[Measurement]:
    return [Measurement(drafter, k, batch, v) for v in values]


def test_a_draft_that_wins_single_stream_and_loses_under_load_gives_two_rows(tmp_path):
    measured = []
    for batch, plain, drafted in ((1, 100, 150), (2, 180, 250), (4, 300, 240), (8, 500, 380)):
        measured += rows(0, batch, [plain * 0.99, plain, plain * 1.01])
        measured += rows(4, batch, [drafted * 0.99, drafted, drafted * 1.01])
    measured += rows(4, 1, [999.0], drafter="early_exit")  # another drafter's row is not this schedule's
    fit = schedule.fit(measured, "ngram", [Phase(1), Phase(2), Phase(4), Phase(8)])

    assert fit.chosen == {1: 4, 2: 4, 4: 0, 8: 0}
    assert [(r.max_batch, r.draft_length) for r in fit.schedule.rows] == [(2, 4), (8, 0)]
    assert [fit.schedule.length_for(b) for b in (1, 2, 3, 8, 32)] == [4, 4, 0, 0, 0]
    # on the ramp, each phase at its better k: beyond both fixed lengths
    p = fit.prediction
    assert p.fixed_tok_s == {0: 270.0, 4: 255.0} and p.best_fixed_k == 0
    assert p.schedule_tok_s == (150 + 250 + 300 + 500) / 4 and round(p.ratio, 3) == round(300 / 270, 3)
    assert fit.rows_text() == "1-2: k=4, 3+: off"

    fit.write(tmp_path)
    assert DraftSchedule.load(tmp_path / schedule.SCHEDULE_FILE) == fit.schedule
    assert schedule.read_fit(tmp_path) == fit


def test_differences_within_the_noise_keep_the_shorter_draft():
    measured = []
    for batch in (1, 8):
        measured += rows(0, batch, [100.0, 101.0, 99.0])
        measured += rows(4, batch, [120.0, 121.0, 119.0])  # beyond the noise of k = 0
        measured += rows(8, batch, [121.5, 122.0, 121.0])  # 1% over k = 4: within it
    fit = schedule.fit(measured, "ngram")
    assert fit.chosen == {1: 4, 8: 4} and fit.schedule.rows[0].draft_length == 4 and len(fit.schedule.rows) == 1

    one_each = rows(0, 1, [100.0]) + rows(4, 1, [102.0])  # one run each: the noise floor, not a zero interval
    assert schedule.fit(one_each, "ngram").chosen == {1: 0}


def test_two_wide_intervals_are_no_reason_for_a_draft_that_measured_slower():
    # an H100 sweep's cells at batch 2 (2026-12-05, two repeats each): every interval reaches k = 8's low end,
    # but k = 2 and k = 4 ran 8% and 3.3% below it by median
    measured = (rows(0, 2, [1052.7, 933.4]) + rows(2, 2, [1141.2, 1019.4]) + rows(4, 2, [1206.8, 1057.0])
                + rows(8, 2, [1217.5, 1122.7]))
    assert schedule.fit(measured, "ngram").chosen == {2: 8}


def test_a_schedule_that_gains_nothing_measurable_over_a_fixed_k_is_that_fixed_k():
    measured = []
    for batch, plain, drafted in ((1, 100, 120), (8, 500, 490)):
        measured += rows(0, batch, [plain * 0.99, plain, plain * 1.01])
        measured += rows(4, batch, [drafted * 0.99, drafted, drafted * 1.01])
    fit = schedule.fit(measured, "ngram", [Phase(1), Phase(8)])
    # per batch: k = 4 alone, plain under load (490 is within the noise of 500); on the load that is
    # (120 + 500) / 2 = 310 against fixed k = 4's (120 + 490) / 2 = 305: 1.016x, within the noise
    assert fit.chosen == {1: 4, 8: 4} and fit.rows_text() == "1+: k=4"
    assert fit.prediction.ratio == 1.0 and fit.prediction.best_fixed_k == 4
    assert fit.notes and "(1: k=4, 2+: off) was predicted 1.016x fixed k=4" in fit.notes[0]


def test_cells_carry_medians_and_intervals():
    (cell,) = schedule.cells_of(rows(2, 4, [90.0, 100.0, 110.0]), "ngram")
    assert (cell.batch, cell.draft_length, cell.median, cell.runs) == (4, 2, 100.0, 3)
    assert cell.low <= 97.0 and cell.high >= 103.0  # at least the noise floor either side


def test_the_budget_prices_the_sweep_from_the_studys_benchmarks():
    prices = Prices(warm_launch_s=20.0, cold_launch_s=60.0, bench_s=10.0, request_s=0.5 * ESTIMATOR_TOKENS)  # 0.5 s/token
    planned = schedule.planned_sweep(get_adapter("embedded"), [1, 2, 4, 8], max_tokens=8)
    # the embedded engine changes k live: one launch; 0, 2, 4, 8 and the winner's own k at 4 levels, twice
    assert planned == Sweep(launches=1, benchmarks=5 * 4 * 2, cell_s=schedule.CELL_S, request_tokens=8)
    # each cell: its closed loop, then one request's 8 tokens at the study's pace
    assert planned.seconds(prices) == 20.0 + 40 * (schedule.CELL_S + 8 * 0.5)
    with_sweep, without = Finish(1, 2, 4, False, sweep=planned), Finish(1, 2, 4, False)
    assert with_sweep.seconds(prices) - without.seconds(prices) == planned.seconds(prices)
    budget = Budget(3600.0, with_sweep, start=0.0)
    assert "schedule sweep ~5.7 min" in budget.plan_line(prices)  # 340 s
    # held back from the search: its deadline moves earlier by the sweep's price
    assert Budget(3600.0, without, start=0.0).search_deadline(prices) - budget.search_deadline(prices) == 340.0


def test_sweep_on_a_live_embedded_server_writes_a_schedule_the_engine_takes(tmp_path):
    adapter = get_adapter("embedded")
    config = {"drafter": "ngram", "draft_length": 4, "verify_slots": 2, "max_seq_len": 512, "threads": 1}
    server = launch(adapter, config, log_path=tmp_path / "serve.log", timeout_s=180)
    try:
        workload = load_workload("code", 0)
        configs = {k: {**config, "draft_length": k} for k in (0, 4)}
        measured = schedule.measure_grid(adapter, server, "ngram", configs, [1, 2], workload=workload, repeats=1,
                                         cell_s=0.1, max_tokens=16)  # a request a stream, then their finish
        assert sorted((m.batch, m.draft_length) for m in measured) == [(1, 0), (1, 4), (2, 0), (2, 4)]
        assert all(m.output_tok_s > 0 for m in measured)
        # plain decoding proposes nothing: its tokens per step are one; the drafted cells report their own
        assert all(m.accept_length == 1.0 for m in measured if m.draft_length == 0)
        assert all(m.accept_length is not None and m.accept_length >= 1.0 for m in measured if m.draft_length)

        fit = schedule.fit(measured, "ngram")
        path = fit.write(tmp_path)
        loaded = DraftSchedule.load(path)
        assert loaded.drafter == "ngram" and {loaded.length_for(b) for b in (1, 2)} <= {0, 4}
        assert set(fit.chosen) == {1, 2} and fit.prediction is not None
        # the running engine accepts the fitted schedule as it is
        adapter.apply_runtime(server.base_url, {"draft_schedule": loaded.model_dump(mode="json")})
    finally:
        server.stop()


def test_a_fitted_schedule_is_exported_in_a_launch_script_that_runs_it(tmp_path):
    # The fit and export of `autotune run --fit-schedule`, on the study's best trial (validation is left out: on
    # this CPU the plain baseline wins it, and the run then fits nothing, with a note)
    opts = planning.RunOptions(trials=2, study="sched", studies_root=str(tmp_path), sets=ONE_SERVER, fit_schedule=True,
                               **SMALL)
    outcome = loop.run_study(planning.build(opts))
    ctx = load_study(outcome.directory, outcome.storage)
    pick = export.chosen(ctx)
    fitted = schedule.fit_for_study(ctx, pick["config"], pick["trial"], levels=[1, 2], ks=[0, 4], repeats=1,
                                    cell_s=0.1)
    best = outcome.directory / "best"
    assert schedule.read_fit(best) == fitted and DraftSchedule.load(best / schedule.SCHEDULE_FILE) == fitted.schedule
    assert {(c.batch, c.draft_length) for c in fitted.cells} == {(1, 0), (1, 4), (2, 0), (2, 4)}

    export.export(ctx)
    launch_sh = (best / "launch.sh").read_text()
    assert f"--draft-schedule {(best / schedule.SCHEDULE_FILE).resolve()}" in launch_sh
    assert "draft schedule (batch -> draft length)" in launch_sh
    html = report.write_report(ctx, png=False).read_text()
    assert 'id="fig-schedule"' in html and "<h2>Draft-length schedule</h2>" in html
    lines = pipeline.closing_lines({"schedule": best / schedule.SCHEDULE_FILE, "problems": []}, outcome.directory,
                                   outcome.storage)
    assert any(line.startswith("draft schedule (ngram): batch 1") for line in lines)
    # the exported script starts the engine with the fitted schedule in force
    with exported_server(best / "launch.sh", tmp_path / "launch-sh.log") as (_, url):
        assert httpx.get(url + "/admin/runtime").json()["draft_schedule"] == fitted.schedule.model_dump(mode="json")
