"""Is a trial's figure the configuration's speed? (issue 30 point 3)

A trial measured the asked load (the embedded engine's default: 8 requests of 48 tokens at concurrency 4):
0.6 s on the H200, where noise decides the ranking. It now measures the requests that fill --min-measure
(10 s) at the pace its quick wave showed (bench.runner.sized_load), repeated while its throughput's interval
is wide (bench.runner.tightened). Per configuration, on one warm server, rounds in rotating order of:
  short:  the asked load, as trials measured before
  sized:  a quick wave of `concurrency` requests, then the sized benchmark and its repeats, as trials measure
          now (sized_once: its first benchmark alone, as trials measured before the repeats)
  long:   the workload's requests repeated to fill --long-s (the configuration's speed on a long load)
Reported: each kind's median tok/s, its ratio to the long median, and its worst round's ratio (max |x/long - 1|):
the claim is that sized rounds land within 15% of the long load and short ones need not.

    python3 benchmarks/bench_trial_length.py --out DIR [--configs cpu|gpu] [--rounds 4] [--long-s 20]
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autotune.bench import load_workload
from autotune.bench.runner import MEASURE_S, measure_server, sized_load, tightened, warm_up
from autotune.engines import get_adapter
from autotune.engines.launcher import launch

GRAPHS = {"dtype": "bfloat16", "compile": "inductor", "cuda_graph_batch_sizes": [1, 2, 4, 8]}
CONFIGS = {
    "cpu": {"plain": {"drafter": "none"}, "ngram-4": {"drafter": "ngram", "draft_length": 4}},
    "gpu": {"compiled": {**GRAPHS, "drafter": "none"}, "compiled-ngram-4": {**GRAPHS, "drafter": "ngram", "draft_length": 4}},
}
ASKED = {"concurrency": 4, "num_requests": 8, "max_tokens": 48}  # the embedded engine's default trial load
WORKLOAD = "code"


def bench(server, workload, n: int):
    return measure_server(server, workload, concurrency=ASKED["concurrency"], num_requests=n,
                          max_tokens=ASKED["max_tokens"])


def tok_s(server, workload, n: int) -> tuple[float, float]:
    summary, _ = bench(server, workload, n)
    return summary["output_tok_s"], summary["duration_s"]


def rounds(server, workload, args) -> dict:
    c = ASKED["concurrency"]
    out = {"short": [], "sized": [], "sized_once": [], "long": [], "sized_requests": [], "sized_rounds": [],
           "long_requests": []}
    for r in range(args.rounds):
        kinds = ["short", "sized", "long"]
        for kind in kinds[r % 3:] + kinds[:r % 3]:
            if kind == "short":
                out["short"].append(tok_s(server, workload, ASKED["num_requests"])[0])
            elif kind == "sized":
                _, quick_s = tok_s(server, workload, c)
                n = sized_load(ASKED["num_requests"], quick_s, c, c, MEASURE_S)
                once = functools.partial(bench, server, workload, n)
                first = once()
                pooled, _ = tightened(once, *first)
                out["sized_once"].append(first[0]["output_tok_s"])
                out["sized"].append(pooled["output_tok_s"])
                out["sized_requests"].append(n)
                out["sized_rounds"].append(pooled["rounds"])
            else:
                _, quick_s = tok_s(server, workload, c)
                n = max(len(workload.requests), sized_load(len(workload.requests), quick_s, c, c, args.long_s))
                out["long"].append(tok_s(server, workload, n)[0])
                out["long_requests"].append(n)
        print(f"  round {r}: " + ", ".join(f"{k} {out[k][-1]:.1f}" for k in kinds), flush=True)
    long = statistics.median(out["long"])
    for kind in ("short", "sized_once", "sized"):
        out[f"{kind}_median_over_long"] = round(statistics.median(out[kind]) / long, 4)
        out[f"{kind}_worst_over_long"] = round(max(out[kind], key=lambda x: abs(x / long - 1)) / long, 4)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--configs", choices=CONFIGS, default="cpu")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--long-s", type=float, default=20.0, help="seconds the long load lasts at least")
    parser.add_argument("--max-tokens", type=int, default=ASKED["max_tokens"])
    parser.add_argument("--launch-timeout", type=float, default=400)
    args = parser.parse_args()
    ASKED["max_tokens"] = args.max_tokens
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workload = load_workload(WORKLOAD, 0)
    adapter, configs = get_adapter("embedded"), CONFIGS[args.configs]
    # The servers start (and compile) side by side; each is measured while the others idle.
    pool = ThreadPoolExecutor(len(configs))
    servers = dict(zip(configs, pool.map(lambda name: launch(adapter, configs[name], log_path=out / "logs" / f"{name}.log",
                                                              timeout_s=args.launch_timeout), configs)))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=False).stdout.strip()
    record = {"commit": commit, "configs": configs, "asked": ASKED, "workload": WORKLOAD, "min_measure_s": MEASURE_S,
              "long_s": args.long_s, "rounds": args.rounds, "results": {}}
    try:
        for name, server in servers.items():
            t0 = time.monotonic()
            warm = warm_up(server, workload, concurrency=ASKED["concurrency"], max_tokens=ASKED["max_tokens"])
            print(f"{name}: warm after {warm['warmup_s']:.0f} s", flush=True)
            record["results"][name] = {**rounds(server, workload, args), "seconds": round(time.monotonic() - t0, 1)}
            (out / "trial-length.json").write_text(json.dumps(record, indent=1) + "\n")
    finally:
        for server in servers.values():
            server.stop()
        pool.shutdown()
    for name, r in record["results"].items():
        print(f"{name}: " + ", ".join(f"{k} {r[f'{k}_median_over_long']:.3f} (worst {r[f'{k}_worst_over_long']:.3f})"
                                      for k in ("short", "sized_once", "sized")) + " of long", flush=True)


if __name__ == "__main__":
    main()
