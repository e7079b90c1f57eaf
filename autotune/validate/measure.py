"""Measuring a configuration: a fresh launch, a warm-up (compiling and graph capture are launch cost), its
greedy outputs on its first launch, and N benchmarks of the study's load. Configurations that differ only
in runtime settings (the draft length) share a launch and are measured in alternation, as the study's
trials share a server (on a GPU a launch compiles for a minute).

A record is the working dict of one configuration: label, config, runs, request_files, launches, and
what its launches add (argv, env, log, failure: a Reason, stats).
"""
from __future__ import annotations

import time
from pathlib import Path

import httpx

from autotune.bench.metric_registry import HEADLINE
from autotune.bench.runner import measure_server, sized_load, warm_up
from autotune.engines.launcher import LaunchError, launch
from autotune.study.record import effective_key
from autotune.study.storage import StudyContext
from autotune.validate.quality import greedy_outputs
from autotune.validate.record import Reason
from autotune.validate.statistics import spread


def new_record(label: str, config: dict) -> dict:
    return {"label": label, "config": config, "runs": [], "request_files": [], "launches": []}


def launch_groups(ctx: StudyContext, recs: list[dict]) -> list[list[dict]]:
    """`recs` grouped by what a running server cannot change: configurations that differ only in runtime
    settings (the draft length, say) share one launch, as the study's trials share a server."""
    groups: dict = {}
    for rec in recs:
        key = effective_key(ctx.adapter, ctx.adapter.facts.split_runtime(rec["config"])[0])
        groups.setdefault(key, []).append(rec)
    return list(groups.values())


def benchmark(server, recs: list[dict], *, repeats: int, workload, load: dict, num_requests: int | None, log: Path,
              tables: Path | None = None, use=lambda rec: None, tick=lambda: None) -> None:
    """`repeats` benchmarks of each record on the running server, in alternation (the order flips every
    repeat), each summary added to its record's runs (and its per-request table under `tables`, if given;
    `use` puts a record's runtime settings on the server first). A server that exits fails every record
    (server_exited) and ends the benchmarks."""
    for repeat in range(repeats):
        for rec in (recs if repeat % 2 == 0 else recs[::-1]):
            use(rec)
            r = len(rec["runs"])
            summary, requests = measure_server(server, workload, concurrency=load["concurrency"],
                                               num_requests=num_requests, max_tokens=load["max_tokens"],
                                               seed=load["seed"])
            if tables is not None:
                path = tables / f"{rec['label']}-repeat-{r}.parquet"
                requests.assign(repeat=r).to_parquet(path, index=False)
                rec["request_files"].append(str(path))
            rec["runs"].append(summary)
            tick()
            if not server.alive():
                for failed in recs:
                    failed["failure"] = Reason(kind="server_exited", text=f"server exited during repeat {r} (see {log})")
                return


def measure(ctx: StudyContext, recs: list[dict], *, repeats: int, prompts: list[dict], quality_tokens: int,
            workload, launch_timeout_s: float, tick=lambda: None) -> None:
    """One fresh launch shared by `recs` (one launch group), its warm-up, each record's greedy outputs (on
    its first launch) and `repeats` benchmarks of each, in alternation (the order flips every repeat), added
    to the records: a later call is one more launch of them."""
    def use(server, rec):  # the record's runtime settings on the shared server
        runtime = ctx.adapter.facts.split_runtime(rec["config"])[1]
        if len(recs) > 1 and runtime:
            ctx.adapter.apply_runtime(server.base_url, runtime)

    n = len(recs[0]["launches"])
    label = "+".join(rec["label"] for rec in recs)
    log = ctx.directory / "validation" / "logs" / (f"{label}.log" if n == 0 else f"{label}-launch-{n}.log")
    t0 = time.monotonic()
    try:
        server = launch(ctx.adapter, recs[0]["config"], model=ctx.model, draft_model=ctx.draft_model, log_path=log,
                        timeout_s=launch_timeout_s)
    except LaunchError as e:
        for rec in recs:
            first = not rec["launches"]
            rec.update(failure=Reason(kind="launch_failed", text=f"launch {e.kind}: {e.message}"),
                       **({"argv": e.argv, "env": {}, "log": str(log)} if first else {}))
        return
    launched = {"log": str(log), "launch_s": round(time.monotonic() - t0, 3)}
    firsts = [rec for rec in recs if not rec["launches"]]
    port = int(server.base_url.rsplit(":", 1)[1])
    for rec in firsts:  # each its own command line (the runtime settings as flags) at this address
        argv = ctx.adapter.command(rec["config"], model=ctx.model, draft_model=ctx.draft_model, host="127.0.0.1",
                                   port=port)[0] if rec is not recs[0] else server.argv
        rec.update(argv=argv, env=server.env, log=str(log), launch_s=launched["launch_s"])
    try:
        use(server, recs[0])
        # compiling and graph capture at the first requests are launch cost, not the first repeat's speed
        warm = warm_up(server, workload, concurrency=ctx.load["concurrency"], max_tokens=ctx.load["max_tokens"],
                       seed=ctx.load["seed"], request_timeout=launch_timeout_s)
        launched["warmup_s"] = warm["warmup_s"]
        for rec in firsts:
            rec["warmup_s"] = warm["warmup_s"]
            try:
                use(server, rec)
                rec["greedy"] = greedy_outputs(server.base_url, prompts, quality_tokens) if prompts else []
            except (httpx.HTTPError, KeyError, ValueError) as e:
                rec["greedy_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        # as long as a trial's benchmark: the requests that fill the load's least length at the warm pace
        # (sized at a record's first launch, kept for its later ones: repeats measure one load)
        concurrency = ctx.load["concurrency"] or 1
        n = recs[0].get("bench_requests") or sized_load(ctx.load["num_requests"], warm["waves"][-1], concurrency,
                                                         concurrency, ctx.load["min_measure_s"])
        for rec in recs:
            rec["bench_requests"] = n
        benchmark(server, recs, repeats=repeats, workload=workload, load=ctx.load, num_requests=n, log=log,
                  tables=ctx.directory / "validation", use=lambda rec: use(server, rec), tick=tick)
    finally:
        server.stop()
    for rec in recs:
        rec["launches"].append(launched)
        rec["stats"] = {m: spread([run.get(m) for run in rec["runs"]]) for m in HEADLINE}
