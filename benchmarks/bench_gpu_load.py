"""Does the embedded engine's compiled + CUDA-graph path hold under load? (issue 16 point 7)

Servers (bf16, n-gram drafter, 8 slots), launched together, each warmed up by the engine before /health:
  eager:    no compile, no graphs (the uncompiled engine)
  compiled: --compile inductor --cuda-graph-batch-sizes 1,2,4,8
  fixed:    compiled, plus --step-shape fixed (exact greedy verification; --no-fixed leaves it out)
Plain decode is the same n-gram server with draft_length 0 per request (no proposals: a width-1 step).
For each draft length (0, 4, 8) and concurrency (1, 4, 8) the servers run the code workload in turn,
the order alternating cell by cell: tok/s = completion tokens / wall time of the wave. Then greedy
agreement: every server's text for the same prompts at k = 0 alone against k = 4, 8 (and concurrency 4):
identical share and first divergent character. Servers log dynamo recompilations (TORCH_LOGS=recompiles):
the count after /health said ready must stay 0.

    python3 benchmarks/bench_gpu_load.py --out DIR [--concurrency 1 4 8] [--per-stream 3] [--max-tokens 128]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autotune.bench import load_workload
from autotune.bench.runner import run_benchmark
from autotune.engines import get_adapter
from autotune.engines.launcher import launch

BASE = {"dtype": "bfloat16", "drafter": "ngram", "verify_slots": 8}
GRAPHS = {"compile": "inductor", "cuda_graph_batch_sizes": [1, 2, 4, 8]}
SERVERS = {"eager": BASE, "compiled": {**BASE, **GRAPHS}, "fixed": {**BASE, **GRAPHS, "step_shape": "fixed"}}
DRAFT_LENGTHS = (0, 4, 8)
WORKLOAD = "code"


def launch_all(names, out: Path, timeout_s: float) -> dict:
    adapter = get_adapter("embedded")

    def start(name):
        t0 = time.monotonic()
        server = launch(adapter, SERVERS[name], log_path=out / f"server-{name}.log", timeout_s=timeout_s,
                        env={"TORCH_LOGS": "recompiles"})
        return name, server, time.monotonic() - t0

    # The compiles overlap. The pool outlives the servers: a server dies with the thread that spawned it.
    pool = ThreadPoolExecutor(len(names))
    started = list(pool.map(start, names))
    for name, _, seconds in started:
        print(f"{name}: healthy after {seconds:.1f} s (load + warm-up)", flush=True)
    return {name: (server, seconds) for name, server, seconds in started}, pool


def speed(servers: dict, args, workload) -> list[dict]:
    cells, flip = [], False
    for k in DRAFT_LENGTHS:
        for c in args.concurrency:
            order = list(servers)[::-1] if flip else list(servers)
            flip = not flip
            for name in order:
                server = servers[name][0]
                result = run_benchmark(server.base_url, workload, concurrency=c, num_requests=max(4, args.per_stream * c),
                                       max_tokens=args.max_tokens, progress=False, extra_body={"draft_length": k},
                                       request_timeout=args.request_timeout)
                s = result.summary
                cell = {"server": name, "draft_length": k, "concurrency": c, "output_tok_s": s["output_tok_s"],
                        "failed": s["failed"], "errors": s["errors_by_kind"], "completed": s["completed"],
                        "accept_length": s.get("accept_length")}
                cells.append(cell)
                print(f"k={k} c={c} {name:>9}: {s['output_tok_s']:7.1f} tok/s "
                      f"({s['completed']} done, {s['failed']} failed {s['errors_by_kind'] or ''})", flush=True)
    return cells


def complete(base_url: str, request: dict, k: int, max_tokens: int) -> str:
    """Greedy text of one workload request (chat or completions) at draft length k."""
    chat = "messages" in request
    body = {"messages" if chat else "prompt": request["messages" if chat else "prompt"], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "draft_length": k}
    r = httpx.post(base_url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body, timeout=120)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return choice["message"]["content"] if chat else choice["text"]


def agreement(servers: dict, args, workload) -> dict:
    """Greedy text at k = 0 (one request at a time) against k = 4, 8 alone and k = 8 at concurrency 4."""
    prompts = workload.requests[: args.agree_prompts]
    out = {}
    for name, (server, _) in servers.items():
        def texts(k, concurrency, url=server.base_url):
            with ThreadPoolExecutor(concurrency) as pool:
                return list(pool.map(lambda p: complete(url, p, k, args.agree_tokens), prompts))
        reference = texts(0, 1)
        for label, (k, c) in {"k4_c1": (4, 1), "k8_c1": (8, 1), "k8_c4": (8, 4), "k0_c4": (0, 4)}.items():
            diverge = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None if x == y else min(len(x), len(y)))
                       for x, y in zip(reference, texts(k, c))]
            same = sum(d is None for d in diverge)
            out[f"{name} {label}"] = {"identical": same, "of": len(prompts), "first_divergent_char": diverge}
            print(f"agreement {name} {label} vs k=0 alone: identical {same}/{len(prompts)}, "
                  f"first divergent character {diverge}", flush=True)
    return out


def recompiles(log: Path) -> int:
    return log.read_text(errors="replace").count("Recompiling function")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--per-stream", type=int, default=3, help="requests per concurrent stream in a wave")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--agree-prompts", type=int, default=6)
    parser.add_argument("--agree-tokens", type=int, default=128)
    parser.add_argument("--no-fixed", action="store_true", help="leave out the --step-shape fixed server")
    parser.add_argument("--launch-timeout", type=float, default=400)
    parser.add_argument("--request-timeout", type=float, default=120)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workload = load_workload(WORKLOAD, 0)
    names = [n for n in SERVERS if not (args.no_fixed and n == "fixed")]
    servers, pool = launch_all(names, out, args.launch_timeout)
    record = {"servers": {n: SERVERS[n] for n in names}, "workload": WORKLOAD, "max_tokens": args.max_tokens,
              "per_stream": args.per_stream, "healthy_after_s": {n: round(s, 1) for n, (_, s) in servers.items()}}
    logs = {n: out / f"server-{n}.log" for n in names}
    record["recompiles_at_ready"] = {n: recompiles(log) for n, log in logs.items()}
    try:
        record["warmup_log"] = {n: [line for line in log.read_text().splitlines() if "warm-up" in line]
                                for n, log in logs.items()}
        record["cells"] = speed(servers, args, workload)
        (out / "load.json").write_text(json.dumps(record, indent=1) + "\n")
        record["agreement"] = agreement(servers, args, workload)
    finally:
        record["recompiles_while_serving"] = {n: recompiles(log) - record["recompiles_at_ready"][n]
                                              for n, log in logs.items()}
        print(f"recompilations after ready: {record['recompiles_while_serving']}", flush=True)
        (out / "load.json").write_text(json.dumps(record, indent=1) + "\n")
        for server, _ in servers.values():
            server.stop()
        pool.shutdown()


if __name__ == "__main__":
    main()
