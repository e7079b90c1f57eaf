"""`autotune run --budget`: one wall-clock limit for the whole run, validation and estimator included.

  finish  = validation's first round (the top configurations and the baseline, each one launch and `repeats`
            benchmarks) + the estimator's two passes (embedded setups: two launches, ~80 short requests)
            + the draft-length schedule's sweep where the run fits one (study/schedule.py: a launch, a
            benchmark per draft length, concurrency and repeat)
  search  = until end - finish, re-planned after every measured trial from what its launches and benchmarks
            cost on this machine (Prices); until two launches are known (the first is cold), a third of the
            budget is held back
Each phase has a deadline it cannot overrun: a trial still running at the search's is cut (status budget:
no verdict on its configuration), validation adds repeats only while they fit, the estimator's passes run
only if they fit (else it is fitted on the study's own rows), the schedule's sweep stops at its deadline.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

from autotune.study import record

MORE_TRIALS = 5  # what a stop's suggested budget buys beyond the trials run so far
UNPRICED_FINISH_SHARE = 1 / 3  # held back for the finish before any trial has priced it
MAX_FINISH_SHARE = 1 / 2  # at most this much held back for a full finish; validation shrinks to fit (its floor:)
FLOOR = {"top": 1, "repeats": 2}  # the best configuration and the baseline, twice each on fresh launches
REPORT_S = 15.0  # export and report: files and plots, no launch
ESTIMATOR_LAUNCHES = 2  # the traced collection pass and the evaluation: a server each
ESTIMATOR_REQUESTS = 80  # their requests, one at a time: 6 prompts x 5 draft lengths, 8 prompts x ~6 arms
ESTIMATOR_TOKENS = 32


@dataclass(frozen=True)
class Prices:
    """What this machine charged the study so far, in seconds: medians over its measured trials. A launch is
    its start and warm-up together: engines compile in either (the embedded engine before it answers)."""
    warm_launch_s: float | None  # a launch, the slowest (a cold compile, paid once) left out; None: one seen
    cold_launch_s: float  # the slowest launch
    bench_s: float  # one full benchmark
    request_s: float  # one request alone, ESTIMATOR_TOKENS tokens
    cold_compile_s: float = 0.0  # of the slowest launch, the compiling its engine reported (facts.startup_compile_gauge)
    source: str | None = None  # the earlier study these were read from (price_memory); None: this study's

    @classmethod
    def of(cls, trials, concurrency: int) -> Prices | None:
        timed = [t.user_attrs for t in trials if t.user_attrs.get("status") != record.DUPLICATE
                 and (t.user_attrs.get("timings") or {}).get("bench_s")
                 and (t.user_attrs.get("metrics") or {}).get("total_output_tokens")]
        if not timed:
            return None
        launched = [a["timings"] for a in timed if a.get("launch") == "launched"] or [a["timings"] for a in timed]
        launches = sorted((t.get("launch_s", 0.0) + t.get("warmup_s", 0.0), t.get("compile_s", 0.0)) for t in launched)
        # a stream's seconds per token: the benchmark's streams ran side by side
        per_token = statistics.median(a["timings"]["bench_s"] * concurrency / a["metrics"]["total_output_tokens"]
                                      for a in timed)
        return cls(warm_launch_s=statistics.median(s for s, _ in launches[:-1]) if len(launches) > 1 else None,
                   cold_launch_s=launches[-1][0], cold_compile_s=launches[-1][1],
                   bench_s=statistics.median(a["timings"]["bench_s"] for a in timed), request_s=per_token * ESTIMATOR_TOKENS)

    @property
    def launch_s(self) -> float:
        """A relaunch of a configuration the study ran (validation's): as the warm launches went; while only the
        cold one is known, that one without the compiling its engine reported (the compile cache serves a
        relaunch: on the H100 at concurrency 8 a 180 s first launch, 161 s of it compiling, relaunched in 52 s,
        where pricing validation at 180 s a launch stopped a 10-minute search after one trial). What a cached
        compile still costs is left to the third of the budget held back until a second launch is seen."""
        return self.cold_launch_s - self.cold_compile_s if self.warm_launch_s is None else self.warm_launch_s

    def trial_s(self, reuses_server: bool) -> float:
        """A next trial: a benchmark (and the quick wave, about one more share of it), plus a launch unless the
        running server takes it. The cold compile already paid is not charged again (with one launch seen, no
        launch is: a trial that overruns is cut at the deadline all the same)."""
        return 1.2 * self.bench_s + (0.0 if reuses_server else self.warm_launch_s or 0.0)

    @property
    def launched_trial_s(self) -> float:
        """A next trial with its launch priced in full, as validation prices a relaunch (what a stop quotes)."""
        return self.trial_s(reuses_server=True) + self.launch_s


@dataclass(frozen=True)
class Sweep:
    """The draft-length schedule's sweep: its launches and its benchmarks, each a closed loop of `cell_s` seconds
    whose last requests (`request_tokens` each) then finish."""
    launches: int
    benchmarks: int
    cell_s: float
    request_tokens: int

    def seconds(self, prices: Prices) -> float:
        """At this machine's prices: a request's finish at the pace of the study's benchmarks (the sweep's low
        concurrencies run faster a stream, its high ones slower: the study's level sits between)."""
        finish_s = self.request_tokens * prices.request_s / ESTIMATOR_TOKENS
        return self.launches * prices.launch_s + self.benchmarks * (self.cell_s + finish_s)


@dataclass
class Finish:
    """What the run does after the search: validate (top + baseline, repeats each), then the estimator and
    the schedule's sweep."""
    top: int
    repeats: int
    quality_prompts: int  # greedy outputs compared, per configuration launched
    estimator_passes: bool  # the setup runs on the embedded engine: two live passes
    sweep: Sweep | None = None  # the draft-length schedule is fitted (--fit-schedule, a varying load)

    def validation_s(self, prices: Prices, configs: int | None = None, repeats: int | None = None) -> float:
        """The first round: `configs` configurations (default: the top and the baseline) launched once each."""
        configs = self.top + 1 if configs is None else configs
        runs = configs * (self.repeats if repeats is None else repeats)
        return configs * (prices.launch_s + self.quality_prompts * prices.request_s) + runs * prices.bench_s

    def estimator_s(self, prices: Prices) -> float:
        return (ESTIMATOR_LAUNCHES * prices.launch_s + ESTIMATOR_REQUESTS * prices.request_s) if self.estimator_passes else 0.0

    def sweep_s(self, prices: Prices) -> float:
        return self.sweep.seconds(prices) if self.sweep else 0.0

    def seconds(self, prices: Prices, configs: int | None = None) -> float:
        return self.validation_s(prices, configs) + self.estimator_s(prices) + self.sweep_s(prices) + REPORT_S

    def floor_s(self, prices: Prices, configs: int | None = None) -> float:
        least = FLOOR["top"] + 1 if configs is None else min(configs, FLOOR["top"] + 1)
        return self.validation_s(prices, least, min(self.repeats, FLOOR["repeats"])) + REPORT_S


@dataclass
class Budget:
    total_s: float
    finish: Finish | None = None  # None: the deadline is the search's alone (a worker, a ci re-tune)
    start: float = field(default_factory=time.time)
    prior: Prices | None = None  # an earlier study's prices on this machine: the plan's until a trial prices it

    @property
    def end(self) -> float:
        return self.start + self.total_s

    def left(self) -> float:
        return self.end - time.time()

    def search_deadline(self, prices: Prices | None, configs: int | None = None) -> float:
        """Trials end here: what the finish needs at these prices is held back, at most half the budget unless
        validation's floor needs more. `configs`: the launches validation's first round would make as the study
        stands (its best distinct configurations and the defaults; one where the defaults lead)."""
        if self.finish is None:
            return self.end
        if prices is None:
            return self.end - UNPRICED_FINISH_SHARE * self.total_s
        if prices.warm_launch_s is None:  # one launch seen: cold, not what a relaunch costs; the floor still holds
            held = max(self.finish.floor_s(prices, configs), UNPRICED_FINISH_SHARE * self.total_s)
        else:
            held = max(self.finish.floor_s(prices, configs),
                       min(self.finish.seconds(prices, configs), MAX_FINISH_SHARE * self.total_s))
        return self.end - min(held, self.total_s)

    def plan_line(self, prices: Prices | None, configs: int | None = None) -> str:
        """How the budget will be spent, said at the start (and as the prices change); before the study's own
        prices, at the prior's."""
        total = f"budget {minutes(self.total_s)}"
        if self.finish is None:
            return f"{total}, all of it for trials"
        prices = prices or self.prior
        search = self.search_deadline(prices, configs) - self.start
        if prices is None or (prices.warm_launch_s is None and not prices.source):  # one launch of its own: cold
            return (f"{total}: trials for about {minutes(search)}, then validation of the top {self.finish.top} "
                    f"({self.finish.repeats} benchmarks each on fresh launches)"
                    + (", the draft-length estimator's passes" if self.finish.estimator_passes else "")
                    + (", the draft-length schedule's sweep" if self.finish.sweep else "")
                    + " and the report; re-planned as trials price launches and benchmarks here")
        return (f"{total}: trials until {minutes(search)}, validation ~{minutes(self.finish.validation_s(prices, configs))}"
                + (f", estimator ~{minutes(self.finish.estimator_s(prices))}" if self.finish.estimator_passes else "")
                + (f", schedule sweep ~{minutes(self.finish.sweep_s(prices))}" if self.finish.sweep else "")
                + f" (a launch {prices.launch_s:.0f} s, the first {prices.cold_launch_s:.0f} s; a benchmark {prices.bench_s:.0f} s here"
                + (f", as study {prices.source} paid)" if prices.source else ")"))

    def check_holds_a_trial(self, prices: Prices | None) -> None:
        """ValueError (one line) where, at these prices, what is left cannot hold the first trial with its launch
        and the finish's floor (the exported defaults validated alone): the run would end past its budget."""
        if prices is None or self.finish is None:
            return
        now = time.time()
        need = prices.launched_trial_s + self.finish.floor_s(prices, configs=1)
        if (now - self.start) + need > self.total_s:
            paid = f"as study {prices.source} paid" if prices.source else "here"
            raise ValueError(
                f"--budget {minutes(self.total_s)} cannot hold one trial and its validation on this machine: "
                f"~{minutes(need)} ({paid}: a launch {prices.launch_s:.0f} s, a benchmark {prices.bench_s:.0f} s); "
                f"--budget {math.ceil(self.budget_for(prices, MORE_TRIALS, now) / 60)}m holds about {MORE_TRIALS} trials")

    def budget_for(self, prices: Prices, trials: int, now: float | None = None) -> float:
        """The budget whose search would hold `trials` more trials, each launched (a relaunch priced as
        validation prices it), at these prices: the time spent so far, the trials and the full finish (more
        than any deadline holds back)."""
        now = time.time() if now is None else now
        held = self.finish.seconds(prices) if self.finish else 0.0
        return (now - self.start) + trials * prices.launched_trial_s + held

    def stop_line(self, prices: Prices | None, measured: int, configs: int | None = None) -> str:
        """Why the search stops, in this machine's prices, and what budget would hold more (an engine whose every
        trial is a launch of a minute or more, SGLang's on the H100, fits one trial in 6 minutes)."""
        if prices is None:
            return "budget reached: no new trials"
        floor = self.finish.floor_s(prices, configs) if self.finish else 0.0
        more = self.budget_for(prices, MORE_TRIALS)
        return (f"budget reached after {measured} trial{'s' * (measured != 1)}: a trial with its launch costs "
                f"~{minutes(prices.launched_trial_s)} here (a launch {prices.launch_s:.0f} s, a "
                f"benchmark {prices.bench_s:.0f} s) and the finish needs ~{minutes(floor)} at least; "
                f"--budget {math.ceil(more / 60)}m would hold about {MORE_TRIALS} more")


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"
