"""Exported winners of several studies, relaunched side by side and measured in alternation on one machine: the
same workload, concurrency and request count for all (issue 35 point 3: SGLang's winner against the embedded
engine's and llama-server's on the same GPU and load).

A side is a study folder (its best/launch.json started as exported: argv and environment, moved to a free port,
runtime settings applied as the tuner applied them), a sweep of bench_gpu_tuner.py (sweep*.json: its best cell at
the concurrency), a tuner record of it (tuner-*.json) or a study's validation.json (their validated winner); these are launched from
their configuration as `confirm` does. Sides start in the order given (an engine that sizes its memory pool from
what is free, as SGLang does, goes last), are warmed up at the concurrency, then every round measures each server
once, the order rotating by round. Per side: the median output tok/s over rounds; per pair against the first
side: the ratio of medians with a 95% bootstrap interval over rounds. The numbers come from this run, not from
the runs that chose the winners.

    python3 benchmarks/bench_exported.py SIDE... --out FILE.json [--concurrency 1] [--rounds 4]
        [--per-stream 16] [--max-tokens 128] [--workload code] [--seed 1]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
from scipy.stats import bootstrap

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_gpu_tuner import best_cells, launch_config

from autotune import provenance
from autotune.bench import load_workload
from autotune.bench.runner import measure_server, warm_up
from autotune.engines import get_adapter


def side(path: Path, concurrency: int) -> dict:
    """{"engine", "config"} and, for a study, its exported "argv" and "env"."""
    if path.is_dir():
        return json.loads((path / "best" / "launch.json").read_text())
    doc = json.loads(path.read_text())
    if "cells" in doc:
        cell = best_cells(path.parent, doc["settings"]["engine"])[concurrency]
        return {"engine": doc["settings"]["engine"], "config": cell["config"]}
    if "winner_config" in doc:  # a tuner record
        return {"engine": doc["engine"], "config": doc["winner_config"]}
    return {"engine": doc["engine"], "config": doc["winner"]["config"]}  # a study's validation.json


def start(path: Path, exported: dict, out: Path, concurrency: int, max_tokens: int, workload, timeout_s: float):
    server = launch_config(get_adapter(exported["engine"]), exported["config"], argv=exported.get("argv"),
                           env=exported.get("env"), log_path=out.with_name(f"{out.stem}-{path.stem}.log"),
                           timeout_s=timeout_s)
    warm_up(server, workload, concurrency=concurrency, max_tokens=max_tokens, request_timeout=timeout_s)
    return server


def ratio_interval(top: list[float], bottom: list[float], seed: int) -> list[float]:
    """95% bootstrap interval of median(top) / median(bottom), rounds resampled in pairs (same round, same time)."""
    if top is bottom:
        return [1.0, 1.0]
    if len(top) < 3:
        return [float("nan"), float("nan")]
    res = bootstrap((np.array(top), np.array(bottom)), lambda a, b: np.median(a) / np.median(b), paired=True,
                    vectorized=False, confidence_level=0.95, method="percentile", random_state=seed)
    return [float(res.confidence_interval.low), float(res.confidence_interval.high)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sides", nargs="+", type=Path, help="study folders (each with best/launch.json), sweep*.json or "
                                                        "tuner-*.json files; the first is the one the others are "
                                                        "compared with")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--per-stream", type=int, default=16, help="requests per concurrent stream in each measurement")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--workload", default="code")
    ap.add_argument("--seed", type=int, default=1, help="the workload's prompt order (not the tuners' seed 0)")
    ap.add_argument("--launch-timeout", type=float, default=600.0)
    args = ap.parse_args()
    missing = [str(d) for d in args.sides if d.is_dir() and not (d / "best" / "launch.json").is_file()]
    if missing:
        sys.exit(f"bench_exported: no best/launch.json in {', '.join(missing)}")
    if len({d.stem for d in args.sides}) < len(args.sides):
        sys.exit("bench_exported: two sides share a name; give each its own file or folder name")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    workload = load_workload(args.workload, args.seed)
    exported = {d.stem: side(d, args.concurrency) for d in args.sides}
    servers = {}
    try:
        for d in args.sides:
            servers[d.stem] = start(d, exported[d.stem], args.out, args.concurrency, args.max_tokens, workload,
                                    args.launch_timeout)
        names = list(servers)
        values = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                summary, _ = measure_server(servers[name], workload, concurrency=args.concurrency,
                                            num_requests=args.per_stream * args.concurrency,
                                            max_tokens=args.max_tokens, seed=args.seed + r)
                values[name].append(summary["output_tok_s"])
                print(f"round {r}: {name} {summary['output_tok_s']:.1f} tok/s", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    first = names[0]
    rows = [{"side": name, "engine": exported[name]["engine"], "config": exported[name]["config"],
             "values": values[name], "median_tok_s": statistics.median(values[name]),
             f"ratio_over_{first}": statistics.median(values[name]) / statistics.median(values[first]),
             "ratio_ci95": ratio_interval(values[name], values[first], args.seed)} for name in names]
    doc = {"commit": provenance.commit(), "concurrency": args.concurrency, "rounds": args.rounds,
           "requests_per_measurement": args.per_stream * args.concurrency, "max_tokens": args.max_tokens,
           "workload": args.workload, "seed": args.seed, "rows": rows}
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    for row in rows:
        print(f"{row['side']} ({row['engine']}): median {row['median_tok_s']:.1f} tok/s, "
              f"{row[f'ratio_over_{first}']:.3f}x {first} (95% CI {row['ratio_ci95'][0]:.3f}-{row['ratio_ci95'][1]:.3f})")


if __name__ == "__main__":
    main()
