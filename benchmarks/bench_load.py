"""The embedded server under load and bad input (issue 20): no request may hold a slot it should not have.

    python3 benchmarks/bench_load.py [--clients 256] [--malformed 160] [--disconnects 32] [--long 4]
                                     [--max-tokens 8] [--request-timeout 30] [--out DIR]

Starts `autotune serve` on 127.0.0.1 (a free port) and sends, all within the first --spread seconds:
  clients      streaming completions and chats (alternated; temperature 0 and 0.7), all in flight at once
  malformed    bodies the server must refuse with 400 (MALFORMED: the issue's kinds and more), spread out,
               sent and timed from a process of their own
  disconnects  streams whose client hangs up after the first token (the server must free the slot)
  long         chats without max_tokens (the rest of the context, ignore_eos): only --request-timeout ends them
Every client is bounded (--client-timeout); the whole run by --time-limit. It reports completed/failed
counts per class (a client the deadline cut short is counted apart), HTTP statuses, time to first token of
the streaming clients (queue wait included: every client arrives at once, so most of it is waiting for a
slot) as percentiles, the server's own counters (/metrics), and checks: no 5xx, no client hung, every client
ended 200 with finish_reason "length", every malformed body answered 400 within a second, the
long requests ended by the deadline with finish_reason "length", no slot held or queued at the end, the
server healthy after, /metrics counting every request sent. Exit 1 if any check fails.

Not a speed benchmark, so no peer ratio: the numbers say how the server behaves, on this machine, under
this load.
"""
import argparse
import asyncio
import json
import multiprocessing
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path

import httpx
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from autotune.engines.launcher import Launcher, free_port

PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n", "Once upon a time"]
CHATS = ["Name three colours.", "What is 2 + 2?", "Say hello in French.", "Write a haiku about rain."]
MALFORMED = {  # kind -> (path, raw body); every one must get 400
    "huge max_tokens": ("/v1/completions", {"prompt": "hi", "max_tokens": 10**12}),
    "message without content": ("/v1/chat/completions", {"messages": [{"role": "user"}]}),
    "unknown role": ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}),
    "n > 1": ("/v1/completions", {"prompt": "hi", "n": 4}),
    "string max_tokens": ("/v1/completions", {"prompt": "hi", "max_tokens": "16"}),
    "negative temperature": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}),
    "logprobs": ("/v1/completions", {"prompt": "hi", "logprobs": 5}),
    "truncated JSON": ("/v1/completions", b'{"prompt": "hi", "max_tokens": '),
    "not an object": ("/v1/chat/completions", b'["hi"]'),
    "NaN": ("/v1/completions", b'{"prompt": "hi", "top_p": NaN}'),
    "prompt over the context": ("/v1/completions", {"prompt": "word " * 100_000}),
    "deep nesting": ("/v1/completions", b"[" * 50_000),
}


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    return {f"p{q}": round(float(np.percentile(values, q)), 3) for q in (50, 90, 99)} | {"max": round(max(values), 3)}


async def stream(client: httpx.AsyncClient, kind: str, i: int, body: dict, path: str, hang_up: bool, bound: float):
    """One streaming request: {kind, status, ttft_s, e2e_s, finish_reason, tokens, error}."""
    rec = {"kind": kind, "status": None, "ttft_s": None, "e2e_s": None, "finish_reason": None, "tokens": None,
           "error": None}
    t0 = time.perf_counter()

    async def exchange():
        streamed = body | {"stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", path, json=streamed) as response:
            rec["status"] = response.status_code
            if response.status_code != 200:
                await response.aread()
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec["error"] = chunk["error"].get("message")
                    return
                if chunk.get("usage"):
                    rec["tokens"] = chunk["usage"]["completion_tokens"]
                choice = (chunk.get("choices") or [{}])[0]
                text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if text and rec["ttft_s"] is None:
                    rec["ttft_s"] = time.perf_counter() - t0
                    if hang_up:
                        return  # leaving the block closes the connection mid-stream
                rec["finish_reason"] = choice.get("finish_reason") or rec["finish_reason"]

    try:
        await asyncio.wait_for(exchange(), bound)
    except asyncio.TimeoutError:
        rec["error"] = f"hung: no end within {bound:g} s"
    except httpx.HTTPError as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["e2e_s"] = time.perf_counter() - t0
    return rec


async def malformed(client: httpx.AsyncClient, kind: str, bound: float):
    path, body = MALFORMED[kind]
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    rec = {"kind": "malformed", "malformed": kind, "status": None, "e2e_s": None, "error": None}
    t0 = time.perf_counter()
    try:
        response = await asyncio.wait_for(client.post(path, content=raw, headers={"content-type": "application/json"}), bound)
        rec["status"] = response.status_code
    except asyncio.TimeoutError:
        rec["error"] = f"hung: no answer within {bound:g} s"
    except httpx.HTTPError as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["e2e_s"] = time.perf_counter() - t0
    return rec


def send_malformed(url: str, schedule: list[tuple[float, str]], bound: float) -> list[dict]:
    """In a process of its own: the malformed bodies, each at its start time. Timed there, because the main
    process's event loop, busy with hundreds of streams on a shared CPU, adds seconds of its own delay."""
    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=bound) as client:
            async def one(delay: float, kind: str):
                await asyncio.sleep(delay)
                return await malformed(client, kind, bound)
            return await asyncio.gather(*(one(delay, kind) for delay, kind in schedule))
    return asyncio.run(run())


def good_body(i: int, max_tokens: int) -> tuple[str, dict]:
    temperature = 0.0 if i % 4 < 2 else 0.7
    if i % 2:
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": CHATS[i % len(CHATS)]}],
                                        "max_tokens": max_tokens, "temperature": temperature, "ignore_eos": True}
    return "/v1/completions", {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens,
                               "temperature": temperature, "ignore_eos": True}


async def traffic(url: str, args, progress: Progress) -> list[dict]:
    rng = random.Random(args.seed)
    kinds = sorted(MALFORMED)
    jobs = []  # (start delay s, progress task, coroutine function)
    tasks = {name: progress.add_task(name, total=n) for name, n in
             (("clients", args.clients), ("malformed", args.malformed), ("disconnects", args.disconnects),
              ("long", args.long)) if n}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(args.client_timeout), limits=limits) as client:
        bound = args.client_timeout
        for i in range(args.clients):
            path, body = good_body(i, args.max_tokens)
            jobs.append((0.0, "clients", partial(stream, client, "client", i, body, path, False, bound)))
        for i in range(args.disconnects):
            path, body = good_body(i, 200)
            jobs.append((rng.uniform(0, args.spread), "disconnects", partial(stream, client, "disconnect", i, body, path,
                                                                             True, bound)))
        for i in range(args.long):
            body = {"messages": [{"role": "user", "content": CHATS[i % len(CHATS)]}], "ignore_eos": True}
            jobs.append((rng.uniform(0, args.spread), "long", partial(stream, client, "long", i, body,
                                                                      "/v1/chat/completions", False, bound)))

        async def run(delay, task, make):
            await asyncio.sleep(delay)
            rec = await make()
            progress.advance(tasks[task])
            return rec

        schedule = [(rng.uniform(0, args.spread), kinds[i % len(kinds)]) for i in range(args.malformed)]
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            refused = asyncio.get_running_loop().run_in_executor(pool, send_malformed, url, schedule, bound)
            records = await asyncio.wait_for(asyncio.gather(*(run(*job) for job in jobs), refused), args.time_limit)
        if args.malformed:
            progress.advance(tasks["malformed"], args.malformed)
        return records[:-1] + records[-1]


def scrape(url: str) -> dict:
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_idle(url: str, timeout: float) -> tuple[dict, float | None]:
    """The server's metrics once nothing runs or waits (and how long that took), or the last ones and None."""
    t0 = time.monotonic()
    while True:
        metrics = scrape(url)
        if metrics["autotune_requests_running"] == 0 and metrics["autotune_requests_waiting"] == 0:
            return metrics, time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            return metrics, None
        time.sleep(0.2)


def summarize(records: list[dict], metrics: dict, idle_after_s: float | None, healthy: bool, args) -> dict:
    by_kind = {k: [r for r in records if r["kind"] == k] for k in ("client", "malformed", "disconnect", "long")}
    clients = by_kind["client"]
    ok = [r for r in clients if r["status"] == 200 and r["tokens"] == args.max_tokens and not r["error"]]
    cut = [r for r in clients if r["status"] == 200 and r["finish_reason"] == "length" and (r["tokens"] or 0) < args.max_tokens]
    http = {k: v for k, v in metrics.items() if k.startswith("autotune_http_requests_total{")}
    counted = sum(v for k, v in http.items() if "/v1/" in k)
    statuses = Counter(str(r["status"]) for r in records)
    checks = {
        "no 5xx": not any((r["status"] or 0) >= 500 for r in records) and not any(("status=\"5" in k) for k in http),
        "no client hung": not any((r["error"] or "").startswith("hung") for r in records),
        "every client ended 200 with 'length' (completed, or cut by the deadline)": len(ok) + len(cut) == len(clients),
        "every malformed body got 400 within 1 s": all(r["status"] == 400 and r["e2e_s"] < 1.0 for r in by_kind["malformed"]),
        "long requests ended by the deadline with 'length'": all(
            r["status"] == 200 and r["finish_reason"] == "length" and r["e2e_s"] < args.request_timeout + 10
            for r in by_kind["long"]),
        "no slot held or queued at the end": idle_after_s is not None,
        "healthy after": healthy,
        "/metrics counted every request": counted == len(records),
    }
    return {
        "sent": dict(Counter(r["kind"] for r in records)),
        "clients_completed": len(ok), "clients_cut_by_the_deadline": len(cut),
        "clients_failed": len(clients) - len(ok) - len(cut),
        "statuses": dict(statuses),
        "malformed_by_kind": {k: dict(Counter(str(r["status"]) for r in by_kind["malformed"] if r["malformed"] == k))
                              for k in sorted(MALFORMED)},
        "malformed_answer_s": percentiles([r["e2e_s"] for r in by_kind["malformed"]]),
        "client_ttft_s": percentiles([r["ttft_s"] for r in ok]),
        "client_e2e_s": percentiles([r["e2e_s"] for r in ok]),
        "disconnect_ttft_s": percentiles([r["ttft_s"] for r in by_kind["disconnect"] if r["ttft_s"] is not None]),
        "long_e2e_s": percentiles([r["e2e_s"] for r in by_kind["long"]]),
        "idle_after_s": None if idle_after_s is None else round(idle_after_s, 3),
        "server": {"http_requests": http, "request_timeouts": metrics.get("autotune_request_timeouts_total"),
                   "generation_tokens": metrics.get("autotune_generation_tokens_total"),
                   "engine_requests": metrics.get("autotune_requests_total")},
        "checks": checks,
        "errors": sorted({r["error"] for r in records if r["error"]})[:20],
    }


def commit() -> tuple[str, bool]:
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "autotune"], capture_output=True, text=True,
                           check=False).stdout.strip()
    return head, bool(dirty)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=256, help="concurrent streaming clients (>= 1)")
    ap.add_argument("--malformed", type=int, default=160, help="malformed requests, cycling through the kinds")
    ap.add_argument("--disconnects", type=int, default=32, help="streams the client hangs up after one token")
    ap.add_argument("--long", type=int, default=4, help="chats with no max_tokens, ended only by the request timeout")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens per streaming client")
    ap.add_argument("--request-timeout", type=float, default=30.0, help="the server's --request-timeout, seconds")
    ap.add_argument("--client-timeout", type=float, default=300.0, help="each client's own bound, seconds")
    ap.add_argument("--time-limit", type=float, default=900.0, help="bound on the whole run, seconds")
    ap.add_argument("--spread", type=float, default=5.0, help="malformed, disconnects and long start within this")
    ap.add_argument("--verify-slots", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write results.json (and the server log) here")
    args = ap.parse_args()
    problems = [f"--{n.replace('_', '-')} must be {rule}" for n, ok, rule in [
        ("clients", args.clients >= 1, ">= 1"), ("malformed", args.malformed >= 0, ">= 0"),
        ("disconnects", args.disconnects >= 0, ">= 0"), ("long", args.long >= 0, ">= 0"),
        ("max_tokens", args.max_tokens >= 1, ">= 1"), ("request_timeout", args.request_timeout > 0, "> 0"),
        ("client_timeout", args.client_timeout > 0, "> 0"), ("time_limit", args.time_limit > 0, "> 0"),
        ("spread", args.spread >= 0, ">= 0"), ("verify_slots", args.verify_slots >= 1, ">= 1")] if not ok]
    if problems:
        sys.exit(f"error: {'; '.join(problems)}")
    console = Console()
    head, dirty = commit()
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench-load-"))
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [sys.executable, "-m", "autotune.cli", "serve", "--port", str(port), "--drafter", "ngram",
            "--verify-slots", str(args.verify_slots), "--threads", str(args.threads),
            "--request-timeout", f"{args.request_timeout:g}", "--log-level", "warning"]
    url = f"http://127.0.0.1:{port}"
    with Launcher(argv, log_path=out / "server.log", health_url=f"{url}/health") as server:
        server.start(timeout=300)
        console.print(f"server up at {url} (commit {head[:10]}{' + uncommitted autotune/ changes' if dirty else ''})")
        t0 = time.monotonic()
        columns = (TextColumn("{task.description:>12}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console) as progress:
            try:
                records = asyncio.run(traffic(url, args, progress))
            except asyncio.TimeoutError:
                sys.exit(f"error: the run passed --time-limit {args.time_limit:g} s: something hung")
        wall = time.monotonic() - t0
        metrics, idle_after = wait_idle(url, timeout=30)
        healthy = httpx.get(f"{url}/health", timeout=10).status_code == 200
    summary = summarize(records, metrics, idle_after, healthy, args)
    summary = {"commit": head, "uncommitted_autotune_changes": dirty, "wall_s": round(wall, 1),
               "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
               "args": vars(args), "argv": argv, **summary}
    (out / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
    print_summary(console, summary)
    console.print(f"results in {out / 'results.json'}")
    sys.exit(0 if all(summary["checks"].values()) else 1)


def print_summary(console: Console, s: dict):
    table = Table(title=f"bench_load: {s['sent']} in {s['wall_s']} s")
    table.add_column("what")
    table.add_column("value")
    table.add_row("clients completed / cut by the deadline / failed",
                  f"{s['clients_completed']} / {s['clients_cut_by_the_deadline']} / {s['clients_failed']}")
    table.add_row("HTTP statuses", str(s["statuses"]))
    table.add_row("client time to first token (s)", str(s["client_ttft_s"]))
    table.add_row("client end to end (s)", str(s["client_e2e_s"]))
    table.add_row("malformed answered in (s)", str(s["malformed_answer_s"]))
    table.add_row("long requests ended in (s)", str(s["long_e2e_s"]))
    table.add_row("idle after the run (s)", str(s["idle_after_s"]))
    table.add_row("server request timeouts", str(s["server"]["request_timeouts"]))
    for name, ok in s["checks"].items():
        table.add_row(name, "[green]ok[/]" if ok else "[red]FAILED[/]")
    console.print(table)


if __name__ == "__main__":
    main()
