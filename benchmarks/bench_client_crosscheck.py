"""Cross-check the bench client against a peer: the official `openai` Python client, same requests, same run.

    python3 benchmarks/bench_client_crosscheck.py [--url URL] [--workload chat] [-n 12] [--max-tokens 32]

Without --url it starts the embedded engine (`autotune serve`, ngram drafter) and stops it after.
Each request is sent by both clients back to back, the first of the pair alternating, so both see the
same machine load; the output is the median TTFT and E2E of each and their ratio, and whether token counts agree.
"""
import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx

from autotune.bench import Workload, load_workload, run_benchmark
from autotune.bench.runner import served_model


async def openai_timing(url: str, request: dict, model: str) -> tuple[float, float, int]:
    """(TTFT s, E2E s, completion tokens) of one streamed request through the openai client."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    fields = {k: v for k, v in request.items() if k not in ("api", "messages", "prompt")}
    common = {"model": model, "stream": True, "stream_options": {"include_usage": True},
              "extra_body": {"ignore_eos": True}}
    t0 = time.perf_counter()
    if request["api"] == "chat":
        stream = await client.chat.completions.create(messages=request["messages"], **common, **fields)
    else:
        stream = await client.completions.create(prompt=request["prompt"], **common, **fields)
    ttft, tokens = None, None
    async for chunk in stream:
        text = (chunk.choices[0].delta.content if request["api"] == "chat" else chunk.choices[0].text) \
            if chunk.choices else None
        if ttft is None and text:
            ttft = time.perf_counter() - t0
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    e2e = time.perf_counter() - t0
    await client.close()
    return ttft, e2e, tokens


def start_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "autotune.cli", "serve", "--port", str(port), "--drafter", "ngram"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(900):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    sys.exit("embedded server did not become healthy")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url")
    parser.add_argument("--workload", default="chat")
    parser.add_argument("-n", type=int, default=12, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    proc, url = (None, args.url.rstrip("/")) if args.url else start_server()
    try:
        model = served_model(url)
        requests = [dict(r, max_tokens=args.max_tokens) for r in load_workload(args.workload).requests[: args.n]]
        warm = run_benchmark(url, Workload("warm", requests[:1]), progress=False)  # first-request costs hit neither
        if not warm.summary["completed"]:
            sys.exit(f"error: {url} did not serve a request: {warm.requests['error'].iloc[0]}")
        ours, theirs = [], []
        for i, r in enumerate(requests):  # who goes first alternates, so neither gains from order
            for side in ((0, 1) if i % 2 == 0 else (1, 0)):
                if side == 0:
                    row = run_benchmark(url, Workload("one", [r]), progress=False).requests.iloc[0]
                    ours.append((row["ttft_ms"] / 1000, row["e2e_ms"] / 1000, int(row["output_tokens"])))
                else:
                    theirs.append(asyncio.run(openai_timing(url, r, model)))
    finally:
        if proc:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
    print(f"{'metric':10s} {'autotune':>10s} {'openai':>10s} {'ratio':>7s}   ({len(requests)} requests each, medians)")
    for i, name in ((0, "TTFT ms"), (1, "E2E ms")):
        a, b = statistics.median(o[i] for o in ours) * 1000, statistics.median(t[i] for t in theirs) * 1000
        print(f"{name:10s} {a:10.1f} {b:10.1f} {a / b:7.3f}")
    for i, name in ((0, "TTFT"), (1, "E2E")):
        print(f"{name} per-pair ratio median {statistics.median(o[i] / t[i] for o, t in zip(ours, theirs)):.3f}")
    same = [o[2] for o in ours] == [t[2] for t in theirs]
    print(f"completion tokens: autotune {sum(o[2] for o in ours)}, openai {sum(t[2] for t in theirs)}, "
          f"{'identical per request' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
