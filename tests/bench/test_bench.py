"""The benchmark harness: workloads, SLOs, metric arithmetic, Prometheus parsing, and live runs over HTTP."""
import asyncio
import itertools
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pandas as pd
import pytest
from typer.testing import CliRunner

from autotune.bench import load_workload, parse_slo, run_benchmark, shipped_workloads
from autotune.bench.client import RequestRecord
from autotune.bench.metrics import requests_frame, summarize
from autotune.bench.resources import ResourceSampler, tree_peak_rss_kib
from autotune.bench.server_metrics import acceptance, parse_prometheus, scrape
from autotune.bench.workloads import Workload, prompt_text, with_api
from autotune.cli import app

# -- workloads ---------------------------------------------------------------------------------------


def test_shipped_sets_load_with_their_own_lengths_and_sampling():
    assert set(shipped_workloads()) >= {"code", "chat", "long-prefill", "repetitive", "mixed"}
    for name in shipped_workloads():
        w = load_workload(name)
        assert len(w.requests) >= 16 and all(r["api"] in ("chat", "completions") for r in w.requests)
        assert all(8 <= r["max_tokens"] <= 128 for r in w.requests)
        assert w.describe()["requests"] == len(w.requests)
    # long-prefill: 1.5k+ tokens is > 4.5k characters of code for this tokenizer (~3.5 chars/token)
    assert min(len(prompt_text(r)) for r in load_workload("long-prefill").requests) > 2500
    assert len(load_workload("mixed").describe()["temperatures"]) >= 3


def test_code_set_is_real_stdlib_source():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = "".join(p.read_text(encoding="utf-8") for p in [stdlib / "textwrap.py", stdlib / "difflib.py",
                                                              stdlib / "shlex.py", stdlib / "heapq.py"])
    completions = [r["prompt"] for r in load_workload("code").requests if r["api"] == "completions"]
    # every completion prompt starts with a def line found verbatim in the interpreter's Lib/
    first_lines = [p.splitlines()[0] for p in completions]
    assert all(line.startswith("def ") for line in first_lines)
    assert any(line in sources for line in first_lines)


def test_seed_orders_the_workload_deterministically():
    a, b, c = load_workload("chat", seed=1), load_workload("chat", seed=1), load_workload("chat", seed=2)
    assert a.requests == b.requests and a.requests != c.requests
    assert sorted(map(json.dumps, a.requests)) == sorted(map(json.dumps, c.requests))


def test_user_jsonl_and_sharegpt(tmp_path):
    good = tmp_path / "mine.jsonl"
    good.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": False})
                    + "\n\n" + json.dumps({"prompt": "def f(", "temperature": 0.5}) + "\n")
    w = load_workload(str(good))
    assert w.name == "mine" and sorted(r["api"] for r in w.requests) == ["chat", "completions"]
    assert all("stream" not in r for r in w.requests)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x"}) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not JSON"):
        load_workload(str(bad))
    bad.write_text(json.dumps({"api": "chat", "prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match="needs 'messages'"):
        load_workload(str(bad))
    share = tmp_path / "sg.json"
    share.write_text(json.dumps([{"conversations": [{"from": "human", "value": "Tell me a story"},
                                                    {"from": "gpt", "value": "x" * 400}]},
                                 {"conversations": [{"from": "human", "value": "only a prompt"}]}]))
    w = load_workload(str(share))
    assert len(w.requests) == 1 and w.requests[0]["max_tokens"] == 100
    assert w.requests[0]["messages"][0]["content"] == "Tell me a story"
    with pytest.raises(ValueError, match="neither a file nor a shipped set"):
        load_workload("no-such-set")


def test_api_conversion_keeps_the_text():
    w = Workload("t", [{"api": "chat", "messages": [{"role": "user", "content": "abc"}], "max_tokens": 3},
                       {"api": "completions", "prompt": "def f(", "max_tokens": 3}])
    assert [r["prompt"] for r in with_api(w, "completions").requests] == ["abc", "def f("]
    assert [r["messages"][0]["content"] for r in with_api(w, "chat").requests] == ["abc", "def f("]


# -- SLO ---------------------------------------------------------------------------------------------


def test_slo_parses_once_and_checks_a_summary():
    slo = parse_slo("p95_ttft_ms<500; p95_itl_ms<=40; accept_length>1.5; error_rate<0.01")
    assert [t.summary_key for t in slo.terms] == ["ttft_ms_p95", "itl_ms_p95", "accept_length", "error_rate"]
    ok = {"ttft_ms_p95": 499.0, "itl_ms_p95": 40.0, "accept_length": 1.6, "error_rate": 0.0}
    assert slo.check(ok) == []
    bad = dict(ok, ttft_ms_p95=500.0, accept_length=None)
    violations = slo.check(bad)
    assert len(violations) == 2 and "p95_ttft_ms<500" in violations[0] and "not measured" in violations[1]
    assert parse_slo("ttft_ms_p95 < 2e3").terms[0].metric == "p95_ttft_ms"  # the summary's own key works too


@pytest.mark.parametrize("text, bad_part", [("p95_ttft_ms<500; p95_tft_ms<3", "p95_tft_ms"),
                                            ("p95_ttft_ms=500", "p95_ttft_ms=500"),
                                            ("accept_length>fast", "accept_length>fast"), (" ; ", "empty")])
def test_malformed_slo_names_the_bad_part_and_the_known_metrics(text, bad_part):
    with pytest.raises(ValueError) as e:
        parse_slo(text)
    assert bad_part in str(e.value) and "p99_itl_ms" in str(e.value) and "error_rate" in str(e.value)


# -- metric arithmetic on hand-made timestamps -------------------------------------------------------


def record(index, start, chunks, tokens=None, usage_tokens=None, error=None, **usage):
    rec = RequestRecord(index=index, api="chat", start_s=start)
    if error:
        rec.error_kind, rec.error = error, "boom"
        return rec
    rec.chunk_times_s = chunks
    rec.chunk_tokens = tokens or [1] * len(chunks)
    rec.chunk_tokens_reported = tokens is not None
    rec.ttft_s, rec.e2e_s = chunks[0], chunks[-1] + 0.001
    rec.finish_reason = "length"
    rec.usage = {"prompt_tokens": 10, **usage}
    if usage_tokens is not None:
        rec.usage["completion_tokens"] = usage_tokens
    return rec


def test_metrics_from_timestamps():
    # request 0: 5 tokens, one chunk each, 0.1 s apart after a 0.2 s TTFT
    # request 1: 5 tokens in 3 chunks (1 + 2 + 2) as speculative decoding streams them
    records = [record(0, 0.0, [0.2, 0.3, 0.4, 0.5, 0.6], usage_tokens=5),
               record(1, 0.5, [0.4, 0.8, 1.2], tokens=[1, 2, 2], usage_tokens=5, spec_verify_steps=2,
                      spec_draft_tokens=8, spec_accepted_tokens=2),
               record(2, 1.0, [], error="connect"), record(3, 1.1, [], error="stream_broken")]
    frame = requests_frame(records)
    s = summarize(frame, duration_s=2.0, slo=parse_slo("p50_ttft_ms<300; p99_tpot_ms<150"))
    assert (s["completed"], s["failed"], s["error_rate"]) == (2, 2, 0.5)
    assert s["errors_by_kind"] == {"connect": 1, "stream_broken": 1}
    assert s["output_tok_s"] == pytest.approx(10 / 2.0) and s["request_throughput"] == pytest.approx(1.0)
    r0, r1 = frame.iloc[0], frame.iloc[1]
    assert r0["ttft_ms"] == pytest.approx(200) and r0["e2e_ms"] == pytest.approx(601)
    assert r0["tpot_ms"] == pytest.approx((601 - 200) / 4)
    assert r0["decode_tok_s"] == pytest.approx(4 / 0.401)
    assert r0["itl_ms"] == pytest.approx([100, 100, 100, 100])
    assert r1["itl_ms"] == pytest.approx([200, 200, 200, 200])  # a 2-token chunk after 0.4 s: two gaps of 0.2 s
    assert s["ttft_ms_mean"] == pytest.approx(300) and s["ttft_ms_p50"] == pytest.approx(300)
    assert s["ttft_ms_p99"] == pytest.approx(200 + 200 * 0.99)  # numpy linear interpolation, as vLLM/SGLang
    assert s["itl_ms_p50"] == pytest.approx(150) and s["itl_ms_mean"] == pytest.approx(150)
    assert s["itl_basis"] == "chunk"  # request 0's server did not report tokens per chunk
    assert summarize(frame.iloc[[1]], 1.0)["itl_basis"] == "token"
    # accept length: tokens per verify step = 1 + accepted / steps, only over requests that report it
    assert s["accept_length"] == pytest.approx(2.0) and s["accept_rate"] == pytest.approx(0.25)
    # goodput: request 0 meets TTFT<300 and TPOT<150 (100.25); request 1's TTFT 400 misses
    assert s["goodput"] == pytest.approx(1 / 2.0)
    assert summarize(frame, 2.0)["goodput"] is None


def test_the_metric_registry_names_exactly_what_the_summary_holds_and_the_slo_parser_knows():
    from autotune.bench.metric_registry import HEADLINE, METRICS, PER_LEVEL, SHOWN, metric
    from autotune.bench.slo import KNOWN, canonical
    from autotune.study import objectives

    frame = requests_frame([record(0, 0.0, [0.2, 0.3, 0.4], usage_tokens=3)])
    summary = summarize(frame, 1.0, slo=parse_slo("p95_ttft_ms<500"))
    sampled = {"peak_gpu_mem_gb", "peak_rss_gb"}  # added beside the summary by the resource sampler (bench/runner.py)
    assert set(METRICS) - sampled <= set(summary), "a registry metric the benchmark summary does not produce"
    assert {*HEADLINE, *SHOWN, *PER_LEVEL} <= set(METRICS)
    assert {canonical(name) for name in METRICS} == set(KNOWN)  # --slo accepts every registry metric, nothing else
    assert metric("output_tok_s").better(2.0, 1.0) and metric("ttft_ms_p95").better(1.0, 2.0)
    assert metric("itl_ms_p95").label == "p95 ITL ms" and metric("e2e_ms_p95").format(812.4) == "812"
    assert objectives.directions("pareto") == ["maximize", "minimize"]
    with pytest.raises(ValueError, match="unknown metric 'tok_s'"):
        metric("tok_s")


def test_empty_and_non_finite_results_still_summarize_and_save(tmp_path):
    from autotune.bench import BenchResult, save_results

    s = summarize(requests_frame([]), 1.0)
    assert (s["completed"], s["failed"], s["ttft_ms_p50"], s["accept_length"]) == (0, 0, None, None)
    path, parquet = save_results([BenchResult(requests_frame([]), dict(s, rate=float("inf")))], tmp_path / "r.json")
    assert json.loads(path.read_text())["summary"]["rate"] == "inf" and pd.read_parquet(parquet).empty


def test_token_counts_fall_back_to_chunks_without_usage():
    frame = requests_frame([record(0, 0.0, [0.1, 0.2, 0.3], tokens=[1, 3, 1])])
    assert frame.iloc[0]["output_tokens"] == 5 and not frame.iloc[0]["tokens_from_usage"]


# -- Prometheus ------------------------------------------------------------------------------------

VLLM_TEXT = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 40.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 60.0
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 300.0
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 150.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 90.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 12.0
vllm:e2e_request_latency_seconds_sum{model_name="m"} 3.5e+00 1712345678000
"""
SGLANG_TEXT = """\
# HELP sglang:spec_accept_length The average acceptance length of speculative decoding.
# TYPE sglang:spec_accept_length gauge
sglang:spec_accept_length{model_name="qwen/Qwen2.5-7B",engine_type="unified",tp_rank="0"} 2.73
sglang:spec_accept_rate{model_name="qwen/Qwen2.5-7B",engine_type="unified",tp_rank="0"} NaN
"""


def test_prometheus_text_and_acceptance_deltas():
    after = parse_prometheus(VLLM_TEXT)
    assert after["vllm:spec_decode_num_drafts_total"] == 100.0  # summed over engines
    assert after["vllm:time_to_first_token_seconds_bucket"] == 12.0
    assert after["vllm:e2e_request_latency_seconds_sum"] == 3.5  # sample with a timestamp
    before = {"vllm:spec_decode_num_drafts_total": 50.0, "vllm:spec_decode_num_draft_tokens_total": 100.0,
              "vllm:spec_decode_num_accepted_tokens_total": 50.0}
    acc = acceptance(before, after)
    assert acc["server_accept_length"] == pytest.approx(1 + 100 / 50) and acc["server_accept_rate"] == 0.5
    sg = acceptance(None, parse_prometheus(SGLANG_TEXT))
    assert sg == {"server_accept_length": 2.73, "server_accept_rate": None, "server_metrics_source": "sglang"}
    assert acceptance(None, None)["server_accept_length"] is None


# A "server" that forks a worker, as engines do; the worker allocates on demand and frees it again.
SERVER_TREE = "import subprocess, sys; subprocess.run([sys.executable, '-c', sys.argv[1], sys.argv[2]])"
WORKER = """
import sys
print("up", flush=True)
sys.stdin.readline()
ballast = b"x" * (int(sys.argv[1]) << 20)  # every page written
del ballast  # unmapped: RSS falls back, the kernel's high-water mark (VmHWM) keeps the peak
print("freed", flush=True)
sys.stdin.readline()
"""


def test_peak_rss_is_the_high_water_mark_of_the_whole_process_tree():
    mib = 256
    server = subprocess.Popen([sys.executable, "-c", SERVER_TREE, WORKER, str(mib)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline() == "up\n"
        before_kib = tree_peak_rss_kib(server.pid)
        # Sampled only on entry and exit (the interval never elapses): a spike freed in between is seen
        # only through the kernel's high-water mark, and only by summing over the tree (the worker is
        # the server's child). The increase over the tree's own peak before is what the ballast adds.
        with ResourceSampler(server.pid, interval_s=3600) as sampler:
            server.stdin.write("go\n")
            server.stdin.flush()
            assert server.stdout.readline() == "freed\n"
        assert sampler.peak_rss_kib >= before_kib + 0.9 * mib * 1024, (before_kib, sampler.peak_rss_kib)
        assert sampler.peak_rss_gb == pytest.approx(sampler.peak_rss_kib / 2 ** 20)
    finally:
        server.stdin.close()
        server.wait(30)
    with ResourceSampler(2 ** 22 + 12345) as gone:  # beyond pid_max: no such process
        pass
    assert gone.peak_rss_gb is None


def test_gpu_memory_peak_sums_the_gpus_and_survives_a_lost_gpu(monkeypatch):
    # NVML is faked both ways, so this holds on a machine with GPUs and on one without.
    used = {0: 1 << 30, 1: 2 << 30}

    def memory_info(handle):
        if used[handle] is None:
            raise RuntimeError("GPU is lost")
        return SimpleNamespace(used=used[handle])

    nvml = SimpleNamespace(nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: 2,
                           nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetMemoryInfo=memory_info)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    with ResourceSampler(interval_s=3600) as sampler:  # sampled by hand below
        assert sampler.peak_gpu_mem_gb == pytest.approx(3.0)  # both GPUs, on entry
        used[1] = 6 << 30
        sampler.sample()
        used[1] = 3 << 30  # lower again: the peak stays
        sampler.sample()
        used[0] = None  # lost mid-run: sampling stops, the peak seen so far is kept
        sampler.sample()
        used[0] = 50 << 30
    assert sampler.peak_gpu_mem_gb == pytest.approx(7.0) and sampler.peak_rss_gb is None  # no pid: no RSS
    monkeypatch.setitem(sys.modules, "pynvml", None)  # no NVML library at all
    with ResourceSampler() as none:
        pass
    assert none.peak_gpu_mem_gb is None


# -- live, against the embedded engine over HTTP -----------------------------------------------------


@pytest.mark.slow
def test_live_metrics_are_consistent_with_the_server(embedded_server):
    before = scrape(embedded_server)
    result = run_benchmark(embedded_server, "repetitive", concurrency=2, num_requests=4, max_tokens=12,
                           progress=False, slo="p99_ttft_ms<60000; error_rate<0.5")
    after = scrape(embedded_server)
    s, frame = result.summary, result.requests
    assert (s["completed"], s["failed"]) == (4, 0) and s["slo_ok"]
    assert frame["tokens_from_usage"].all() and (frame["output_tokens"] == 12).all()  # ignore_eos holds the length
    # output tokens match the server's own counter over the run
    generated = after["autotune_generation_tokens_total"] - before["autotune_generation_tokens_total"]
    assert generated == s["total_output_tokens"] == 48
    assert (frame["ttft_ms"] <= frame["e2e_ms"]).all() and (frame["chunks"] >= 1).all()
    for m in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        values = [s[f"{m}_p{q}"] for q in (50, 90, 95, 99)]
        assert values == sorted(values) and all(v > 0 for v in values)
    # accept length from per-request usage equals the one from the server's /metrics counters
    assert s["accept_source"] == "usage" and s["server_metrics_source"] == "embedded"
    assert s["accept_length"] == pytest.approx(s["server_accept_length"], rel=1e-9)
    assert s["accept_rate"] == pytest.approx(s["server_accept_rate"], rel=1e-9)
    assert s["accept_length"] > 1.0  # ngram drafting on a rewrite-this-text prompt accepts something
    assert s["prompt_entropy_mean"] is not None and s["prompt_tokens_mean"] > 50


@pytest.mark.slow
def test_live_open_loop_errors_and_duration(embedded_server):
    # Poisson arrivals, all at once (rate=inf), through the completions endpoint
    result = run_benchmark(embedded_server, "code", rate=float("inf"), num_requests=3, max_tokens=4,
                           api="completions", progress=False)
    assert result.summary["completed"] == 3 and (result.requests["api"] == "completions").all()
    # the server rejects a bad field with 400: counted, not raised
    bad = run_benchmark(embedded_server, "chat", num_requests=2, extra_body={"temperature": 7}, progress=False)
    assert bad.summary["errors_by_kind"] == {"http_4xx": 2} and bad.summary["error_rate"] == 1.0
    # a duration bound ends a run that no request count would end; requests in flight then finish (where sends
    # stop is checked on a virtual clock: test_a_duration_bound_stops_sending_at_the_deadline...)
    timed = run_benchmark(embedded_server, "chat", duration=1.0, max_tokens=4, progress=False)
    assert timed.summary["completed"] >= 1 and timed.summary["failed"] == 0
    assert timed.summary["sent"] == len(timed.requests) == timed.summary["completed"]


def run_load_on_a_virtual_clock(monkeypatch, request_s: float, **load) -> tuple[list[RequestRecord], float, str | None]:
    """client.run_load with every request taking `request_s` of a virtual clock that nothing else advances:
    where a run stops sending is its own arithmetic, whatever this machine's speed. One worker at a time."""
    from autotune.bench import client

    clock, real_sleep = [0.0], asyncio.sleep

    async def send(http, base_url, request, body, index, t0, timeout):
        rec = RequestRecord(index=index, api=request["api"], start_s=clock[0] - t0)
        await real_sleep(0)
        clock[0] += request_s
        rec.e2e_s = request_s
        return rec

    requests = load_workload("chat").requests
    with monkeypatch.context() as patch:
        patch.setattr(client, "send", send)
        patch.setattr(client, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
        return asyncio.run(client.run_load("http://unused", requests, [{} for _ in requests],
                                           **{"rate": None, "seed": 0, "request_timeout": 5.0, **load}))


def test_a_duration_bound_stops_sending_at_the_deadline_and_lets_requests_in_flight_finish(monkeypatch):
    # 0.3 s a request, 1.0 s of duration, one at a time: sent at 0, 0.3, 0.6 and 0.9; the one sent at 0.9
    # finishes at 1.2, after the deadline, and nothing is sent after it.
    records, wall_s, stopped = run_load_on_a_virtual_clock(monkeypatch, 0.3, concurrency=1, num_requests=None,
                                                           duration=1.0)
    assert [r.start_s for r in records] == pytest.approx([0.0, 0.3, 0.6, 0.9])
    assert wall_s == pytest.approx(1.2) and stopped is None
    # whichever bound comes first ends the run
    records, wall_s, _ = run_load_on_a_virtual_clock(monkeypatch, 0.3, concurrency=1, num_requests=2, duration=1.0)
    assert len(records) == 2 and wall_s == pytest.approx(0.6)


@pytest.mark.slow
def test_killed_server_yields_counted_errors_in_bounded_time(start_embedded_server):
    server = start_embedded_server(drafter="none", verify_slots=2, max_seq_len=512)
    out = {}
    thread = threading.Thread(target=lambda: out.update(r=run_benchmark(
        server.url, "chat", concurrency=2, num_requests=40, max_tokens=24, request_timeout=30, progress=False,
        server_pid=server.proc.pid)))
    thread.start()
    # Killed mid-run, once the server has taken 3 requests (at 2 at a time the client has seen one finish): a
    # count, whatever this machine's speed. The 40 requests cannot all be done by then.
    while thread.is_alive():
        if (scrape(server.url) or {}).get("autotune_requests_total", 0) >= 3:
            os.killpg(server.proc.pid, signal.SIGKILL)
            break
        time.sleep(0.1)  # between looks at the server's counter
    # Bounded by the configuration, not by this machine: a client that waited on the dead server's streams
    # would end them only at their request_timeout (30 s), as "timeout" errors.
    thread.join(timeout=2 * 30)
    assert not thread.is_alive(), "the run did not end after the server died"
    s = out["r"].summary
    assert s["completed"] >= 1 and s["failed"] >= 1 and s["sent"] < 40
    assert set(s["errors_by_kind"]) <= {"stream_broken", "connect"}  # none waited out its timeout
    assert s["stopped_early"] and "unreachable" in s["stopped_early"]
    assert s["peak_rss_gb"] and s["peak_rss_gb"] > 0.1  # the server's own RSS, sampled before it died


class _Failing:
    """A server that answers 503 to everything: a real engine cannot be made to do this on demand."""

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 503, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"overloaded"})


class _Stalling:
    """A server that starts a stream and then sends nothing for HOLD_S unless the client leaves: a request
    longer than a short timeout at any speed, which no real engine guarantees. After HOLD_S it ends the stream
    properly, so that a client ignoring its timeout counts a completed request instead of hanging."""

    HOLD_S = 60.0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["method"] != "POST":
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
        await send({"type": "http.response.body", "body": f"data: {json.dumps(role)}\n\n".encode(), "more_body": True})
        try:  # the next receive() is the client's disconnect
            await asyncio.wait_for(receive(), self.HOLD_S)
            return
        except asyncio.TimeoutError:
            pass
        last = {"choices": [{"index": 0, "delta": {"content": "late"}, "finish_reason": "length"}]}
        await send({"type": "http.response.body", "body": f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n".encode()})


def serve_in_a_thread(app):
    """(url, stop) of `app` under uvicorn in this process."""
    import uvicorn

    listening = socket.socket()  # bound and listening before uvicorn starts: no port to lose to anyone
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    port = listening.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listening]}, daemon=True)
    thread.start()
    while not server.started:  # the thread's own progress; pytest's timeout guards a hang
        assert thread.is_alive(), "the server thread died before it started"
        time.sleep(0.02)

    def stop():
        server.should_exit = True
        thread.join(5)
        listening.close()

    return f"http://127.0.0.1:{port}", stop


@pytest.fixture(scope="module")
def failing_server():
    url, stop = serve_in_a_thread(_Failing())
    yield url
    stop()


@pytest.fixture(scope="module")
def stalling_server():
    url, stop = serve_in_a_thread(_Stalling())
    yield url
    stop()


def test_a_request_longer_than_its_timeout_is_cut_off_at_the_timeout(stalling_server):
    # The server holds the stream for a minute: only the client's 0.3 s timeout can end it first, on any machine.
    result = run_benchmark(stalling_server, "chat", num_requests=1, max_tokens=96, request_timeout=0.3, model="m",
                           progress=False)
    assert result.summary["errors_by_kind"] == {"timeout": 1} and result.summary["completed"] == 0
    # not before it either (a lower bound on a wait: a slower machine only adds to it)
    assert result.summary["duration_s"] >= 0.3 - 1e-3


def test_http_5xx_is_counted(failing_server):
    result = run_benchmark(failing_server + "/v1", "chat", concurrency=2, num_requests=4, model="m", progress=False)
    assert result.summary["errors_by_kind"] == {"http_5xx": 4}
    assert "overloaded" in result.requests["error"].iloc[0]


def open_loop_schedule(monkeypatch, rate: float, n: int, seed: int) -> list[float]:
    """The send times the open loop (client.run_load) chooses, on a virtual clock: sleeping advances it,
    sending records it. No server, no waiting, nothing of this machine's speed in the numbers."""
    from autotune.bench import client

    clock, real_sleep = [0.0], asyncio.sleep

    async def sleep(seconds):
        await real_sleep(0)  # the requests due so far are sent at the current time
        clock[0] += max(0.0, seconds)

    async def send(http, base_url, request, body, index, t0, timeout):
        return RequestRecord(index=index, api=request["api"], start_s=clock[0] - t0)

    class VirtualAsyncio:
        def __getattr__(self, name):
            return sleep if name == "sleep" else getattr(asyncio, name)

    requests = load_workload("chat").requests
    with monkeypatch.context() as patch:
        patch.setattr(client, "send", send)
        patch.setattr(client, "asyncio", VirtualAsyncio())
        patch.setattr(client, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
        records, _, _ = asyncio.run(client.run_load("http://unused", requests, [{} for _ in requests],
                                                    concurrency=None, rate=rate, num_requests=n, duration=None,
                                                    seed=seed, request_timeout=5.0))
    return sorted(r.start_s for r in records)


@pytest.mark.parametrize("rate", [0.5, 5.0, 200.0])
def test_open_loop_arrivals_are_poisson_at_the_rate(monkeypatch, rate):
    from scipy import stats

    for seed in (0, 1, 2):
        starts = open_loop_schedule(monkeypatch, rate, 2001, seed)
        assert len(starts) == 2001 and starts[0] == 0.0
        gaps = [(b - a) * rate for a, b in itertools.pairwise(starts)]  # in units of the mean gap 1/rate
        m = len(gaps)
        # Exponential gaps of mean 1/rate: the mean within 4 standard errors (sd = mean for an
        # exponential), the coefficient of variation near 1 (its standard error is about sqrt(2/m)), the
        # whole distribution by Kolmogorov-Smirnov. Even or uniformly random gaps fail the CV, a wrong
        # rate the mean.
        assert abs(statistics.mean(gaps) - 1) < 4 / math.sqrt(m), (seed, statistics.mean(gaps))
        assert abs(statistics.stdev(gaps) / statistics.mean(gaps) - 1) < 5 * math.sqrt(2 / m), seed
        assert stats.kstest(gaps, "expon").pvalue > 1e-3, seed
        # Successive gaps are independent (Poisson arrivals are memoryless): lag-1 correlation near 0.
        assert abs(stats.pearsonr(gaps[:-1], gaps[1:]).statistic) < 4 / math.sqrt(m), seed
    assert open_loop_schedule(monkeypatch, rate, 50, 7) == open_loop_schedule(monkeypatch, rate, 50, 7)  # seeded
    assert open_loop_schedule(monkeypatch, rate, 50, 7) != open_loop_schedule(monkeypatch, rate, 50, 8)
    assert open_loop_schedule(monkeypatch, float("inf"), 20, 7) == [0.0] * 20  # rate=inf: all at once


def test_open_loop_sends_on_its_schedule_never_early(failing_server, monkeypatch):
    # In real time a busy machine only delays a send; none may go out before its scheduled time, so the
    # last goes out no earlier than the schedule's last arrival (not all at once).
    rate, n, seed = 20.0, 20, 3
    starts = sorted(run_benchmark(failing_server, "chat", rate=rate, num_requests=n, seed=seed, model="m",
                                  progress=False).requests["start_s"])
    schedule = open_loop_schedule(monkeypatch, rate, n, seed)
    assert len(starts) == n and schedule[-1] > 0.2
    assert all(real >= planned - 5e-3 for real, planned in zip(starts, schedule)), list(zip(starts, schedule))


@pytest.mark.slow
def test_cli_bench_writes_json_and_parquet(embedded_server, tmp_path):
    out = tmp_path / "res.json"
    run = CliRunner().invoke(app, ["bench", "--url", embedded_server, "--workload", "chat", "--sweep", "1,2",
                                   "--num-requests", "2", "--max-tokens", "4", "--out", str(out)])
    assert run.exit_code == 0, run.output
    doc = json.loads(out.read_text())
    assert [s["concurrency"] for s in doc["sweep"]] == [1, 2]
    rows = pd.read_parquet(out.with_suffix(".parquet"))
    assert len(rows) == len(doc["requests"]) == 4 and rows["ok"].all()
    bad = CliRunner().invoke(app, ["bench", "--url", embedded_server, "--slo", "p95_ttft<5"])
    assert bad.exit_code == 2 and "unknown SLO metric 'p95_ttft'" in bad.output and "Traceback" not in bad.output


# -- a peer client on the same stream ----------------------------------------------------------------


def record_stream(url: str, body: dict) -> list[bytes]:
    """The SSE events (each ending in a blank line) of one streamed request to the live server."""
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        raw = response.read()
    return [event + b"\n\n" for event in raw.split(b"\n\n") if event.strip()]


def replaying(events: list[bytes], clock: list[float]) -> httpx.MockTransport:
    """Answers any request with `events`, setting the virtual clock to i just before the i-th event goes out
    (1-based): whoever stamps a chunk on receipt reads its index, whatever this machine's speed."""

    class Events(httpx.AsyncByteStream):
        async def __aiter__(self):
            for i, event in enumerate(events, 1):
                clock[0] = float(i)
                yield event

    return httpx.MockTransport(lambda request: httpx.Response(200, headers={"content-type": "text/event-stream"},
                                                              stream=Events()))


async def _openai_timing(transport: httpx.MockTransport, clock: list[float], request: dict, model: str):
    """TTFT (on the virtual clock) and completion tokens of one request, timed with the official openai client
    as its users time it: from the call to the first chunk carrying text."""
    import openai

    client = openai.AsyncOpenAI(base_url="http://replay/v1", api_key="none", max_retries=0,
                                http_client=httpx.AsyncClient(transport=transport))
    body = {k: v for k, v in request.items() if k not in ("api", "messages")}
    t0 = clock[0]
    stream = await client.chat.completions.create(model=model, messages=request["messages"], stream=True,
                                                  stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True}, **body)
    ttft, tokens = None, None
    async for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = clock[0] - t0
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    await client.close()
    return ttft, tokens


@pytest.mark.slow
def test_openai_client_agrees_on_tokens_and_ttft(embedded_server, monkeypatch):
    # The live server's own streams, recorded, then replayed to both clients on a virtual clock that ticks once
    # per SSE event: each client's TTFT is the index of the event it stamps, so the two must agree exactly, and
    # on the first event that carries text. Timed against a real clock the same comparison swings by 2x on a
    # shared machine (benchmarks/bench_client_crosscheck.py compares real timings on a quiet one).
    from autotune.bench import client
    from autotune.bench.client import request_body

    requests = [dict(r, max_tokens=8) for r in load_workload("chat").requests[:4]]
    model = httpx.get(embedded_server + "/v1/models").json()["data"][0]["id"]
    clock = [0.0]

    class ReplayingHttpx:
        def __getattr__(self, name):
            return getattr(httpx, name)

        def AsyncClient(self, **kwargs):  # httpx's name
            return httpx.AsyncClient(transport=transport, **kwargs)

    monkeypatch.setattr(client, "httpx", ReplayingHttpx())
    monkeypatch.setattr(client, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    ours, theirs, first_text = [], [], []
    for r in requests:
        body = request_body(r, model, None, True, None)
        events = record_stream(embedded_server, body)
        payloads = [json.loads(e[len(b"data: "):]) for e in events if e.strip() != b"data: [DONE]"]
        first_text.append(1.0 + next(i for i, p in enumerate(payloads) if p["choices"]
                                     and p["choices"][0]["delta"].get("content")))
        transport = replaying(events, clock)
        clock[0] = 0.0
        records, _, _ = asyncio.run(client.run_load("http://replay", [r], [body], concurrency=1, rate=None,
                                                    num_requests=1, duration=None, seed=0, request_timeout=60))
        frame = requests_frame(records)
        ours.append((frame["ttft_ms"].iloc[0] / 1000, frame["output_tokens"].iloc[0]))
        clock[0] = 0.0
        theirs.append(asyncio.run(_openai_timing(transport, clock, r, model)))
    assert [t for _, t in ours] == [t for _, t in theirs] == [8] * 4
    # A wrong definition fails here: stamping the role-only first chunk (event 1) or the end of the stream.
    assert [t for t, _ in ours] == [t for t, _ in theirs] == first_text, (ours, theirs, first_text)
    assert all(t >= 2 for t in first_text)  # the role chunk comes first: the two definitions differ
