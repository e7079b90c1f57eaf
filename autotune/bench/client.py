"""The load client: streams OpenAI requests (httpx, asyncio) in closed loop or with Poisson arrivals.

Timing follows sglang.bench_serving / vllm bench serve: TTFT is send -> first chunk carrying text,
E2E is send -> end of stream, every content chunk is timestamped. Each request's whole exchange is
bounded by request_timeout and the run by its count and duration, so a dead server cannot hang it.
"""
import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

ERROR_KINDS = ("connect", "timeout", "http_4xx", "http_5xx", "stream_broken", "other")
ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass
class RequestRecord:
    index: int  # position of the request in the workload
    api: str
    start_s: float = 0.0  # send time, seconds since the measured phase began
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)  # arrival of each content chunk, since send
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each content chunk (1 if not reported)
    chunk_tokens_reported: bool = False  # the server put usage on content chunks (continuous usage stats)
    usage: dict = field(default_factory=dict)  # the server's final usage (plus meta_info where given)
    finish_reason: str | None = None
    text: str = ""
    error_kind: str | None = None
    error: str | None = None
    http_status: int | None = None


def request_body(request: dict, model: str, max_tokens: int | None, ignore_eos: bool, extra_body: dict | None):
    body = {k: v for k, v in request.items() if k != "api"}
    body.update(model=body.get("model", model), stream=True,
                # usage on the final chunk; continuous_usage_stats gives token counts per chunk (vLLM, SGLang)
                stream_options={"include_usage": True, "continuous_usage_stats": True})
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if ignore_eos:
        body.setdefault("ignore_eos", True)
    body.update(extra_body or {})
    return body


async def send(client: httpx.AsyncClient, base_url: str, request: dict, body: dict, index: int,
               t0: float, timeout: float) -> RequestRecord:
    """One streamed request; every failure becomes an error kind on the record, never an exception."""
    rec = RequestRecord(index=index, api=request["api"])
    sent = time.perf_counter()
    rec.start_s = sent - t0
    try:
        await asyncio.wait_for(exchange(client, base_url + ENDPOINTS[request["api"]], body, rec, sent), timeout)
    except asyncio.TimeoutError:
        return failed(rec, "timeout", f"no complete response within {timeout:g} s")
    except (httpx.ConnectError, httpx.ConnectTimeout) as e:
        return failed(rec, "connect", str(e) or type(e).__name__)
    except httpx.TimeoutException as e:
        return failed(rec, "timeout", str(e) or type(e).__name__)
    except (httpx.TransportError, httpx.StreamError, json.JSONDecodeError, UnicodeDecodeError) as e:
        return failed(rec, "stream_broken", f"{type(e).__name__}: {e}")
    except Exception as e:  # noqa: BLE001 - a result, never a traceback: the run must finish and count it
        return failed(rec, "other", f"{type(e).__name__}: {e}")
    return rec


async def exchange(client: httpx.AsyncClient, url: str, body: dict, rec: RequestRecord, sent: float):
    done = False
    async with client.stream("POST", url, json=body) as resp:
        rec.http_status = resp.status_code
        if resp.status_code >= 400:
            detail = (await resp.aread())[:300].decode("utf-8", "replace")
            failed(rec, "http_4xx" if resp.status_code < 500 else "http_5xx", f"HTTP {resp.status_code}: {detail}")
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                done = True
                break
            read_chunk(rec, json.loads(payload), time.perf_counter() - sent)
            if rec.error_kind:
                return
    rec.e2e_s = time.perf_counter() - sent
    if not (done or rec.finish_reason):
        failed(rec, "stream_broken", "stream ended without [DONE] or a finish_reason")
    elif rec.ttft_s is None:
        rec.ttft_s = rec.e2e_s  # no text at all (e.g. max_tokens=0): first token = end


def failed(rec: RequestRecord, kind: str, message: str) -> RequestRecord:
    rec.error_kind, rec.error = kind, message[:500]
    return rec


def timings_usage(timings: dict) -> dict:
    """llama-server's `timings` as speculative counters: the prefill yields the first token, then every
    verify step its accepted drafts plus one of the target's, so steps = tokens predicted - 1 - accepted.
    Without a drafter (no draft_n) every decode step is a plain one: nothing proposed, predicted - 1 steps."""
    predicted = timings.get("predicted_n")
    drafted, accepted = timings.get("draft_n", 0), timings.get("draft_n_accepted", 0)
    if not predicted:
        return {}
    steps = predicted - 1 - accepted
    if steps < 1:  # drafts accepted past max_tokens are counted but not delivered: no step count to trust
        return {}
    return {"spec_draft_tokens": drafted, "spec_accepted_tokens": accepted, "spec_verify_steps": steps}


def read_chunk(rec: RequestRecord, chunk: dict, t: float):
    if "error" in chunk:
        err = chunk["error"]
        failed(rec, "stream_broken", f"server error in stream: {err.get('message', err) if isinstance(err, dict) else err}")
        return
    usage = chunk.get("usage") or {}
    previous = rec.usage.get("completion_tokens")
    rec.usage.update(usage)
    if isinstance(chunk.get("meta_info"), dict):  # SGLang native fields (spec_verify_ct)
        rec.usage.update(chunk["meta_info"])
    if isinstance(chunk.get("timings"), dict):  # llama.cpp's server: draft_n / draft_n_accepted per request
        rec.usage.update(timings_usage(chunk["timings"]))
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        text = choice.get("text") or delta.get("content") or delta.get("reasoning_content") or ""
        if text:
            if rec.ttft_s is None:
                rec.ttft_s = t
            rec.chunk_times_s.append(t)
            now = usage.get("completion_tokens")
            # per-chunk usage (continuous stats) says how many tokens the chunk carried; else one each
            rec.chunk_tokens.append(max(1, now - (previous or 0)) if now is not None else 1)
            rec.chunk_tokens_reported = rec.chunk_tokens_reported or now is not None
            rec.text += text
        if choice.get("finish_reason"):
            rec.finish_reason = choice["finish_reason"]


async def run_load(base_url: str, requests: list[dict], bodies: list[dict], *, concurrency: int | None,
                   rate: float | None, num_requests: int | None, duration: float | None, seed: int,
                   request_timeout: float, on_done=None) -> tuple[list[RequestRecord], float, str | None]:
    """Send requests (cycling through the workload) until num_requests are sent or duration is over.

    Closed loop: `concurrency` workers, each sends its next request when the last one finishes.
    Open loop: Poisson arrivals at `rate` req/s (inf: all at once), capped at `concurrency` in flight
    if given. Returns (records, wall seconds of the measured phase, reason it stopped early or None).
    """
    records: list[RequestRecord] = []
    state = {"next": 0, "connect_fails": 0, "stopped": None}
    # A server that refuses connections fails every request at once: stop instead of spinning.
    unreachable_after = max(8, 2 * (concurrency or 1))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    t0 = time.perf_counter()
    deadline = t0 + duration if duration else None

    def take() -> int | None:
        i = state["next"]
        if state["stopped"] or (num_requests is not None and i >= num_requests):
            return None
        if deadline is not None and time.perf_counter() >= deadline:
            return None
        state["next"] += 1
        return i

    async def one(client, i):
        k = i % len(requests)
        rec = await send(client, base_url, requests[k], bodies[k], k, t0, request_timeout)
        records.append(rec)
        state["connect_fails"] = state["connect_fails"] + 1 if rec.error_kind == "connect" else 0
        if state["connect_fails"] >= unreachable_after:
            state["stopped"] = f"server unreachable ({state['connect_fails']} connection failures in a row)"
        if on_done:
            on_done(rec)

    async with httpx.AsyncClient(timeout=httpx.Timeout(request_timeout, connect=min(10.0, request_timeout)),
                                 limits=limits) as client:
        if rate is None:
            async def worker():
                while (i := take()) is not None:
                    await one(client, i)
            await asyncio.gather(*(worker() for _ in range(concurrency or 1)))
        else:
            rng = random.Random(seed)
            cap = asyncio.Semaphore(concurrency) if concurrency else None
            tasks, next_at = [], t0

            async def capped(i):
                if cap is None:
                    return await one(client, i)
                async with cap:
                    if not state["stopped"]:
                        await one(client, i)

            while (i := take()) is not None:
                tasks.append(asyncio.create_task(capped(i)))
                if rate != float("inf"):
                    next_at += rng.expovariate(rate)
                    wait = next_at - time.perf_counter()
                    if deadline is not None:
                        wait = min(wait, deadline - time.perf_counter())
                    if wait > 0:
                        await asyncio.sleep(wait)
            await asyncio.gather(*tasks)
    return records, time.perf_counter() - t0, state["stopped"]
