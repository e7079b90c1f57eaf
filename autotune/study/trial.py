"""One trial's life, from suggestion to tell.

Suggest a config -> engine rules, hardware conditions, memory fit (rejected before any launch) ->
dedupe by the engine's effective settings (a duplicate reuses the recorded result) -> reuse the
running server when only runtime parameters changed, else launch -> warm-up (compile, graph capture:
launch cost, never pruned for) -> quick measurement (pruned if hopeless) -> full benchmark (repeated while
its throughput's interval is wide) -> SLO -> record everything (record.TrialRecord) -> tell Optuna.

How outcomes reach the sampler. Optuna's TPE ignores FAIL trials, so a crash recorded as FAIL
would be proposed again and again. Every failure is therefore told as PRUNED with a positive
`feasible` constraint (Optuna 5's `trial.set_constraint`): TPE ranks infeasible trials below every
feasible one and samples away from them. An SLO miss is a COMPLETE trial with its measured values
and a positive `slo` constraint.
"""
from __future__ import annotations

import functools
import json
import threading
import time
from pathlib import Path

import optuna
from optuna.trial import TrialState

from autotune import predict
from autotune.bench import server_metrics
from autotune.bench.load_profile import KEY_PREFIX
from autotune.bench.metric_registry import HEADLINE
from autotune.bench.runner import (
    measure_server,
    measure_server_profile,
    sized_load,
    tightened,
    warm_up,
    warm_up_profile,
)
from autotune.bench.workloads import prompt_text
from autotune.engines.launcher import LaunchError, launch
from autotune.space import constraints
from autotune.study import objectives, record
from autotune.study.live import LiveView
from autotune.study.parallel import wait_for_twins
from autotune.study.plan import Plan

# A quick measurement (after the warm-up) may take this many times the defaults trial's quick wave before
# its requests time out and the trial is pruned: a hopeless configuration costs seconds, not the client's
# 2 minutes.
QUICK_TIMEOUT_FACTOR = 3.0
QUICK_TIMEOUT_FLOOR_S = 10.0
# The full benchmark's deadline: this many times what the quick wave's pace predicts for it. An engine that
# hangs mid-benchmark (alive, answering nothing) is killed there and the trial fails with failure_kind
# "timeout", instead of every request waiting out the client's 2 minutes in turn.
BENCH_DEADLINE_FACTOR = 3.0
BENCH_DEADLINE_FLOOR_S = 30.0


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
        self.runtime_names = p.space.runtime_names() & set(p.adapter.facts.runtime_params)

    def launch_part(self, config: dict) -> dict:
        return self.p.adapter.facts.split_runtime(config, self.runtime_names)[0]

    def alive(self) -> bool:
        return self.server is not None and self.server.alive()

    def ensure(self, config: dict, log: Path, timeout_s: float) -> tuple[str, dict]:
        """Bring up a server running `config` within timeout_s; returns (how: launched|reused, launch record)."""
        adapter = self.p.adapter
        if self.alive() and self.launch_part(config) == self.launch_config:
            runtime = adapter.facts.split_runtime(config, self.runtime_names)[1]
            try:
                adapter.apply_runtime(self.server.base_url, runtime)
                self.saved += 1
                return "reused", {"argv": self.server.argv, "log": str(self.server.log_path), "runtime": runtime}
            except Exception:  # noqa: BLE001 - a server that will not take the change is relaunched with it
                pass
        self.stop()
        port = self.slot.port() if self.slot else None
        placement = self.slot.acquire(config) if self.slot else {}  # waits for free GPUs
        self.launches += 1
        self.server = launch(adapter, config, model=self.p.opts.model, draft_model=self.p.opts.draft_model,
                             env=placement, log_path=log, timeout_s=timeout_s, port=port)
        self.launch_config = self.launch_part(config)
        env = {k: v for k, v in self.server.env.items() if k not in placement}
        return "launched", {"argv": self.server.argv, "env": env, "log": str(log),
                            **({"placement": placement} if placement else {})}

    def stop(self):
        if self.server is not None:
            self.server.stop()
        if self.slot:
            self.slot.release()
        self.server, self.launch_config = None, None


class Cutoff:
    """The run's search deadline (time.time()) inside a trial: there the trial's server is killed, which ends
    whatever it was doing (launching, warming up, measuring), and the trial is told as cut by the budget."""

    def __init__(self, servers: Servers, deadline: float | None):
        self.servers, self.deadline, self.hit = servers, deadline, threading.Event()
        self.timer = None

    def __enter__(self):
        if self.deadline is not None:
            self.timer = threading.Timer(max(0.0, self.deadline - time.time()), self.expire)
            self.timer.daemon = True
            self.timer.start()
        return self

    def expire(self):
        self.hit.set()
        if self.servers.server is not None:
            self.servers.server.kill()

    def __exit__(self, *exc):
        if self.timer:
            self.timer.cancel()

    def timeout(self, seconds: float) -> float:
        """A wait bounded by the deadline as well."""
        return seconds if self.deadline is None else max(1.0, min(seconds, self.deadline - time.time()))

    def passed(self) -> bool:
        return self.hit.is_set() or (self.deadline is not None and time.time() >= self.deadline)


def run_trial(study: optuna.Study, trial: optuna.Trial, p: Plan, servers: Servers, view: LiveView,
              deadline: float | None = None):
    """One trial from suggestion to tell, cut at `deadline` (time.time()); returns its frozen record."""
    with Cutoff(servers, deadline) as cut:
        return _run_trial(study, trial, p, servers, view, cut)


def _run_trial(study: optuna.Study, trial: optuna.Trial, p: Plan, servers: Servers, view: LiveView, cut: Cutoff):
    opts, t_start = p.opts, time.monotonic()
    config = p.space.suggest(trial)
    attrs: record.TrialRecord = {"config": config}
    view.started(trial.number, config)

    def finish(state, values=None, constraint: str | None = None, amount: float = 1.0, **more):
        attrs.update(more)
        if state != TrialState.COMPLETE and attrs.get("launch") and cut.passed():  # not the configuration's fault
            state, constraint = TrialState.FAIL, None
            attrs.update(status=record.BUDGET, measured=False, failure_kind="budget",
                         failure=f"cut at the run's budget (--budget) after {time.monotonic() - t_start:.0f} s: "
                                 f"{attrs.get('failure', 'no result yet')}")
        attrs["timings"] = {**attrs.get("timings", {}), "total_s": round(time.monotonic() - t_start, 3)}
        flat = {k: v for k, v in (attrs.get("metrics") or {}).items()
                if (k in HEADLINE or k.startswith(KEY_PREFIX)) and v is not None}
        for k, v in record.json_ready({**attrs, **flat}).items():
            trial.set_user_attr(k, v)
        if constraint:
            trial.set_constraint(constraint, amount)
        study.tell(trial, values, state=state)
        return study.get_trials(deepcopy=False)[trial.number]

    # 1. rules, hardware, memory: rejected before any launch, with the reason and numbers.
    violations = [f"rule: {v}" for v in p.adapter.check(config, p.hardware, has_draft_model=bool(opts.draft_model))]
    violations += [f"hardware: {v}" for v in constraints.hardware_violations(config, p.hardware, p.shape, adapter=p.adapter)]
    fit = predict.estimate_memory(config, p.hardware, p.model, p.draft, engine=p.adapter)
    attrs["memory"] = fit.record()
    if not fit.fits:
        violations.append(f"memory: {fit.reason}")
    if violations:
        kind = violations[0].split(":")[0]
        return finish(TrialState.PRUNED, constraint="feasible", status=record.REJECTED, failure_kind=kind,
                      failure="; ".join(violations), violations=violations)

    # 2. dedupe: the engine would run exactly what an earlier trial ran.
    effective = p.adapter.effective(config)
    key = record.effective_key(p.adapter, config)
    attrs.update(effective=effective, effective_key=key)
    trial.set_user_attr("effective_key", key)  # seen by runners sharing the study: a twin waits for this result
    wait_for_twins(study, trial, key, servers)
    for earlier in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
        if earlier.user_attrs.get("effective_key") == key and earlier.user_attrs.get("status") != record.DUPLICATE:
            copied = {k: v for k, v in earlier.user_attrs.items() if k not in ("config", "seed_config", "measured", "timings")}
            attrs.update(copied)
            for name, amount in earlier.constraints.items():
                trial.set_constraint(name, amount)
            return finish(earlier.state, earlier.values if earlier.state == TrialState.COMPLETE else None,
                          status=record.DUPLICATE, duplicate_of=earlier.number, original_status=earlier.user_attrs.get("status"))

    # 3. launch, or reuse the running server when only runtime parameters differ.
    log = p.directory / "logs" / f"trial-{trial.number}.log"
    view.phase(trial.number, "launching")
    t0 = time.monotonic()
    try:
        how, launch = servers.ensure(config, log, cut.timeout(opts.launch_timeout_s))
    except LaunchError as e:
        servers.stop()
        return finish(TrialState.PRUNED, constraint="feasible", status=record.FAILED, failure_kind=e.kind,
                      failure=e.message, log_tail=(e.log_tail or "")[-2000:],
                      log=str(log), launch="launched", timings={"launch_s": round(time.monotonic() - t0, 3)},
                      measured=True, argv=e.argv)
    attrs.update(launch=how, argv=launch["argv"], log=launch["log"], measured=True,
                 timings={"launch_s": round(time.monotonic() - t0, 3)})
    if "env" in launch:
        attrs["env"] = launch["env"]
    if "placement" in launch:
        attrs["placement"] = launch["placement"]
    gauge = p.adapter.facts.startup_compile_gauge
    if how == "launched" and gauge:  # the part of this launch a relaunch's compile cache saves (the budget's prices)
        compiled = (server_metrics.scrape(servers.server.base_url) or {}).get(gauge)
        if compiled is not None:
            attrs["timings"]["compile_s"] = round(compiled, 3)

    # 4. warm-up: compiling and capturing CUDA graphs happen at the first requests of each shape. They
    # are launch cost (in the trial's time, so the budget weighs them) and bounded by the launch timeout,
    # never by the quick timeout below: waves until one is within it, or they stop getting faster.
    timeout, reference = quick_timeout(study, defaults=p.space.defaults())
    view.phase(trial.number, "warming up")
    try:
        load = {"max_tokens": opts.max_tokens, "seed": opts.seed, "request_timeout": opts.launch_timeout_s,
                "steady_s": timeout}
        warm = (warm_up_profile(servers.server, p.workload, p.load_profile, **load) if p.load_profile else
                warm_up(servers.server, p.workload, concurrency=opts.concurrency, **load))
    except Exception as e:  # noqa: BLE001 - the client raises many kinds; what matters is whether the server lives
        kind = "crash" if not servers.alive() else "bench"
        servers.stop()
        return finish(TrialState.PRUNED, constraint="feasible", status=record.FAILED, failure_kind=kind,
                      failure=f"warm-up: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    attrs["warmup_s"] = attrs["timings"]["warmup_s"] = warm["warmup_s"]
    attrs["warmup_waves_s"] = warm["waves"]
    timed_out = warm["errors_by_kind"].get("timeout")
    if timed_out or not servers.alive():
        kind = "timeout" if servers.alive() else "crash"
        why = (f"{timed_out} of {warm['sent']} requests took over the launch timeout ({opts.launch_timeout_s:g} s)"
               if kind == "timeout" else f"server exited during the warm-up (see {log})")
        servers.stop()
        return finish(TrialState.PRUNED, constraint="feasible", status=record.FAILED, failure_kind=kind,
                      failure=f"warm-up: {why}")

    # 5. quick first measurement, then the full benchmark.
    try:
        quick_n = opts.quick_requests or _quick_size(p)
        quick, requests = measure(p, servers, quick_n, request_timeout=timeout)
        attrs["quick"] = quick
        attrs["timings"]["quick_s"] = quick.get("duration_s")
        timed_out = (quick.get("errors_by_kind") or {}).get("timeout")
        if timed_out:
            servers.stop()  # it is still working on the abandoned requests
            save_requests(p, trial.number, config, requests, "quick")
            return finish(TrialState.PRUNED, constraint="feasible", status=record.PRUNED, failure_kind="timeout",
                          failure=f"quick measurement: {timed_out} of {quick.get('sent')} requests took over "
                                  + (f"{timeout:.0f} s ({QUICK_TIMEOUT_FACTOR:g}x the {reference})" if timeout else
                                     "the client's request timeout (no trial measured before: no reference)"))
        first = objectives.values(quick, opts.objective)
        if first is not None and len(study.directions) == 1:
            trial.report(first[0], step=0)
            if trial.should_prune():
                save_requests(p, trial.number, config, requests, "quick")
                return finish(TrialState.PRUNED, status=record.PRUNED,
                              failure=f"quick measurement {first[0]:.4g} in the bottom quarter of trials so far")
        view.phase(trial.number, "benchmarking")
        if p.load_profile:  # the profile's phases set the load and its length; the objective is pooled over them
            attrs["timings"]["bench_deadline_s"] = deadline = max(BENCH_DEADLINE_FLOOR_S, BENCH_DEADLINE_FACTOR
                                                                  * p.load_profile.expected_s(quick["duration_s"],
                                                                                              opts.concurrency or 1))
            summary, requests = measure(p, servers, None, deadline_s=deadline)
        else:
            asked = opts.num_requests or len(p.workload.requests)  # what run_benchmark sends when not told
            attrs["timings"]["bench_requests"] = n = sized_load(asked, quick.get("duration_s"), quick_n,
                                                                opts.concurrency or 1, opts.min_measure_s)
            attrs["timings"]["bench_deadline_s"] = deadline = bench_deadline(quick, quick_n, n)
            once = functools.partial(measure, p, servers, n, deadline_s=deadline)
            summary, requests = once()
            if opts.min_measure_s:  # as long as its noise needs; 0: exactly the requests asked
                summary, requests = tightened(  # while two more rounds fit before the search deadline
                    once, summary, requests,
                    room=lambda last_s: cut.deadline is None or cut.deadline - time.time() > 2 * last_s)
                attrs["timings"]["bench_rounds"] = summary["rounds"]
    except BenchFailure as e:
        servers.stop()
        return finish(TrialState.PRUNED, constraint="feasible", status=record.FAILED, failure_kind=e.kind, failure=str(e))
    attrs["requests_file"] = str(save_requests(p, trial.number, config, requests, "full"))
    attrs["metrics"] = summary
    attrs["timings"]["bench_s"] = summary.get("duration_s")
    values = objectives.values(summary, opts.objective)
    if values is None or not summary.get("completed"):
        return finish(TrialState.PRUNED, constraint="feasible", status=record.FAILED, failure_kind="errors",
                      failure=f"no request completed ({summary.get('errors_by_kind') or 'no metrics'})")

    # 6. SLO and errors: measured, but infeasible.
    misses = p.slo.check(summary) if p.slo else []
    if summary.get("error_rate"):
        misses.append(f"error_rate {summary['error_rate']:.3g} > 0 ({summary.get('errors_by_kind')})")
    if misses:
        return finish(TrialState.COMPLETE, values, constraint="slo", amount=float(len(misses)),
                      status=record.INFEASIBLE, failure_kind="slo", failure="; ".join(misses))
    trial.set_constraint("slo", 0.0)
    return finish(TrialState.COMPLETE, values, status=record.OK)


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


def bench_deadline(quick: dict, quick_n: int, full_n: int) -> float:
    """Seconds the full benchmark may take: BENCH_DEADLINE_FACTOR x the quick wave's time per request x its size."""
    return max(BENCH_DEADLINE_FLOOR_S, BENCH_DEADLINE_FACTOR * quick["duration_s"] * full_n / quick_n)


def measure(p: Plan, servers: Servers, num_requests: int | None, request_timeout: float | None = None,
            deadline_s: float | None = None):
    """One benchmark run against the current server (under p.load_profile when num_requests is None and
    the plan has one): (summary, per-request frame); raises
    BenchFailure when the server dies, or ("timeout") when it is still running at deadline_s: then the
    server's process group is killed, which ends every request in flight (a stopped engine included)."""
    expired = threading.Event()

    def expire():
        expired.set()
        servers.server.kill()

    watchdog = threading.Timer(deadline_s, expire) if deadline_s else None
    if watchdog:
        watchdog.daemon = True
        watchdog.start()
    failure = None
    try:
        if num_requests is None and p.load_profile:
            summary, requests = measure_server_profile(servers.server, p.workload, p.load_profile,
                                                       max_tokens=p.opts.max_tokens, seed=p.opts.seed,
                                                       request_timeout=request_timeout)
        else:
            summary, requests = measure_server(servers.server, p.workload, concurrency=p.opts.concurrency,
                                               num_requests=num_requests, max_tokens=p.opts.max_tokens,
                                               seed=p.opts.seed, request_timeout=request_timeout)
    except Exception as e:  # noqa: BLE001 - the client raises many kinds; what matters is whether the server lives
        kind = "crash" if not servers.alive() else "bench"
        failure = BenchFailure(kind, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    finally:
        if watchdog:
            watchdog.cancel()
    if expired.is_set():
        raise BenchFailure("timeout", f"benchmark still running at its deadline, {deadline_s:.0f} s "
                           f"({BENCH_DEADLINE_FACTOR:g}x what the quick wave predicts): the engine's process group "
                           f"was killed (see {servers.server.log_path})")
    if failure:
        raise failure
    if not servers.alive():
        raise BenchFailure("crash", f"server exited during the benchmark (see {servers.server.log_path})")
    return summary, requests


def save_requests(p: Plan, number: int, config: dict, frame, phase: str) -> Path:
    """studies/<name>/requests/trial-N.parquet: the benchmark's per-request rows (usage fields included:
    accept_length, spec_*, prompt_entropy) with what was asked (prompt text, temperature, top_p) and
    the trial's config, for the report and for fitting draft-length estimators."""
    defaults = p.adapter.facts.sampling_defaults  # what the server uses where a request leaves them out
    asked = [p.workload.requests[i] for i in frame["index"]]
    frame = frame.assign(trial=number, phase=phase, config=json.dumps(config), prompt=[prompt_text(r) for r in asked],
                         temperature=[float(r.get("temperature", defaults["temperature"])) for r in asked],
                         top_p=[float(r.get("top_p", defaults["top_p"])) for r in asked])
    path = p.directory / "requests" / f"trial-{number}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_parquet(path, index=False)
    return path
