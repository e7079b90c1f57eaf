"""The trial loop behind `autotune run`.

One trial: suggest a config -> engine rules, hardware conditions, memory fit (rejected before any
launch) -> dedupe by the engine's effective settings (a duplicate reuses the recorded result) ->
reuse the running server when only runtime parameters changed, else launch -> quick measurement
(pruned if hopeless) -> full benchmark -> SLO -> record everything in user_attrs -> tell Optuna.

How outcomes reach the sampler. Optuna's TPE ignores FAIL trials, so a crash recorded as FAIL
would be proposed again and again. Every failure is therefore told as PRUNED with a positive
`feasible` constraint (Optuna 5's `trial.set_constraint`, which replaces `constraints_func`):
TPE ranks infeasible trials below every feasible one and samples away from them. An SLO miss is a
COMPLETE trial with its measured values and a positive `slo` constraint. `user_attrs["status"]`
says in words what happened (ok, infeasible, pruned, rejected, failed, duplicate, interrupted).
"""
from __future__ import annotations

import importlib.util
import json
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import optuna
from optuna.trial import TrialState

from autotune import predict
from autotune.space import constraints
from autotune.space.space import Space, load_overrides, load_space, parse_set_options, parse_space
from autotune.study import objectives, storage
from autotune.study.live import LiveView
from autotune.study.parallel import Fleet, Heartbeat, wait_for_twins

DEFAULT_TRIALS = 25
# The default embedded run ends in about 15 minutes: the study, then validation (FINISH) and the report.
DEFAULT_EMBEDDED_BUDGET_S = 11 * 60
FINISH = {"embedded": {"top": 2, "repeats": 2}}  # validation size after `autotune run` (else validate's own)
# Per-trial load when the user gives none: small for the embedded engine on a CPU (a trial is about
# half a minute, so the default study fits its budget), a serving-sized load for SGLang/vLLM.
DEFAULT_LOAD = {"embedded": {"concurrency": 4, "num_requests": 8, "max_tokens": 48},
                "sglang": {"concurrency": 32, "num_requests": 128, "max_tokens": 256},
                "vllm": {"concurrency": 32, "num_requests": 128, "max_tokens": 256}}
MAX_IDLE_ASKS = 30  # trials in a row that measure nothing (rejected, duplicates): the space is exhausted
# A quick measurement may take this many times the defaults trial's quick wave before its requests
# time out and the trial is pruned: a hopeless configuration costs seconds, not the client's 2 minutes.
QUICK_TIMEOUT_FACTOR = 3.0
QUICK_TIMEOUT_FLOOR_S = 10.0
PREDICTED_SEEDS = 3  # best predicted configurations enqueued after the seeds
CALIBRATE_AFTER = 4  # measured trials before the speed model is refitted to this machine
RUN_OPTIONS = ("workload", "slo", "concurrency", "num_requests", "max_tokens", "seed", "model", "draft_model")


@dataclass
class RunOptions:
    engine: str = "embedded"
    model: str | None = None
    draft_model: str | None = None
    workload: str = "code"
    slo: str | None = None
    objective: str = "throughput"
    trials: int = DEFAULT_TRIALS
    budget_s: float | None = None
    study: str | None = None
    storage: str | None = None
    resume: bool = False
    sets: list[str] = field(default_factory=list)  # --set name=value
    space: str | None = None  # a full space YAML (has `parameters`) or a narrowing file
    concurrency: int | None = None
    num_requests: int | None = None
    quick_requests: int | None = None
    max_tokens: int | None = None
    gpu: str = "auto"
    studies_root: str | None = None
    launch_timeout_s: float = 300.0
    seed: int = 0
    live: bool = True
    parallel: int | str = 1  # trials side by side: a number or "auto" (autotune/study/parallel.py)


@dataclass
class Plan:
    """Everything checked before storage is touched: bad input stops here, leaving study.db as it was."""
    opts: RunOptions
    name: str
    storage: str
    directory: Path
    space: Space
    adapter: object
    hardware: object
    workload: object
    slo: object | None
    shape: constraints.ModelShape | None
    model: predict.ModelSpec  # what the memory and speed predictions read
    draft: predict.ModelSpec | None


def parse_duration(text: str) -> float:
    """"90s", "30m", "1h30m", "2h" or plain seconds -> seconds."""
    import re

    parts = re.fullmatch(r"\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s?)?\s*", text)
    if not text.strip() or not parts or not any(parts.groups()):
        raise ValueError(f"--budget {text!r}: expected a duration such as 90s, 30m, 1h30m")
    h, m, sec = (float(g) if g else 0.0 for g in parts.groups())
    return h * 3600 + m * 60 + sec


def options_from_cli(*, engine, budget, trials, resume, study, **rest) -> RunOptions:
    """RunOptions from the command line's values, with the defaults that depend on other flags."""
    if resume and not study:
        raise ValueError("--resume needs --study NAME (the study to continue)")
    # The embedded engine's default run must end in about 15 minutes on a small CPU machine.
    budget_s = parse_duration(budget) if budget else (DEFAULT_EMBEDDED_BUDGET_S if engine == "embedded" else None)
    load = DEFAULT_LOAD.get(engine, {})
    for name, value in load.items():
        if rest.get(name) is None:
            rest[name] = value
    return RunOptions(engine=engine, budget_s=budget_s, trials=DEFAULT_TRIALS if trials is None else trials,
                      resume=resume, study=study, **rest)


def plan(opts: RunOptions) -> Plan:
    """Resolve and validate every input; raises ValueError (one line) on anything unusable."""
    from autotune.bench import load_workload, parse_slo
    from autotune.engines import get_adapter
    from autotune.hardware import probe

    objectives.metrics(opts.objective)
    if opts.trials < 1:
        raise ValueError("--trials must be at least 1")
    for flag, path in (("--model", opts.model), ("--draft-model", opts.draft_model)):
        if path and not Path(path).exists():
            raise ValueError(f"{flag} {path}: no such file or directory")
    adapter = get_adapter(opts.engine)  # raises for an unknown engine
    if opts.engine != "embedded" and importlib.util.find_spec(opts.engine) is None:
        raise ValueError(f"{opts.engine} is not installed on this machine (pip install {opts.engine}); "
                         "--engine embedded runs anywhere")
    space = load_space(opts.engine)
    overrides: dict = {}
    if opts.space:
        data = load_overrides(opts.space)
        if "parameters" in data:
            space = parse_space(data, source=opts.space)
        else:
            overrides.update(data)
    overrides.update(parse_set_options(opts.sets))
    space = space.narrowed(overrides)
    hardware = probe(opts.gpu)
    model = predict.load_model(opts.model)  # None: the bundled SmolLM2
    shape = constraints.ModelShape.of(model)
    draft = predict.load_model(opts.draft_model) if opts.draft_model else None
    space = constraints.restrict_space(space, hardware, shape, opts.draft_model)
    from autotune.study.parallel import arrange

    space, opts.parallel = arrange(space, hardware, opts.parallel)  # "auto" resolved; CPU threads shared
    workload = load_workload(opts.workload)
    slo = parse_slo(opts.slo) if opts.slo else None
    name = opts.study or f"{opts.engine}-{Path(opts.workload).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    directory = storage.study_dir(name, opts.studies_root)
    url = opts.storage or storage.default_storage(name, opts.studies_root)
    return Plan(opts, name, url, directory, space, adapter, hardware, workload, slo, shape, model, draft)


# -- servers ---------------------------------------------------------------------------------------
class Servers:
    """At most one engine server at a time; relaunched only when a launch-time parameter changes."""

    def __init__(self, p: Plan, slot=None):
        self.p = p
        self.slot = slot  # parallel trials: this runner's GPUs and port (autotune/study/packing.py)
        self.server = None  # the launcher of the running server
        self.launch_config: dict | None = None
        self.launches = 0
        self.saved = 0
        # Changed on a running server only where the space and the engine both say it can be.
        self.runtime_names = p.space.runtime_names() & set(getattr(p.adapter, "runtime_params", ()))

    def launch_part(self, config: dict) -> dict:
        return {k: v for k, v in config.items() if k not in self.runtime_names}

    def alive(self) -> bool:
        return self.server is not None and self.server.alive()

    def ensure(self, config: dict, log: Path) -> tuple[str, dict]:
        """Bring up a server running `config`; returns (how: launched|reused, launch record)."""
        from autotune.engines.launcher import Launcher, free_port

        adapter = self.p.adapter
        if self.alive() and self.launch_part(config) == self.launch_config:
            runtime = {k: v for k, v in config.items() if k in self.runtime_names}
            try:
                adapter.apply_runtime(self.server.base_url, runtime)
                self.saved += 1
                return "reused", {"argv": self.server.argv, "log": str(self.server.log_path), "runtime": runtime}
            except Exception:  # noqa: BLE001 - a server that will not take the change is relaunched with it
                pass
        self.stop()
        port = self.slot.port() if self.slot else free_port()
        argv, env = adapter.command(config, model=self.p.opts.model, draft_model=self.p.opts.draft_model,
                                    host="127.0.0.1", port=port)
        placement = self.slot.acquire(config) if self.slot else {}  # waits for free GPUs
        self.server = Launcher(argv, env={**env, **placement}, log_path=log, health_url=adapter.health_url(f"http://127.0.0.1:{port}"),
                               base_url=f"http://127.0.0.1:{port}")
        self.launches += 1
        self.launch_config = None
        self.server.start(timeout=self.p.opts.launch_timeout_s)  # raises LaunchError(kind, message, log_tail)
        self.launch_config = self.launch_part(config)
        return "launched", {"argv": argv, "env": env, "log": str(log), **({"placement": placement} if placement else {})}

    def stop(self):
        if self.server is not None:
            self.server.stop()
        if self.slot:
            self.slot.release()
        self.server, self.launch_config = None, None


# -- the loop --------------------------------------------------------------------------------------
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


def run_study(p: Plan, console=None) -> Outcome:
    from autotune.embedded.weights import bundled_gguf_path

    opts = p.opts
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = objectives.make_sampler(opts.objective, seed=opts.seed)
    study, stale = storage.open_study(p.name, p.storage, objectives.metrics(opts.objective), sampler,
                                      objectives.make_pruner(opts.objective), opts.resume)
    (p.directory / "logs").mkdir(parents=True, exist_ok=True)
    storage.write_provenance(p.directory / "provenance.json", hardware=p.hardware, engine=opts.engine,
                             model=opts.model or str(bundled_gguf_path()), draft_model=opts.draft_model,
                             workload=opts.workload, space_source=p.space.source)
    study.set_user_attr("engine", opts.engine)
    study.set_user_attr("objective", opts.objective)
    for name in RUN_OPTIONS:  # the load and limits validation re-runs the winners with
        study.set_user_attr(name, getattr(opts, name))
    study.set_user_attr("run_options", _json_ready({**opts.__dict__, "parallel": 1}))  # what `autotune worker` runs
    defaults = p.space.defaults()
    # Seeds first; on resume, only those an earlier run ended before reaching (status not_run).
    seeds = p.space.seed_configs() if not opts.resume else [
        t.user_attrs["seed_config"] for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
        if t.user_attrs.get("status") == "not_run" and "seed_config" in t.user_attrs]
    for config in seeds:
        study.enqueue_trial(p.space.trial_params(config), user_attrs={"seed_config": config})
    for config, prediction in predicted_configs(p, study):
        study.enqueue_trial(p.space.trial_params(config), user_attrs={"seed_config": config, "predicted": prediction})
    servers = Servers(p) if opts.parallel == 1 else Fleet(p)
    view = LiveView(opts.objective, {n: q.default for n, q in p.space.params.items()}, console=console, enabled=opts.live)
    measured = sum(t.user_attrs.get("measured", False) for t in study.get_trials(deepcopy=False))
    start, idle, interrupted, trial = time.monotonic(), 0, False, None
    durations: list[float] = []
    with view, Stop(view) as stop:
        view.show_history(study)
        try:
            if opts.parallel > 1:
                servers.run(study, view, stop)
            while opts.parallel == 1 and measured < opts.trials and not stop.requested and idle < MAX_IDLE_ASKS:
                if opts.budget_s and durations:
                    left = opts.budget_s - (time.monotonic() - start)
                    if left < sorted(durations)[len(durations) // 2]:  # the next trial would overrun
                        view.note(f"budget reached after {time.monotonic() - start:.0f} s")
                        break
                t0 = time.monotonic()
                trial = study.ask()
                with Heartbeat(study, trial):  # other workers sharing the storage see this trial is alive
                    frozen = run_trial(study, trial, p, servers, view)
                if frozen.user_attrs.get("measured"):
                    measured, idle = measured + 1, 0
                    durations.append(time.monotonic() - t0)
                else:
                    idle += 1
                view.finished(frozen, study)
                storage.write_trials(study, p.directory / "trials.parquet")  # current even if the run is killed
        except KeyboardInterrupt:
            interrupted = True
            if trial is not None and study._storage.get_trial(trial._trial_id).state == TrialState.RUNNING:
                trial.set_user_attr("status", "interrupted")  # only ours: other workers may share the storage
                study.tell(trial, state=TrialState.FAIL)
        finally:
            servers.stop()
            storage.fail_waiting(study, "the run ended (trial count, budget, Ctrl-C) before this queued trial")
            launches_saved = int(study.user_attrs.get("launches_saved", 0)) + servers.saved
            study.set_user_attr("launches_saved", launches_saved)
            study.set_user_attr("launches", int(study.user_attrs.get("launches", 0)) + servers.launches)
            storage.write_trials(study, p.directory / "trials.parquet")
    best, default, gain = summarize(study, opts.objective, defaults)
    if best is not None:
        study.set_user_attr("best_trial", best.number)
        study.set_user_attr("gain_over_default", gain)
    view.summary(best, default, gain, launches=study.user_attrs["launches"], saved=launches_saved,
                 directory=p.directory, interrupted=interrupted or stop.requested)
    return Outcome(p.name, p.storage, p.directory, best, default, gain, study.user_attrs["launches"],
                   launches_saved, stale, interrupted or stop.requested)


def predicted_configs(p: Plan, study: optuna.Study) -> list[tuple[dict, dict]]:
    """The best configurations by predicted speed that the study has neither queued nor run, with their
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
             for t in measured], p.model, profile, gpus, engine=p.opts.engine, draft=p.draft)
    known = {_effective_key(p, t.user_attrs.get("config") or t.user_attrs.get("seed_config") or {}) for t in trials}
    out = []
    for config, prediction in predict.rank_configs(
            p.space, p.model, profile, gpus, top=4 * PREDICTED_SEEDS, concurrency=p.opts.concurrency or 1,
            draft=p.draft, has_draft_model=bool(p.opts.draft_model), calibration=calibration):
        key = _effective_key(p, config)
        if key not in known and len(out) < PREDICTED_SEEDS:
            known.add(key)
            out.append((config, _json_ready(prediction.to_dict())))
    return out


def _effective_key(p: Plan, config: dict) -> str:
    return json.dumps(p.adapter.effective(config), sort_keys=True, default=str)


def run_trial(study: optuna.Study, trial: optuna.Trial, p: Plan, servers: Servers, view: LiveView):
    """One trial from suggestion to tell; returns its frozen record."""
    opts, t_start = p.opts, time.monotonic()
    config = p.space.suggest(trial)
    attrs = {"config": config}
    view.started(trial.number, config)

    def finish(state, values=None, constraint: str | None = None, amount: float = 1.0, **more):
        attrs.update(more)
        attrs["timings"] = {**attrs.get("timings", {}), "total_s": round(time.monotonic() - t_start, 3)}
        for k, v in _json_ready(attrs).items():
            trial.set_user_attr(k, v)
        if constraint:
            trial.set_constraint(constraint, amount)
        study.tell(trial, values, state=state)
        return study.get_trials(deepcopy=False)[trial.number]

    # 1. rules, hardware, memory: rejected before any launch, with the reason and numbers.
    violations = [f"rule: {v}" for v in p.adapter.check(config, p.hardware, has_draft_model=bool(opts.draft_model))]
    violations += [f"hardware: {v}" for v in constraints.hardware_violations(config, p.hardware, p.shape)]
    fit = predict.estimate_memory(config, p.hardware, p.model, p.draft, engine=opts.engine)
    attrs["memory"] = fit.record()
    if not fit.fits:
        violations.append(f"memory: {fit.reason}")
    if violations:
        kind = violations[0].split(":")[0]
        return finish(TrialState.PRUNED, constraint="feasible", status="rejected", failure_kind=kind,
                      failure="; ".join(violations), violations=violations)

    # 2. dedupe: the engine would run exactly what an earlier trial ran.
    effective = p.adapter.effective(config)
    key = _effective_key(p, config)
    attrs.update(effective=effective, effective_key=key)
    trial.set_user_attr("effective_key", key)  # seen by runners sharing the study: a twin waits for this result
    wait_for_twins(study, trial, key, servers)
    for earlier in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
        if earlier.user_attrs.get("effective_key") == key and earlier.user_attrs.get("status") != "duplicate":
            copied = {k: v for k, v in earlier.user_attrs.items() if k not in ("config", "seed_config", "measured", "timings")}
            attrs.update(copied)
            for name, amount in earlier.constraints.items():
                trial.set_constraint(name, amount)
            return finish(earlier.state, earlier.values if earlier.state == TrialState.COMPLETE else None,
                          status="duplicate", duplicate_of=earlier.number, original_status=earlier.user_attrs.get("status"))

    # 3. launch, or reuse the running server when only runtime parameters differ.
    from autotune.engines.launcher import LaunchError

    log = p.directory / "logs" / f"trial-{trial.number}.log"
    view.phase(trial.number, "launching")
    t0 = time.monotonic()
    try:
        how, launch = servers.ensure(config, log)
    except LaunchError as e:
        servers.stop()
        return finish(TrialState.PRUNED, constraint="feasible", status="failed", failure_kind=e.kind,
                      failure=e.message, log_tail=(e.log_tail or "")[-2000:],
                      log=str(log), launch="launched", timings={"launch_s": round(time.monotonic() - t0, 3)},
                      measured=True, argv=e.argv)
    attrs.update(launch=how, argv=launch["argv"], log=launch["log"], measured=True,
                 timings={"launch_s": round(time.monotonic() - t0, 3)})
    if "env" in launch:
        attrs["env"] = launch["env"]
    if "placement" in launch:
        attrs["placement"] = launch["placement"]

    # 4. quick first measurement (also the warm-up), then the full benchmark.
    timeout, reference = quick_timeout(study, defaults=p.space.defaults())
    try:
        quick, requests = measure(p, servers, opts.quick_requests or _quick_size(p), request_timeout=timeout)
        attrs["quick"] = quick
        attrs["timings"]["quick_s"] = quick.get("duration_s")
        timed_out = (quick.get("errors_by_kind") or {}).get("timeout")
        if timed_out:
            servers.stop()  # it is still working on the abandoned requests
            save_requests(p, trial.number, config, requests, "quick")
            return finish(TrialState.PRUNED, constraint="feasible", status="pruned", failure_kind="timeout",
                          failure=f"quick measurement: {timed_out} of {quick.get('sent')} requests took over "
                                  f"{timeout:.0f} s ({QUICK_TIMEOUT_FACTOR:g}x the {reference})")
        first = objectives.values(quick, opts.objective)
        if first is not None and len(study.directions) == 1:
            trial.report(first[0], step=0)
            if trial.should_prune():
                save_requests(p, trial.number, config, requests, "quick")
                return finish(TrialState.PRUNED, status="pruned",
                              failure=f"quick measurement {first[0]:.4g} in the bottom quarter of trials so far")
        view.phase(trial.number, "benchmarking")
        summary, requests = measure(p, servers, opts.num_requests)
    except BenchFailure as e:
        servers.stop()
        return finish(TrialState.PRUNED, constraint="feasible", status="failed", failure_kind=e.kind, failure=str(e))
    attrs["requests_file"] = str(save_requests(p, trial.number, config, requests, "full"))
    attrs["metrics"] = summary
    attrs["timings"]["bench_s"] = summary.get("duration_s")
    values = objectives.values(summary, opts.objective)
    if values is None or not summary.get("completed"):
        return finish(TrialState.PRUNED, constraint="feasible", status="failed", failure_kind="errors",
                      failure=f"no request completed ({summary.get('errors_by_kind') or 'no metrics'})")

    # 5. SLO and errors: measured, but infeasible.
    misses = p.slo.check(summary) if p.slo else []
    if summary.get("error_rate"):
        misses.append(f"error_rate {summary['error_rate']:.3g} > 0 ({summary.get('errors_by_kind')})")
    if misses:
        return finish(TrialState.COMPLETE, values, constraint="slo", amount=float(len(misses)),
                      status="infeasible", failure_kind="slo", failure="; ".join(misses))
    trial.set_constraint("slo", 0.0)
    return finish(TrialState.COMPLETE, values, status="ok")


class BenchFailure(RuntimeError):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _quick_size(p: Plan) -> int:
    """One wave of requests at the study's concurrency: enough to see a hopeless config."""
    return max(2, p.opts.concurrency or 1)


def quick_timeout(study: optuna.Study, defaults: dict) -> tuple[float | None, str]:
    """(per-request timeout of a quick measurement, what it is based on): a multiple of the defaults
    trial's quick wave, else of the first measured one's; None (the client's own) before any."""
    quick = [t for t in study.get_trials(deepcopy=False) if (t.user_attrs.get("quick") or {}).get("duration_s")
             and not (t.user_attrs["quick"].get("errors_by_kind") or {})]
    if not quick:
        return None, ""
    ref = next((t for t in quick if t.user_attrs.get("config") == defaults), quick[0])
    seconds = ref.user_attrs["quick"]["duration_s"]
    which = "defaults" if ref.user_attrs.get("config") == defaults else "first measured"
    return max(QUICK_TIMEOUT_FLOOR_S, QUICK_TIMEOUT_FACTOR * seconds), f"{which} trial {ref.number}'s {seconds:.1f} s"


def measure(p: Plan, servers: Servers, num_requests: int | None, request_timeout: float | None = None):
    """One benchmark run against the current server: (summary, per-request frame); raises
    BenchFailure when the server dies."""
    from autotune.bench import run_benchmark

    t0 = time.monotonic()
    try:
        result = run_benchmark(servers.server.base_url, p.workload, concurrency=p.opts.concurrency,
                               num_requests=num_requests, max_tokens=p.opts.max_tokens, seed=p.opts.seed,
                               server_pid=servers.server.proc.pid, progress=False,
                               **({"request_timeout": request_timeout} if request_timeout else {}))
    except Exception as e:  # noqa: BLE001 - the client raises many kinds; what matters is whether the server lives
        kind = "crash" if not servers.alive() else "bench"
        raise BenchFailure(kind, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if not servers.alive():
        raise BenchFailure("crash", f"server exited during the benchmark (see {servers.server.log_path})")
    summary = _json_ready(dict(result.summary))
    summary["duration_s"] = round(time.monotonic() - t0, 3)
    return summary, result.requests


# The server's sampling defaults where a request leaves them out (OpenAI's elsewhere).
SERVER_SAMPLING_DEFAULTS = {"embedded": {"temperature": 0.0, "top_p": 1.0}}


def save_requests(p: Plan, number: int, config: dict, frame, phase: str) -> Path:
    """studies/<name>/requests/trial-N.parquet: the benchmark's per-request rows (usage fields included:
    accept_length, spec_*, prompt_entropy) with what was asked (prompt text, temperature, top_p) and
    the trial's config, for the report and for fitting draft-length estimators."""
    from autotune.bench.workloads import prompt_text

    defaults = SERVER_SAMPLING_DEFAULTS.get(p.opts.engine, {"temperature": 1.0, "top_p": 1.0})
    asked = [p.workload.requests[i] for i in frame["index"]]
    frame = frame.assign(trial=number, phase=phase, config=json.dumps(config), prompt=[prompt_text(r) for r in asked],
                         temperature=[float(r.get("temperature", defaults["temperature"])) for r in asked],
                         top_p=[float(r.get("top_p", defaults["top_p"])) for r in asked])
    path = p.directory / "requests" / f"trial-{number}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_parquet(path, index=False)
    return path


def _json_ready(obj):
    """Optuna stores user attrs as JSON: numpy scalars and the like become plain numbers/text."""
    return json.loads(json.dumps(obj, default=lambda v: v.item() if hasattr(v, "item") else str(v)))


def summarize(study: optuna.Study, objective: str, defaults: dict):
    """(winner, the default configuration's trial, winner's gain over it) among measured trials."""
    ok = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
          if t.user_attrs.get("status") in ("ok",) or
          (t.user_attrs.get("status") == "duplicate" and t.user_attrs.get("original_status") == "ok")]
    if not ok:
        return None, None, None
    _, direction = objectives.metrics(objective)[0]
    pick = max if direction == "maximize" else min
    best = pick(ok, key=lambda t: t.values[0])
    measured = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))  # an SLO miss still has a speed
    default = next((t for t in measured if t.user_attrs.get("config") == defaults), None)
    gain = None
    if default is not None and default.values[0] and best.values[0]:
        gain = best.values[0] / default.values[0] if direction == "maximize" else default.values[0] / best.values[0]
    return best, default, gain

