"""One benchmark run end to end: warm-up, measured load, server counters and memory, per-request table, summary."""
import asyncio
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pandas as pd
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from . import server_metrics
from .client import request_body, run_load
from .load_profile import KEY_PREFIX, LoadProfile, Phase
from .metric_registry import PER_LEVEL
from .metrics import requests_frame, summarize
from .resources import ResourceSampler
from .slo import SLO, parse_slo
from .workloads import Workload, load_workload, with_api

# A warm-up wave this many times faster than the one before means one-time costs (compiling, capturing)
# were still being paid: another wave follows.
WARMUP_SPEEDUP = 1.5
# A benchmark that ranks configurations lasts at least this long: 8 requests of 48 tokens took 0.6 s on the
# H200 and read 654-875 tok/s where the same configurations run 1351 on a long load (what noise ranks), so
# its requests are multiplied (up to MAX_LOAD_FACTOR times) to fill MEASURE_S at the pace a wave showed.
MEASURE_S = 10.0
MAX_LOAD_FACTOR = 16
# Then it is repeated while its throughput's 90% interval is wider than +-TIGHT_CI of it (issue 30 point 3): on
# the 2-core CPU one sized benchmark of 8 requests landed 0.68-1.26x a long load's figure from round to round.
TIGHT_CI = 0.05
MORE_ROUNDS = 2


@dataclass
class BenchResult:
    requests: pd.DataFrame  # one row per measured request (warm-up excluded)
    summary: dict


def save_results(results: list[BenchResult], path: str | Path) -> tuple[Path, Path]:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    frame = pd.concat([r.requests.assign(run=i) for i, r in enumerate(results)], ignore_index=True)
    rows = json.loads(frame.to_json(orient="records"))  # NaN -> null
    summaries = [finite(r.summary) for r in results]
    doc = {"summary": summaries[0], "requests": rows} if len(results) == 1 else {"sweep": summaries, "requests": rows}
    path.write_text(json.dumps(doc, indent=1, default=str, allow_nan=False) + "\n")
    parquet = path.with_suffix(".parquet")
    frame.to_parquet(parquet, index=False)
    return path, parquet


def finite(summary: dict) -> dict:
    """JSON has no inf/NaN: such a number (rate=inf: all at once) is written as its text."""
    return {k: str(v) if isinstance(v, float) and not math.isfinite(v) else v for k, v in summary.items()}


def base_url(url: str) -> str:
    return url.rstrip("/").removesuffix("/v1")


def served_model(url: str, timeout: float = 5.0) -> str:
    """The first model the server lists at /v1/models; "default" where it lists none or cannot answer."""
    try:
        data = httpx.get(url + "/v1/models", timeout=timeout).json().get("data") or []
        return data[0]["id"] if data else "default"
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return "default"


def prepared(url: str, workload: Workload | str, seed: int, api: str | None, model: str | None,
             max_tokens: int | None, ignore_eos: bool, extra_body: dict | None):
    """(workload, base URL, served model, request bodies): what a benchmark and a load profile send."""
    if isinstance(workload, str):
        workload = load_workload(workload, seed)
    if api is not None:
        workload = with_api(workload, api)
    url = base_url(url)
    model = model or served_model(url)
    return workload, url, model, [request_body(r, model, max_tokens, ignore_eos, extra_body) for r in workload.requests]


def run_benchmark(url: str, workload: Workload | str, *, concurrency: int | None = None, rate: float | None = None,
                  num_requests: int | None = None, duration: float | None = None, warmup: int = 0, seed: int = 0,
                  max_tokens: int | None = None, slo: SLO | str | None = None, server_pid: int | None = None,
                  progress: bool = True, request_timeout: float = 120.0, extra_body: dict | None = None,
                  model: str | None = None, api: str | None = None, ignore_eos: bool = True) -> BenchResult:
    """Benchmark an OpenAI-compatible server; bounded by num_requests and/or duration (default: one pass).

    Closed loop at `concurrency` (default 1) unless `rate` (req/s, Poisson) is given. Raises ValueError on
    bad arguments; server failures are counted in the result, never raised.
    """
    check_arguments(concurrency, rate, num_requests, duration, warmup, max_tokens, request_timeout)
    slo = parse_slo(slo) if isinstance(slo, str) else slo
    workload, url, model, bodies = prepared(url, workload, seed, api, model, max_tokens, ignore_eos, extra_body)
    if num_requests is None and duration is None:
        num_requests = len(workload.requests)
    load = {"concurrency": concurrency, "rate": rate, "seed": seed, "request_timeout": request_timeout}

    if warmup:  # from the end of the (shuffled) list, so the measured requests start cold on their own prompts
        tail = slice(len(bodies) - min(warmup, len(bodies)), None)
        asyncio.run(run_load(url, workload.requests[tail], bodies[tail], num_requests=warmup, duration=None,
                             **{**load, "rate": None, "concurrency": concurrency or 1}))
    before = server_metrics.scrape(url)
    with progress_bar(progress, num_requests, duration) as tick, ResourceSampler(server_pid) as sampler:
        records, wall_s, stopped = asyncio.run(run_load(url, workload.requests, bodies, num_requests=num_requests,
                                                        duration=duration, on_done=tick, **load))
    after = server_metrics.scrape(url)

    frame = requests_frame(records)
    summary = {"url": url, "model": model, "workload": workload.name, "concurrency": concurrency, "rate": rate,
               "seed": seed, "warmup": warmup, "sent": len(records), "stopped_early": stopped,
               **summarize(frame, wall_s, slo), **server_metrics.acceptance(before, after),
               "peak_gpu_mem_gb": sampler.peak_gpu_mem_gb, "peak_rss_gb": sampler.peak_rss_gb}
    if summary["accept_length"] is None and summary["server_accept_length"] is not None:
        summary.update(accept_length=summary["server_accept_length"], accept_rate=summary["server_accept_rate"],
                       accept_source="metrics")
    summary["slo"] = str(slo) if slo else None
    summary["slo_violations"] = slo.check(summary) if slo else []
    summary["slo_ok"] = not summary["slo_violations"]
    return BenchResult(frame, summary)


def run_sweep(url: str, workload: Workload | str, levels: list[int], **kwargs) -> list[BenchResult]:
    """run_benchmark once per concurrency level, same workload and seed."""
    return [run_benchmark(url, workload, **{**kwargs, "concurrency": level}) for level in levels]


def check_arguments(concurrency, rate, num_requests, duration, warmup, max_tokens, request_timeout):
    problems = [f"{name} must be {rule}, not {value}" for name, value, ok, rule in [
        ("concurrency", concurrency, concurrency is None or concurrency >= 1, ">= 1"),
        ("rate", rate, rate is None or (rate > 0 and not math.isnan(rate)), "> 0 requests/s"),
        ("num_requests", num_requests, num_requests is None or num_requests >= 1, ">= 1"),
        ("duration", duration, duration is None or duration > 0, "> 0 seconds"),
        ("warmup", warmup, warmup >= 0, ">= 0"),
        ("max_tokens", max_tokens, max_tokens is None or max_tokens >= 1, ">= 1"),
        ("request_timeout", request_timeout, request_timeout > 0, "> 0 seconds")] if not ok]
    if problems:
        raise ValueError("; ".join(problems))


class progress_bar:
    """A rich bar over requests (or seconds, for a duration-bound run); a no-op callable when disabled."""

    def __init__(self, enabled: bool, num_requests: int | None, duration: float | None):
        self.enabled, self.by_time = enabled, num_requests is None
        self.total = duration if self.by_time else num_requests
        self.done, self.t0 = 0, time.perf_counter()

    def __enter__(self):
        if self.enabled:
            self.bar = Progress(TextColumn("bench"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[errors]} errors"), TimeElapsedColumn(), transient=True)
            self.task = self.bar.add_task("bench", total=self.total, errors=0)
            self.bar.start()
        self.errors = 0
        return self.tick

    def tick(self, rec):
        self.done += 1
        self.errors += rec.error_kind is not None
        if self.enabled:
            done = min(self.total, round(time.perf_counter() - self.t0)) if self.by_time else self.done
            self.bar.update(self.task, completed=done, errors=self.errors)

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.stop()


def summary_table(results: list[BenchResult]) -> Table:
    """The short table printed at the end: one column per run."""
    table = Table(title="autotune bench", show_header=len(results) > 1)
    table.add_column("metric")
    for r in results:
        s = r.summary
        label = " ".join(([f"c={s['concurrency']}"] if s["concurrency"] else []) +
                         ([f"rate={s['rate']:g}"] if s["rate"] is not None else [])) or "c=1"
        table.add_column(label, justify="right")
    rows = [("completed / failed", lambda s: f"{s['completed']} / {s['failed']}"),
            ("errors", lambda s: ", ".join(f"{k}={v}" for k, v in s["errors_by_kind"].items()) or "-"),
            ("output tok/s", lambda s: fmt(s["output_tok_s"])),
            ("decode tok/s p50 (mean)", lambda s: f"{fmt(s['decode_tok_s_p50'])} ({fmt(s['decode_tok_s_mean'])})"),
            ("request/s", lambda s: fmt(s["request_throughput"], 3)),
            ("TTFT ms p50 / p99", lambda s: f"{fmt(s['ttft_ms_p50'])} / {fmt(s['ttft_ms_p99'])}"),
            ("ITL ms p50 / p99", lambda s: f"{fmt(s['itl_ms_p50'])} / {fmt(s['itl_ms_p99'])} per {s['itl_basis']}"),
            ("TPOT ms p50 / p99", lambda s: f"{fmt(s['tpot_ms_p50'])} / {fmt(s['tpot_ms_p99'])}"),
            ("E2E ms p50 / p99", lambda s: f"{fmt(s['e2e_ms_p50'])} / {fmt(s['e2e_ms_p99'])}"),
            ("accept length (rate)", lambda s: f"{fmt(s['accept_length'], 2)} ({fmt(s['accept_rate'], 2)})"),
            ("prompt / output tokens mean", lambda s: f"{fmt(s['prompt_tokens_mean'])} / {fmt(s['output_tokens_mean'])}"),
            ("peak GPU mem / RSS GiB", lambda s: f"{fmt(s['peak_gpu_mem_gb'], 2)} / {fmt(s['peak_rss_gb'], 2)}"),
            ("goodput req/s", lambda s: fmt(s["goodput"], 3)),
            ("SLO", lambda s: "-" if not s["slo"] else ("met" if s["slo_ok"] else "; ".join(s["slo_violations"])))]
    for name, cell in rows:
        table.add_row(name, *(cell(r.summary) for r in results))
    stopped = [r.summary["stopped_early"] for r in results if r.summary["stopped_early"]]
    if stopped:
        table.caption = f"stopped early: {stopped[0]}"
    return table


def fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def json_ready(obj):
    """Plain JSON data (numpy scalars and the like become numbers/text): what Optuna attrs and files take."""
    return json.loads(json.dumps(obj, default=lambda v: v.item() if hasattr(v, "item") else str(v)))


def measure_server(server, workload: Workload, *, concurrency: int | None, num_requests: int | None,
                   max_tokens: int | None, seed: int = 0, request_timeout: float | None = None):
    """One benchmark of a running engine server (an engines.launcher.Launcher): (summary as plain JSON
    data with its wall time `duration_s`, per-request frame). What a trial, validation and ci measure with."""
    t0 = time.monotonic()
    result = run_benchmark(server.base_url, workload, concurrency=concurrency, num_requests=num_requests,
                           max_tokens=max_tokens, seed=seed, server_pid=server.proc.pid, progress=False,
                           **({"request_timeout": request_timeout} if request_timeout else {}))
    summary = json_ready(dict(result.summary))
    summary["load_s"] = summary["duration_s"]  # the load's own wall time: what the rates divide by
    summary["duration_s"] = round(time.monotonic() - t0, 3)
    return summary, result.requests


def tightened(measure_once, summary: dict, requests: pd.DataFrame, room=lambda last_s: True) -> tuple[dict, pd.DataFrame]:
    """A benchmark (`measure_once()` -> (summary, requests), as measure_server gives) repeated at most MORE_ROUNDS
    times while its throughput's interval is wider than TIGHT_CI and `room(seconds of the last round)` allows:
    the pooled summary (rates over the rounds' summed load time; the first round's server counters kept), with
    `rounds`, and the pooled requests. Under 3 requests the noise is unknown: not tight."""
    def wide(summary: dict) -> bool:
        ci = summary.get("output_tok_s_ci")
        return bool(summary.get("completed")) and (ci is None or ci > TIGHT_CI)

    rounds, last_s = 1, summary["duration_s"]
    while rounds <= MORE_ROUNDS and wide(summary) and room(last_s):
        more, more_requests = measure_once()
        rounds, last_s = rounds + 1, more["duration_s"]
        requests = pd.concat([requests, more_requests], ignore_index=True)
        load_s = summary["load_s"] + more["load_s"]
        summary = {**summary, **json_ready(summarize(requests, load_s)), "load_s": load_s,
                   "duration_s": summary["duration_s"] + more["duration_s"]}
    return {**summary, "rounds": rounds}, requests


def sized_load(num_requests: int, wave_s: float | None, wave_requests: int, concurrency: int,
               min_s: float = MEASURE_S) -> int:
    """Requests a benchmark at `concurrency` needs to last `min_s` at the pace of a wave of `wave_requests` that
    took `wave_s` (a wave no wider than the concurrency ran side by side: it took one request's time, and the
    benchmark keeps `concurrency` in flight): at least `num_requests`, at most MAX_LOAD_FACTOR times that."""
    if not wave_s or wave_s <= 0:
        return num_requests
    needed = math.ceil(min_s * max(wave_requests, concurrency) / wave_s)
    return int(min(max(num_requests, needed), num_requests * MAX_LOAD_FACTOR))


def warm_up(server, workload: Workload, *, concurrency: int | None, max_tokens: int | None, seed: int = 0,
            request_timeout: float = 300.0, steady_s: float | None = None) -> dict:
    """Waves of the load's requests at its concurrency, before anything is measured: torch.compile and
    CUDA-graph capture run at the first forward passes of each shape, so they are launch cost, never speed.
    Waves go on while they get markedly faster (what is left is one-time cost), until one takes at most
    `steady_s` or the warm-up has taken `request_timeout`. Each wave takes other prompts from the end of
    the (shuffled) list, so the measured ones still start on their own. {warmup_s, waves, sent, errors_by_kind}."""
    if isinstance(workload, str):
        workload = load_workload(workload, seed)
    n, url = max(1, concurrency or 1), base_url(server.base_url)
    model = served_model(url)
    t0, waves, errors, sent = time.monotonic(), [], {}, 0
    while True:
        picked = [workload.requests[-1 - (len(waves) * n + i) % len(workload.requests)] for i in range(n)]
        bodies = [request_body(r, model, max_tokens, True, None) for r in picked]
        left = request_timeout - (time.monotonic() - t0)
        records, wave_s, _ = asyncio.run(run_load(url, picked, bodies, concurrency=n, rate=None, num_requests=n,
                                                  duration=None, seed=seed, request_timeout=max(left, 1.0)))
        waves.append(round(wave_s, 3))
        sent += len(records)
        for rec in records:
            if rec.error_kind is not None:
                errors[rec.error_kind] = errors.get(rec.error_kind, 0) + 1
        settled = len(waves) >= 2 and wave_s > waves[-2] / WARMUP_SPEEDUP
        if errors or settled or (steady_s is not None and wave_s <= steady_s) or time.monotonic() - t0 >= request_timeout:
            break
    return {"warmup_s": round(time.monotonic() - t0, 3), "waves": waves, "sent": sent, "errors_by_kind": errors}


# -- a load that changes: phases run back to back (bench/load_profile.py) ---------------------------------


@dataclass
class PhaseResult:
    phase: Phase
    summary: dict  # summarize() over its requests and wall time, with the server's acceptance over it


@dataclass
class ProfileResult:
    requests: pd.DataFrame  # every measured request; `load_phase` its phase's index, `load_level` its label
    summary: dict  # overall (pooled tokens / pooled wall time), the per-phase summaries under "phases",
    #                per-level values flat (KEY_PREFIX + level + metric)
    phases: list[PhaseResult]


def run_profile(url: str, workload: Workload | str, profile: LoadProfile, *, warmup: int = 0, seed: int = 0,
                max_tokens: int | None = None, slo: SLO | str | None = None, server_pid: int | None = None,
                progress: bool = True, request_timeout: float = 120.0, extra_body: dict | None = None,
                model: str | None = None, api: str | None = None, ignore_eos: bool = True) -> ProfileResult:
    """Benchmark a server under `profile`: its phases back to back, each drained (its requests finish)
    before the next starts, so a phase's requests, time and server counters are its own. Requests cycle
    through the workload across phases. Overall throughput = tokens of all phases / the sum of their wall times."""
    check_arguments(None, None, None, None, warmup, max_tokens, request_timeout)
    slo = parse_slo(slo) if isinstance(slo, str) else slo
    workload, url, model, bodies = prepared(url, workload, seed, api, model, max_tokens, ignore_eos, extra_body)
    if warmup:  # as run_benchmark: from the end of the list, at the first phase's load
        first = profile.phases[0]
        tail = slice(len(bodies) - min(warmup, len(bodies)), None)
        asyncio.run(run_load(url, workload.requests[tail], bodies[tail], concurrency=first.concurrency or 1,
                             rate=None, num_requests=warmup, duration=None, seed=seed, request_timeout=request_timeout))
    phases, frames, sent, stopped, t0 = [], [], 0, None, time.perf_counter()
    first_scrape = last_scrape = server_metrics.scrape(url)
    with ResourceSampler(server_pid) as sampler:
        for number, phase in enumerate(profile.phases):
            order = [(sent + k) % len(bodies) for k in range(len(bodies))]  # carry on where the last phase stopped
            offset_s = time.perf_counter() - t0
            with progress_bar(progress, phase.requests, phase.duration_s) as tick:
                records, wall_s, stopped = asyncio.run(run_load(
                    url, [workload.requests[k] for k in order], [bodies[k] for k in order],
                    concurrency=phase.concurrency, rate=phase.rate, num_requests=phase.requests,
                    duration=phase.duration_s, seed=seed + number, request_timeout=request_timeout, on_done=tick))
            before, last_scrape = last_scrape, server_metrics.scrape(url)
            for rec in records:  # workload positions, and send times on the profile's clock
                rec.index, rec.start_s = order[rec.index], rec.start_s + offset_s
            sent += len(records)
            frame = requests_frame(records).assign(load_phase=number, load_level=phase.label)
            frames.append(frame)
            summary = {"phase": number, "load": str(phase), "level": phase.label, "concurrency": phase.concurrency,
                       "rate": phase.rate, "sent": len(records), "stopped_early": stopped,
                       **summarize(frame, wall_s, slo), **server_metrics.acceptance(before, last_scrape)}
            phases.append(PhaseResult(phase, with_server_acceptance(summary)))
            if stopped:  # the server is gone: later phases would only count connection errors
                break
    frame = pd.concat(frames, ignore_index=True)
    wall_s = sum(p.summary["duration_s"] for p in phases)
    summary = {"url": url, "model": model, "workload": workload.name, "load_profile": str(profile),
               "concurrency": max(profile.concurrencies(), default=None), "rate": None, "seed": seed,
               "warmup": warmup, "sent": sent, "stopped_early": stopped, **summarize(frame, wall_s, slo),
               **server_metrics.acceptance(first_scrape, last_scrape),
               "peak_gpu_mem_gb": sampler.peak_gpu_mem_gb, "peak_rss_gb": sampler.peak_rss_gb}
    summary = with_server_acceptance(summary)
    summary["slo"] = str(slo) if slo else None
    summary["slo_violations"] = slo.check(summary) if slo else []
    summary["slo_ok"] = not summary["slo_violations"]
    summary["phases"] = [p.summary for p in phases]
    summary.update(level_metrics(phases, frame, slo))
    return ProfileResult(frame, summary, phases)


def with_server_acceptance(summary: dict) -> dict:
    """The server's accept length where the responses carried none (as run_benchmark does)."""
    if summary["accept_length"] is None and summary["server_accept_length"] is not None:
        summary.update(accept_length=summary["server_accept_length"], accept_rate=summary["server_accept_rate"],
                       accept_source="metrics")
    return summary


def level_metrics(phases: list[PhaseResult], frame: pd.DataFrame, slo: SLO | None) -> dict:
    """PER_LEVEL metrics per load level (phases of one level pooled: their tokens over their summed wall time),
    flat: {"phase_c4_output_tok_s": ..., ...}. Pooled accept length = tokens / verify steps of its phases."""
    flat = {}
    for level in dict.fromkeys(p.phase.label for p in phases):
        mine = [p.summary for p in phases if p.phase.label == level]
        pooled = summarize(frame[frame["load_level"] == level], sum(s["duration_s"] for s in mine), slo)
        measured = [s for s in mine if s["accept_length"] and s["total_output_tokens"]]
        steps = sum(s["total_output_tokens"] / s["accept_length"] for s in measured)
        pooled["accept_length"] = sum(s["total_output_tokens"] for s in measured) / steps if steps else None
        flat.update({f"{KEY_PREFIX}{level}_{name}": pooled[name] for name in PER_LEVEL})
    return flat


def phase_table(result: ProfileResult) -> Table:
    """One row per phase, as `autotune bench --load-profile` prints it."""
    table = Table(title=f"autotune bench: load profile {result.summary['load_profile']}")
    for column in ("phase", "load", "completed / failed", "wall s", "output tok/s", "TTFT ms p50 / p99",
                   "ITL ms p50 / p99", "accept length"):
        table.add_column(column, justify="left" if column in ("phase", "load") else "right")
    for p in result.phases:
        s = p.summary
        table.add_row(str(s["phase"]), s["load"], f"{s['completed']} / {s['failed']}", fmt(s["duration_s"]),
                      fmt(s["output_tok_s"]), f"{fmt(s['ttft_ms_p50'])} / {fmt(s['ttft_ms_p99'])}",
                      f"{fmt(s['itl_ms_p50'])} / {fmt(s['itl_ms_p99'])}", fmt(s["accept_length"], 2))
    if result.summary["stopped_early"]:
        table.caption = f"stopped early: {result.summary['stopped_early']}"
    return table


def overall_line(summary: dict) -> str:
    return (f"overall: {summary['total_output_tokens']} tokens in {fmt(summary['duration_s'])} s of phases = "
            f"{fmt(summary['output_tok_s'])} output tok/s; {summary['completed']} completed, {summary['failed']} "
            f"failed; accept length {fmt(summary['accept_length'], 2)}")


def measure_server_profile(server, workload: Workload, profile: LoadProfile, *, max_tokens: int | None,
                           seed: int = 0, request_timeout: float | None = None):
    """measure_server under a load profile: (summary as plain JSON data, per-request frame)."""
    t0 = time.monotonic()
    result = run_profile(server.base_url, workload, profile, max_tokens=max_tokens, seed=seed,
                         server_pid=server.proc.pid, progress=False,
                         **({"request_timeout": request_timeout} if request_timeout else {}))
    summary = json_ready(dict(result.summary))
    summary["profile_s"] = round(time.monotonic() - t0, 3)
    return summary, result.requests


def warm_up_profile(server, workload: Workload, profile: LoadProfile, **kwargs) -> dict:
    """warm_up at each closed-loop level of the profile, lowest first (each batch size compiles and captures
    its own shapes), merged into one record."""
    merged = {"warmup_s": 0.0, "waves": [], "sent": 0, "errors_by_kind": {}}
    for level in profile.concurrencies() or [1]:
        warm = warm_up(server, workload, concurrency=level, **kwargs)
        merged["warmup_s"] = round(merged["warmup_s"] + warm["warmup_s"], 3)
        merged["waves"] += warm["waves"]
        merged["sent"] += warm["sent"]
        for kind, count in warm["errors_by_kind"].items():
            merged["errors_by_kind"][kind] = merged["errors_by_kind"].get(kind, 0) + count
        if warm["errors_by_kind"]:
            break
    return merged
