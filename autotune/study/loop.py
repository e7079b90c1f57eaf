"""The one trial loop: `autotune run` (serial or `--parallel`) and `autotune worker` all run trials
through `Fleet`, N runner threads in this process (N = 1 for a serial run), each with its own engine
server on its own slot of the machine (packing.py). Optuna's storage is the only coordination: a runner
asks the study for a trial, runs it (trial.py), tells the result.

`run_study` creates (or resumes) a study, queues its seeds and runs the loop; `run_trials` is the loop
with its live view, Ctrl-C handling and end-of-run bookkeeping, shared with `worker.join`. Seeds wait in the
fleet's own queue and enter the study only as a runner takes them: a run that ends first leaves no placeholder
trial behind, and `--resume` queues the seeds no trial has run yet.
"""
from __future__ import annotations

import math
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import optuna
from optuna.trial import TrialState

from autotune import predict, provenance
from autotune.bench.metric_registry import MAXIMIZE
from autotune.study import objectives, optuna_compat, packing, price_memory, record, storage
from autotune.study.budget import Budget, Prices
from autotune.study.live import LiveView
from autotune.study.parallel import HEARTBEAT_S, WAIT_S, Heartbeat, fail, fail_stale
from autotune.study.plan import RUN_OPTIONS, Plan
from autotune.study.trial import Servers, run_trial

MAX_IDLE_ASKS = 30  # trials in a row that measure nothing (rejected, duplicates): the space is exhausted
PREDICTED_SEEDS = 3  # best predicted configurations enqueued after the seeds
CALIBRATE_AFTER = 4  # measured trials before the speed model is refitted to this machine
PREDICTION_RESOLUTION = 0.05  # predicted speeds closer than this (relative) are a tie


class Stop:
    """Ctrl-C: the first asks to stop after the current trial, the second interrupts it. SIGTERM
    interrupts at once, still stopping the engine server and keeping every finished trial."""

    def __init__(self, view: LiveView):
        self.requested, self.view, self.previous, self.previous_term = False, view, None, None

    def __enter__(self):
        self.previous = signal.signal(signal.SIGINT, self.handle)
        self.previous_term = signal.signal(signal.SIGTERM, self.terminate)
        return self

    def terminate(self, signum, frame):
        raise KeyboardInterrupt

    def handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.view.note("Ctrl-C: stopping after the current trial (Ctrl-C again to abort it)")

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self.previous)
        signal.signal(signal.SIGTERM, self.previous_term)


@dataclass
class Outcome:
    name: str
    storage: str
    directory: Path
    best: optuna.trial.FrozenTrial | None
    default: optuna.trial.FrozenTrial | None
    gain: float | None
    launches: int
    launches_saved: int
    stale_failed: int
    interrupted: bool


def run_study(p: Plan, console=None, first: list[tuple[dict, dict]] = (), budget: Budget | None = None) -> Outcome:
    """Create the study (or continue it with --resume), queue the seeds (after `first`: (config, user attrs)
    pairs such as ci's warm start), run the trial loop until `budget`'s search deadline (default: all of
    --budget for trials)."""
    opts = p.opts
    sampler = objectives.make_sampler(opts.objective, seed=opts.seed)
    study, stale = storage.open_study(p.name, p.storage, objectives.metrics(opts.objective), sampler,
                                      objectives.make_pruner(opts.objective), opts.resume)
    written = provenance.write(p.directory / "provenance.json", hardware=p.hardware, adapter=p.adapter,
                               model=opts.model, draft_model=opts.draft_model, workload=opts.workload,
                               space_source=p.space.source)
    study.set_user_attr("engine", opts.engine)
    study.set_user_attr("objective", opts.objective)
    if p.space.defaults() in p.space.seed_configs():  # validation's baseline, whether or not the run reaches it
        study.set_user_attr("defaults_seed_config", record.json_ready(p.space.defaults()))
    for name in RUN_OPTIONS:  # the load and limits validation re-runs the winners with
        study.set_user_attr(name, getattr(opts, name))
    study.set_user_attr("run_options", record.json_ready({**opts.__dict__, "parallel": 1}))  # what `autotune worker` runs
    # Seeds first; on resume, those the first run planned that no trial has run yet (a study from before the
    # queue was lazy: its not_run placeholders).
    trials = study.get_trials(deepcopy=False)
    if not opts.resume:
        study.set_user_attr("planned_seeds", record.json_ready(p.space.seed_configs()))
    planned = study.user_attrs.get("planned_seeds") or [
        t.user_attrs["seed_config"] for t in trials if t.user_attrs.get("status") == record.NOT_RUN]
    ran = [t.user_attrs["seed_config"] for t in trials
           if "seed_config" in t.user_attrs and t.user_attrs.get("status") != record.NOT_RUN]
    seeds = [seed for seed in planned if seed not in ran]
    queue = list(first) + [(config, attrs) for config, attrs in seed_queue(p, study, seeds)
                           if all(config != c for c, _ in first)]
    budget = budget or (Budget(opts.budget_s) if opts.budget_s else None)
    if budget and budget.finish and not Prices.of(trials, opts.concurrency or 1):  # priced by an earlier run
        budget.prior = price_memory.earlier_prices(p.directory, written["fingerprint"],
                                                   {key: getattr(opts, key) for key in price_memory.SAME_LOAD})
        budget.check_holds_a_trial(budget.prior)
    return run_trials(p, study, budget=budget, console=console, stale_failed=stale, close_queue=True, queue=queue)


def run_trials(p: Plan, study: optuna.Study, *, budget: Budget | None, console=None, stale_failed: int = 0,
               close_queue: bool = False, queue: list[tuple[dict, dict]] = ()) -> Outcome:
    """Run trials (`queue`'s (config, user attrs) first, in order) until the study holds opts.trials measured
    ones (None: no count), the budget's search deadline would be overrun, the space is exhausted, or Ctrl-C;
    then record the totals. `close_queue`: the study's own run closes trials another process queued in the
    storage and nobody reached (a worker leaves them to the others)."""
    opts = p.opts
    (p.directory / "logs").mkdir(parents=True, exist_ok=True)
    fleet = Fleet(p)
    fleet.queue = list(queue)
    view = LiveView(opts.objective, {n: q.default for n, q in p.space.params.items()}, console=console, enabled=opts.live)
    interrupted = False
    with view, Stop(view) as stop:
        view.show_history(study)
        try:
            fleet.run(study, view, stop, budget)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            fleet.stop()
            if close_queue:
                storage.fail_waiting(study, "the run ended (trial count, budget, Ctrl-C) before this queued trial")
            launches = int(study.user_attrs.get("launches", 0)) + fleet.launches
            saved = int(study.user_attrs.get("launches_saved", 0)) + fleet.saved
            study.set_user_attr("launches", launches)
            study.set_user_attr("launches_saved", saved)
            storage.write_trials(study, p.directory / "trials.parquet")
    best, default, gain = summarize(study, opts.objective, p.space.defaults())
    if best is not None:
        study.set_user_attr("best_trial", best.number)
        study.set_user_attr("gain_over_default", gain)
    stopped = interrupted or stop.requested
    view.summary(best, default, gain, launches=launches, saved=saved, directory=p.directory, interrupted=stopped)
    return Outcome(p.name, p.storage, p.directory, best, default, gain, launches, saved, stale_failed, stopped)


def seed_queue(p: Plan, study: optuna.Study, seeds: list[dict]) -> list[tuple[dict, dict]]:
    """The seeds, then the best predicted configurations the seeds and the study leave out, as (config, the user
    attrs its trial starts with)."""
    defaults = p.space.defaults()
    # the defaults seed is marked: validation's baseline, wherever it stands in the queue
    queue = [(config, {"seed_config": config, **({"defaults_seed": True} if config == defaults else {})})
             for config in seeds]
    for config, prediction in predicted_configs(p, study, [c for c, _ in queue]):
        queue.append((config, {"seed_config": config, "predicted": prediction}))
    return queue


def planned_queue(p: Plan) -> list[tuple[str, dict]]:
    """What a new study of this plan queues, in order, as (seed | predicted, config): `autotune run
    --plan`, computed against an in-memory study without launching anything."""
    study = optuna.create_study(directions=objectives.directions(p.opts.objective))
    return [("predicted" if "predicted" in attrs else "seed", config)
            for config, attrs in seed_queue(p, study, p.space.seed_configs())]


def predicted_configs(p: Plan, study: optuna.Study, queued: list[dict] = ()) -> list[tuple[dict, dict]]:
    """The best configurations by predicted speed that neither the study nor `queued` holds, with their
    predictions; the speed model is refitted to this machine's measured trials once there are enough.
    GPU only: the roofline model has no CPU terms, so its CPU ranking is flat (the seeds do that job)."""
    profile = getattr(p.hardware, "profile", None)
    if profile is None or not profile.is_gpu:
        return []
    gpus = max(1, int(getattr(p.hardware, "gpu_count", 0) or 0))
    trials = study.get_trials(deepcopy=False)
    measured = [t for t in trials if t.state == TrialState.COMPLETE and t.user_attrs.get("metrics")]
    calibration = None
    if len(measured) >= CALIBRATE_AFTER:
        calibration = predict.Calibration.fit(
            [predict.trial_from_metrics(t.user_attrs["config"], t.user_attrs["metrics"], p.opts.concurrency or 1)
             for t in measured], p.model, profile, gpus, engine=p.adapter, draft=p.draft)
    known = {record.effective_key(p.adapter, t.user_attrs.get("config") or t.user_attrs.get("seed_config") or {}) for t in trials}
    known |= {record.effective_key(p.adapter, config) for config in queued}
    ranked = predict.rank_configs(
        p.space, p.model, profile, gpus, top=4 * PREDICTED_SEEDS, concurrency=p.opts.concurrency or 1,
        engine=p.adapter, draft=p.draft, has_draft_model=bool(p.opts.draft_model), calibration=calibration)
    # Predictions within a few percent of each other do not rank (the model is coarser than that): among them,
    # the configuration closest to a queued or measured one goes first, since a runtime-only difference reuses
    # a running server and a shared shape reuses a compile, where anything else is a launch (cold, for a compile).
    anchors = [*queued, *(t.user_attrs["config"] for t in measured)]
    speed = (lambda pr: pr.speed.concurrent_tok_s) if (p.opts.concurrency or 1) > 1 else (lambda pr: pr.speed.single_tok_s)
    ranked.sort(key=lambda cp: (-math.floor(math.log(max(speed(cp[1]), 1e-9)) / math.log(1 + PREDICTION_RESOLUTION)),
                                min((launch_distance(p.adapter, cp[0], a) for a in anchors), default=0)))
    out = []
    for config, prediction in ranked:
        key = record.effective_key(p.adapter, config)
        if key not in known and len(out) < PREDICTED_SEEDS:
            known.add(key)
            out.append((config, record.json_ready(prediction.to_dict())))
    return out


def launch_distance(adapter, a: dict, b: dict) -> int:
    """How many launch settings (not runtime knobs) two configurations differ in: 0 = one server runs both."""
    x, y = adapter.effective(a), adapter.effective(b)
    return sum(x.get(k) != y.get(k) for k in set(x) | set(y) if k not in adapter.facts.runtime_params)


def summarize(study: optuna.Study, objective: str, defaults: dict):
    """(winner, the default configuration's trial, winner's gain over it) among measured trials."""
    ok = [t for t in study.get_trials(deepcopy=False) if record.is_ok(t)]
    if not ok:
        return None, None, None
    maximize = objectives.primary(objective).direction == MAXIMIZE
    pick = max if maximize else min
    best = pick(ok, key=lambda t: t.values[0])
    measured = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))  # an SLO miss still has a speed
    default = next((t for t in measured if t.user_attrs.get("config") == defaults), None)
    gain = None
    if default is not None and default.values[0] and best.values[0]:
        gain = best.values[0] / default.values[0] if maximize else default.values[0] / best.values[0]
    return best, default, gain


class Fleet:
    """N trial runners in this process (threads), each with its own engine server (trial.Servers) on its
    own slot of the machine: GPUs and a port from the packer."""

    def __init__(self, p: Plan, slots: int | None = None):
        self.p = p
        self.pool, self.ports = packing.GpuPool.for_hardware(p.hardware), packing.PortBook()
        self.aborted = False  # Ctrl-C twice, or a runner failed: stop at once
        self.ended = False  # the search ended and said why (budget, trial count, an exhausted space)
        self.budget: Budget | None = None
        self.priced = False  # the budget's plan was said again once trials priced it
        self.servers = [Servers(p, slot=packing.Slot(self.pool, self.ports, lambda: self.aborted, adapter=p.adapter))
                        for _ in range(slots or p.opts.parallel)]
        self.running: dict[int, optuna.Trial] = {}  # runner index -> its trial in flight
        self.lock = threading.Lock()
        self.idle = 0
        self.queue: list[tuple[dict, dict]] = []  # (config, user attrs) to run before sampling: seeds, warm starts
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

    def run(self, study: optuna.Study, view, stop, budget: Budget | None = None) -> None:
        """Run trials until the study holds opts.trials measured ones, the budget's search deadline would
        be overrun, or `stop.requested`. A second Ctrl-C fails our trials in flight as interrupted and
        stops their servers."""
        self.study, self.view, self.stop_request, self.budget = study, view, stop, budget
        if budget:
            view.note(budget.plan_line(self.prices()))
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
                fail(study, optuna_compat.trial_id(trial), "interrupted", "stopped by the user", status=record.INTERRUPTED)
            self.stop()
            raise
        if self.errors:
            raise self.errors[0]

    def _runner(self, i: int):
        servers = self.servers[i]
        try:
            while (trial := self._next_trial(servers)) is not None:
                self.running[i] = trial
                try:
                    with Heartbeat(self.study, trial):
                        frozen = run_trial(self.study, trial, self.p, servers, self.view, deadline=self.deadline())
                except Exception as e:  # an abort (packing.Cancelled) or a storage error mid-trial
                    aborted = self.aborted
                    fail(self.study, optuna_compat.trial_id(trial), "interrupted" if aborted else "error", f"{type(e).__name__}: {e}",
                         status=record.INTERRUPTED if aborted else record.FAILED)
                    if aborted:
                        return
                    raise
                finally:
                    self.running.pop(i, None)
                with self.lock:
                    if frozen.user_attrs.get("measured"):
                        self.idle = 0
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

    def prices(self) -> Prices | None:
        return Prices.of(self.study.get_trials(deepcopy=False), self.p.opts.concurrency or 1)

    def deadline(self) -> float | None:
        """time.time() by which trials end: the budget's, less what the finish will need at today's prices.
        None (no cut) until a trial has measured: the first, the defaults, is what the run cannot do without."""
        prices = self.prices() if self.budget else None
        return self.budget.search_deadline(prices, self.validation_configs()) if prices else None

    def validation_configs(self) -> int | None:
        """The launches validation's first round would make if the next trial joined the study's best: its best
        distinct engine runs (up to the finish's top) and the defaults, unless one of them. (Counting only the
        trials so far let a last trial start whose own validation the budget then had no room for.)"""
        if not (self.budget and self.budget.finish):
            return None
        top = self.budget.finish.top
        ok = [t for t in self.study.get_trials(deepcopy=False) if record.is_ok(t)]
        maximize = objectives.primary(self.p.opts.objective).direction == MAXIMIZE
        ok.sort(key=lambda t: t.values[0], reverse=maximize)
        best = list(dict.fromkeys(t.user_attrs.get("effective_key") for t in ok))[:top]
        defaults = record.effective_key(self.p.adapter, self.p.space.defaults())
        return min(len(best) + 1, top) + (defaults not in best)

    def _next_reuses(self, servers) -> bool:
        """Whether the next trial, the first queued one, runs on this runner's live server: it changes only
        runtime knobs (an n-gram seed after another), so it costs no launch."""
        config = self.queue[0][0] if self.queue else None
        return bool(config) and servers.alive() and servers.launch_part(self.p.space.complete(config)) == \
            servers.launch_config

    def _ask(self) -> optuna.Trial:
        """The next trial: the first queued configuration, entered into the study only now, else a sampled one
        (Optuna hands out trials another process queued in the storage first)."""
        if self.queue:
            config, attrs = self.queue.pop(0)
            known = {k: v for k, v in config.items() if k in self.p.space.params}
            self.study.enqueue_trial(self.p.space.trial_params(known), user_attrs=attrs)
        return self.study.ask()

    def _end(self, why: str) -> None:
        """No next trial: say why, once (every runner asks again)."""
        if not self.ended:
            self.ended = True
            self.view.note(why)

    def _next_trial(self, servers) -> optuna.Trial | None:
        """Ask the study for one more trial, wait while the trials in flight may still complete it, or stop."""
        opts = self.p.opts
        while True:
            with self.lock:
                if self.aborted or self.stop_request.requested:
                    return None
                if self.idle >= MAX_IDLE_ASKS:
                    return self._end(f"search ended: {MAX_IDLE_ASKS} trials in a row measured nothing "
                                     "(rejected or already measured): the space is exhausted")
                if self.budget:
                    prices, configs = self.prices(), self.validation_configs()
                    if prices and prices.warm_launch_s is not None and not self.priced:
                        self.priced = True
                        self.view.note(self.budget.plan_line(prices, configs))
                    typical = prices.trial_s(self._next_reuses(servers)) if prices else 0.0
                    if self.budget.search_deadline(prices, configs) - time.time() < typical:
                        measured = sum(bool(t.user_attrs.get("measured")) for t in self.study.get_trials(deepcopy=False))
                        return self._end(self.budget.stop_line(prices, measured, configs))
                if time.monotonic() - self.last_sweep > HEARTBEAT_S:
                    self.last_sweep = time.monotonic()
                    fail_stale(self.study)
                trials = self.study.get_trials(deepcopy=False)
                measured = sum(bool(t.user_attrs.get("measured")) for t in trials)
                running = sum(t.state == TrialState.RUNNING for t in trials)
                if opts.trials is not None and measured >= opts.trials:
                    return self._end(f"search ended: the study holds {measured} measured trials (--trials {opts.trials})")
                if opts.trials is None or measured + running < opts.trials:
                    return self._ask()
            if self.pool.waiting():  # a trial in flight may wait for the GPUs our idle server holds
                servers.stop()
            time.sleep(WAIT_S)
