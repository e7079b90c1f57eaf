"""llama.cpp's llama-server against the embedded engine on one GPU, paired request by request (issue 15, point 6).

Four servers run side by side on the same GGUF: llama-server plain, llama-server with
`--spec-type ngram-simple --spec-draft-n-max 8`, the embedded engine plain and with `--drafter ngram
--draft-length 8` (bf16, inductor, CUDA graphs at batch 1). Each round sends one workload prompt to
every server in turn (the order rotated each round), greedy, `ignore_eos`, 256 tokens, batch 1, so the
four numbers of a round share a prompt and a moment; ratios are taken per round and summarised by
their median with a bootstrap 95% interval. tok/s = completion tokens / the request's wall time
(non-streaming, prefill included).

    python3 benchmarks/gpu_llamacpp.py pairs --llama-server BIN --gguf FILE --out DIR [--rounds 10]
    python3 benchmarks/gpu_llamacpp.py bench --llama-server BIN --gguf FILE --out DIR   # llama-bench tg256
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autotune.bench import load_workload

PLAIN = "llama plain"
NGRAM8 = ["--spec-type", "ngram-simple", "--spec-draft-n-max", "8"]  # issue 15's flags
# In build 11434 ngram-simple drafts up to --spec-ngram-simple-size-m tokens (default 48; common/speculative.cpp
# constructs it with n_max = size_m): --spec-draft-n-max bounds only the draft-model types. "llama ngram-m8" is
# the draft length 8 that "llama ngram8" asks for.
SERVERS = {PLAIN: ("llama", []),
           "llama ngram8": ("llama", NGRAM8),
           "llama ngram-m8": ("llama", [*NGRAM8, "--spec-ngram-simple-size-m", "8"]),
           "embedded plain": ("embedded", []),
           "embedded ngram8": ("embedded", ["--drafter", "ngram", "--draft-length", "8"])}
DEFAULT_SERVERS = "llama plain,llama ngram8,embedded plain,embedded ngram8"
EXTRA_PAIRS = [("embedded ngram8", "embedded plain"), ("embedded ngram8", "llama ngram8"),
               ("embedded ngram8", "llama ngram-m8"), ("llama ngram-m8", "llama ngram8")]


def pairs_of(names: list[str]) -> list[tuple[str, str]]:
    """Every server against llama plain, then the drafting sides against each other, where both ran."""
    out = [(n, PLAIN) for n in names if n != PLAIN and PLAIN in names]
    return out + [(a, b) for a, b in EXTRA_PAIRS if a in names and b in names]


def servers(args) -> list[tuple[str, list[str], int]]:
    host = ["--host", "127.0.0.1"]
    base = {"llama": [args.llama_server, "-m", args.gguf, *host, "--metrics"],  # /metrics: its draft counters
            "embedded": [sys.executable, "-m", "autotune.cli", "serve", "--model", args.gguf, *host,
                         "--device", args.device, *args.embedded_args.split()]}
    out = []
    for i, name in enumerate(args.servers.split(",")):
        kind, extra = SERVERS[name]
        port = args.base_port + i
        out.append((name, [*base[kind], "--port", str(port), *extra], port))
    return out


def wait_healthy(client: httpx.Client, procs: dict, timeout: float) -> dict[str, float]:
    start, ready = time.monotonic(), {}
    while len(ready) < len(procs):
        for name, (proc, port, _) in procs.items():
            if name in ready:
                continue
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode} before /health answered")
            try:
                if client.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    ready[name] = round(time.monotonic() - start, 1)
                    print(f"  {name} ready after {ready[name]} s", flush=True)
            except httpx.HTTPError:
                pass
        if time.monotonic() - start > timeout:
            raise RuntimeError(f"not healthy after {timeout} s: {sorted(set(procs) - set(ready))}")
        time.sleep(1)
    return ready


def one_request(client: httpx.Client, port: int, body: dict, max_tokens: int) -> dict:
    body = dict(body)
    api = body.pop("api")
    body.update(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stream=False)
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    t0 = time.perf_counter()
    r = client.post(f"http://127.0.0.1:{port}{path}", json=body, timeout=300)
    wall = time.perf_counter() - t0
    r.raise_for_status()
    out = r.json()
    choice = out["choices"][0]
    text = choice["message"]["content"] if api == "chat" else choice["text"]
    usage, timings = out.get("usage") or {}, out.get("timings") or {}
    tokens = usage.get("completion_tokens") or timings.get("predicted_n") or 0
    return {"api": api, "wall_s": wall, "completion_tokens": tokens, "tok_s": tokens / wall,
            "finish_reason": choice.get("finish_reason"),
            "text_sha": hashlib.sha256(text.encode()).hexdigest()[:16], "text_head": text[:80],
            # llama-server: decode-only speed and drafts; embedded: its usage extension
            "llama_predicted_per_second": timings.get("predicted_per_second"),
            "llama_prompt_ms": timings.get("prompt_ms"),
            "draft_n": timings.get("draft_n", usage.get("spec_draft_tokens")),
            "draft_accepted": timings.get("draft_n_accepted", usage.get("spec_accepted_tokens")),
            "accept_length": usage.get("accept_length")}


def spec_metrics(client: httpx.Client, port: int) -> dict:
    """The server's speculative-decoding counters from /metrics (cumulative), if it exposes them."""
    try:
        text = client.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    except httpx.HTTPError as e:
        return {"error": str(e)}
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not any(k in line for k in ("spec", "draft", "accept")):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            pass
    return out


def bootstrap_median(values: list[float], resamples: int = 10000, seed: int = 0) -> list[float] | None:
    v = np.asarray(values, dtype=float)
    if v.size < 2:
        return None
    rng = np.random.default_rng(seed)
    meds = np.median(v[rng.integers(0, v.size, size=(resamples, v.size))], axis=1)
    return [float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))]


def summarise(rows: list[dict], names: list[str], workloads: list[str]) -> dict:
    out = {}
    for w in workloads:
        by = {n: {r["round"]: r for r in rows if r["workload"] == w and r["server"] == n} for n in names}
        side = {}
        for n in names:
            speeds = [r["tok_s"] for r in by[n].values()]
            drafted = sum((r["draft_n"] or 0) for r in by[n].values())
            accepted = sum((r["draft_accepted"] or 0) for r in by[n].values())
            side[n] = {"n": len(speeds), "median_tok_s": statistics.median(speeds) if speeds else None,
                       "ci95": bootstrap_median(speeds), "min": min(speeds, default=None),
                       "max": max(speeds, default=None),
                       "median_decode_tok_s_llama": statistics.median(
                           [r["llama_predicted_per_second"] for r in by[n].values()
                            if r["llama_predicted_per_second"]] or [float("nan")]),
                       "draft_accept_rate": accepted / drafted if drafted else None,
                       "tokens": sorted({r["completion_tokens"] for r in by[n].values()})}
        ratios = {}
        for a, b in pairs_of(names):
            common = sorted(set(by[a]) & set(by[b]))
            rs = [by[a][i]["tok_s"] / by[b][i]["tok_s"] for i in common]
            same = sum(by[a][i]["text_sha"] == by[b][i]["text_sha"] for i in common)
            ratios[f"{a} / {b}"] = {"pairs": len(rs), "median": statistics.median(rs) if rs else None,
                                   "ci95": bootstrap_median(rs), "min": min(rs, default=None),
                                   "max": max(rs, default=None), "same_text": same}
        out[w] = {"servers": side, "ratios": ratios}
    return out


def markdown(summary: dict, meta: dict) -> str:
    def fmt(x, d=0):
        return "-" if x is None or math.isnan(x) else f"{x:.{d}f}"

    lines = [(f"Paired run: {meta['rounds']} rounds per workload (after {meta['warmup']} warm-up), "
              f"{meta['max_tokens']} greedy tokens, batch 1, order rotated per round."), ""]
    for w, s in summary.items():
        head = "| server | median tok/s | 95% CI of median | min..max | llama decode tok/s | draft accept | tokens |"
        lines += [f"### workload `{w}`", "", head, "| --- | ---: | --- | --- | ---: | ---: | --- |"]
        for n, v in s["servers"].items():
            ci = v["ci95"]
            dec = v["median_decode_tok_s_llama"]
            lines.append(f"| {n} | {fmt(v['median_tok_s'])} | {fmt(ci[0]) + '..' + fmt(ci[1]) if ci else '-'} | "
                         f"{fmt(v['min'])}..{fmt(v['max'])} | {fmt(dec)} | "
                         f"{fmt(v['draft_accept_rate'], 2)} | {v['tokens']} |")
        lines += ["", "| ratio (paired by round) | pairs | median | 95% CI | min..max | same text |",
                  "| --- | ---: | ---: | --- | --- | ---: |"]
        for k, v in s["ratios"].items():
            ci = v["ci95"]
            lines.append(f"| {k} | {v['pairs']} | {fmt(v['median'], 2)} | "
                         f"{fmt(ci[0], 2) + '..' + fmt(ci[1], 2) if ci else '-'} | "
                         f"{fmt(v['min'], 2)}..{fmt(v['max'], 2)} | {v['same_text']}/{v['pairs']} |")
        lines.append("")
    return "\n".join(lines)


def pairs(args) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a `timeout` still stops the servers (finally)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    specs = servers(args)
    procs, logs = {}, out / "server-logs"
    logs.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for name, argv, port in specs:
        log = open(logs / (name.replace(" ", "_") + ".log"), "w")  # noqa: SIM115 (the server's lifetime)
        print(f"start {name}: {' '.join(argv)}", flush=True)
        procs[name] = (subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT), port, argv)
    names = [s[0] for s in specs]
    rows, meta = [], {"rounds": args.rounds, "warmup": args.warmup, "max_tokens": args.max_tokens,
                      "argv": {n: procs[n][2] for n in names}, "workloads": args.workloads.split(",")}
    try:
        with httpx.Client() as client:
            meta["ready_s"] = wait_healthy(client, procs, args.ready_timeout)
            for w in meta["workloads"]:
                reqs = load_workload(w).requests
                need = args.warmup + args.rounds
                if len(reqs) < need:
                    raise SystemExit(f"workload {w} has {len(reqs)} requests, need {need}")
                for i in range(need):
                    order = names[i % len(names):] + names[:i % len(names)]
                    for n in order:
                        row = one_request(client, procs[n][1], reqs[i], args.max_tokens)
                        row.update(workload=w, server=n, round=i - args.warmup, prompt_index=i,
                                   warmup=i < args.warmup)
                        rows.append(row)
                        print(f"  {w} r{i - args.warmup:>2} {n:<16} {row['tok_s']:7.1f} tok/s "
                              f"({row['completion_tokens']} tok, {row['wall_s']:.3f} s)", flush=True)
                meta.setdefault("metrics", {})[w] = {n: spec_metrics(client, procs[n][1]) for n in names}
    finally:
        for name, (proc, _, _) in procs.items():
            if proc.poll() is None:
                proc.terminate()
        for name, (proc, _, _) in procs.items():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        (out / "pairs_raw.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    measured = [r for r in rows if not r["warmup"]]
    summary = summarise(measured, names, meta["workloads"])
    (out / "pairs.json").write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1))
    table = markdown(summary, meta)
    (out / "pairs.md").write_text(table)
    print(table)
    return 0


def bench(args) -> int:
    binary = Path(args.llama_server).with_name("llama-bench")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = []
    for fa in ("1", "0"):
        argv = [str(binary), "-m", args.gguf, "-p", "0", "-n", "256", "-fa", fa, "-r", "5", "-o", "md"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
        text += [f"$ {' '.join(argv)}  (rc {done.returncode})", done.stdout, done.stderr[-2000:]]
    (out / "llama_bench.txt").write_text("\n".join(text))
    print("\n".join(text))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["pairs", "bench"])
    p.add_argument("--llama-server", required=True)
    p.add_argument("--gguf", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--workloads", default="code,chat")
    p.add_argument("--servers", default=DEFAULT_SERVERS, help=f"comma-separated, of: {', '.join(SERVERS)}")
    p.add_argument("--device", default="cuda")
    p.add_argument("--embedded-args", default="--dtype bfloat16 --compile inductor --cuda-graph-batch-sizes 1")
    p.add_argument("--base-port", type=int, default=8101)
    p.add_argument("--ready-timeout", type=float, default=420)
    args = p.parse_args()
    return pairs(args) if args.what == "pairs" else bench(args)


if __name__ == "__main__":
    sys.exit(main())
