"""The embedded engine's HTTP server, live: `autotune serve` with the real engine, over HTTP."""
import asyncio
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from autotune.embedded.config import GenerationEvent
from autotune.embedded.openai_api import StopStrings
from autotune.embedded.server import build_app

CODE_PROMPT = "def fibonacci(n):"
CHAT = [{"role": "user", "content": "Name three colours."}]


def sse_payloads(response: httpx.Response) -> list[dict]:
    """The JSON payloads of an SSE stream, checking it ends with `data: [DONE]`."""
    lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def streamed(client: httpx.Client, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json=body | {"stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return sse_payloads(response)


def scrape(client: httpx.Client) -> dict[str, float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    return {name: float(value) for name, value in
            (line.split() for line in response.text.splitlines() if line and not line.startswith("#"))}


def wait_idle(client: httpx.Client, timeout: float = 120.0, also=lambda metrics: True) -> dict[str, float]:
    """/metrics once the engine has nothing running or queued (and `also(metrics)` holds). The deadline only
    stops a hang: what the tests check is counted, so a loaded machine may take as long as it needs."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = scrape(client)
        if metrics["autotune_requests_running"] == 0 and metrics["autotune_requests_waiting"] == 0 and also(metrics):
            return metrics
        assert time.monotonic() < deadline, f"engine still busy: {metrics}"
        time.sleep(0.05)


def check_usage(usage: dict, max_tokens: int):
    """An ignore_eos request that ran to max_tokens: counts add up and spec stats agree with them."""
    assert usage["completion_tokens"] == max_tokens
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    steps, accepted = usage["spec_verify_steps"], usage["spec_accepted_tokens"]
    assert steps + accepted == usage["completion_tokens"]  # each verify step yields accepted + 1 tokens
    assert 0 <= accepted <= usage["spec_draft_tokens"]
    assert usage["accept_length"] == pytest.approx((accepted + steps) / steps)
    assert usage["accept_rate"] == pytest.approx(accepted / usage["spec_draft_tokens"] if usage["spec_draft_tokens"] else 0)
    # Mean next-token entropy (nats) over the prompt's first positions: every prompt here has more than one
    # token, and no distribution over the bundled model's 49,152 tokens is flatter than the uniform one.
    assert 0 < usage["prompt_entropy"] <= math.log(49152)


@pytest.fixture(scope="module")
def client(embedded_server):
    with httpx.Client(base_url=embedded_server, timeout=120) as c:
        yield c


def test_health_and_models(client):
    assert client.get("/health").json()["status"] == "ok"
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and len(models["data"]) == 1
    assert models["data"][0]["max_model_len"] == 1024


def test_completion_stream_equals_non_stream(client):
    body = {"prompt": [504, 28120, 30, 24987, 28, 94, 3138], "max_tokens": 12, "ignore_eos": True}  # token ids
    whole = client.post("/v1/completions", json=body).json()
    assert whole["object"] == "text_completion"
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"]
    assert whole["usage"]["prompt_tokens"] == len(body["prompt"])
    check_usage(whole["usage"], 12)

    chunks = streamed(client, "/v1/completions", body | {"stream_options": {"include_usage": True}})
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == choice["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["choices"] == [] and all(c["usage"] is None for c in chunks[:-1])
    usage = chunks[-1]["usage"]
    check_usage(usage, 12)
    assert usage["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    assert usage["prompt_entropy"] == pytest.approx(whole["usage"]["prompt_entropy"], rel=1e-4)  # same prompt, same model


def test_chat_stream_equals_non_stream(client):
    body = {"messages": CHAT, "max_tokens": 10, "ignore_eos": True}
    whole = client.post("/v1/chat/completions", json=body).json()
    assert whole["object"] == "chat.completion"
    message = whole["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"]
    check_usage(whole["usage"], 10)

    chunks = streamed(client, "/v1/chat/completions", body | {"stream_options": {"include_usage": True}})
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == message["content"]
    assert chunks[-1]["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    check_usage(chunks[-1]["usage"], 10)
    # Without include_usage there is no usage chunk and no usage key.
    plain = streamed(client, "/v1/chat/completions", body | {"max_tokens": 2})
    assert all("usage" not in c and c["choices"] for c in plain)


def test_metrics_count_requests_and_tokens(client):
    before = wait_idle(client)
    a = client.post("/v1/completions", json={"prompt": CODE_PROMPT, "max_tokens": 6, "ignore_eos": True}).json()
    chunks = streamed(client, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 5, "ignore_eos": True,
                                                       "stream_options": {"include_usage": True}})
    usages = [a["usage"], chunks[-1]["usage"]]
    after = wait_idle(client)
    delta = {name: after[name] - before.get(name, 0) for name in after}  # labelled series appear when first counted
    assert delta["autotune_requests_total"] == 2
    assert delta["autotune_generation_tokens_total"] == 11
    assert delta["autotune_prompt_tokens_total"] == sum(u["prompt_tokens"] for u in usages)
    assert delta["autotune_spec_verify_steps_total"] == sum(u["spec_verify_steps"] for u in usages)
    assert delta["autotune_spec_draft_tokens_total"] == sum(u["spec_draft_tokens"] for u in usages)
    assert delta["autotune_spec_accepted_tokens_total"] == sum(u["spec_accepted_tokens"] for u in usages)
    assert delta["autotune_spec_verify_seconds_total"] > 0
    steps, accepted = after["autotune_spec_verify_steps_total"], after["autotune_spec_accepted_tokens_total"]
    # Tokens per verify step; requests cut short by a stop may leave accepted tokens unused, hence the slack.
    assert after["autotune_spec_accept_length"] == pytest.approx((accepted + steps) / steps, rel=0.05)
    assert 0 <= after["autotune_spec_accept_rate"] <= 1


def test_stop_string_cuts_the_text(client):
    body = {"prompt": CODE_PROMPT, "max_tokens": 16, "ignore_eos": True}
    full = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = full[len(full) // 2: len(full) // 2 + 3]
    expected = full[: full.index(stop)]
    cut = client.post("/v1/completions", json=body | {"stop": [stop, "never appears"]}).json()
    assert (cut["choices"][0]["text"], cut["choices"][0]["finish_reason"]) == (expected, "stop")
    assert cut["usage"]["completion_tokens"] < 16
    chunks = streamed(client, "/v1/completions", body | {"stop": stop})
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_stop_strings_hold_back_partial_matches():
    stops = StopStrings(["END", "xyz"])
    assert stops.feed("abc E") == "abc "  # "E" may start "END"
    assert stops.feed("N") == ""
    assert stops.feed("X and") == "ENX and"
    assert stops.feed(" x") == " "
    assert stops.feed("yz tail") == "" and stops.stopped
    assert stops.feed("more") == "" and stops.flush() == ""
    unfinished = StopStrings(["END"])
    assert unfinished.feed("the EN") == "the " and unfinished.flush() == "EN"


BAD_REQUESTS = [
    ("/v1/completions", b'{"prompt": "hi", ', "not valid JSON"),
    ("/v1/completions", b'["hi"]', "JSON object"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, "gpt-4"),
    ("/v1/completions", {"prompt": list(range(1100))}, "context"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "10"}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": 2.5}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.1}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, "n=1"),
    ("/v1/completions", {"prompt": "hi", "stop": 3}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "hi", "draft_length": 99}, "draft_length"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": "hi", "top_k": 10**20}, "top_k"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "empty"),
    ("/v1/completions", {"prompt": [1, 10**9]}, "token ids"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "one prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, "content"),
]


def test_bad_requests_get_400_and_the_server_keeps_serving(client):
    for path, body, phrase in BAD_REQUESTS:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = client.post(path, content=raw, headers={"content-type": "application/json"})
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and phrase in error["message"], (body, error)
    good = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True})
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2


def test_client_disconnect_frees_the_slot(client, embedded_server):
    before = wait_idle(client)
    body = {"prompt": CODE_PROMPT, "max_tokens": 500, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                break  # one token arrived: hang up
    # A non-streamed request whose client leaves before any answer: sent on a socket that is closed once the
    # engine has taken the request (its counter says so), not after a guess at how long the answer takes.
    chat = json.dumps({"messages": CHAT, "max_tokens": 500, "ignore_eos": True}).encode()
    host, port = embedded_server.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port))) as impatient:
        impatient.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % (host.encode(), len(chat)) + chat)
        while scrape(client)["autotune_requests_total"] < before["autotune_requests_total"] + 2:
            time.sleep(0.02)  # between looks at the counter
        impatient.setblocking(False)
        with pytest.raises(BlockingIOError):
            impatient.recv(1)  # nothing answered yet
    left = 'autotune_http_requests_total{path="/v1/chat/completions",status="499"}'  # the client left unanswered
    after = wait_idle(client, also=lambda metrics: metrics.get(left, 0) > before.get(left, 0))
    assert after["autotune_requests_total"] - before["autotune_requests_total"] == 2
    # Both were cancelled long before their 500 tokens.
    assert after["autotune_generation_tokens_total"] - before["autotune_generation_tokens_total"] < 500
    assert after[left] - before.get(left, 0) == 1


def test_overload_queues_requests(client):
    before = wait_idle(client)
    results = []

    def ask(i: int):
        body = {"prompt": f"{i} + {i} =", "max_tokens": 3, "ignore_eos": True}
        results.append(httpx.post(f"{client.base_url}/v1/completions", json=body, timeout=120))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(7)]  # the server has 4 slots
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [200] * 7
    assert all(r.json()["usage"]["completion_tokens"] == 3 for r in results)
    after = wait_idle(client)
    assert after["autotune_generation_tokens_total"] - before["autotune_generation_tokens_total"] == 21


def test_runtime_knobs_round_trip(client):
    original = client.get("/admin/runtime").json()
    assert set(original) >= {"draft_length", "draft_policy", "ngram_min", "ngram_max"}
    try:
        updated = client.post("/admin/runtime", json={"draft_length": 1}).json()
        assert updated == original | {"draft_length": 1}
        assert client.get("/admin/runtime").json() == updated
        usage = client.post("/v1/completions", json={"prompt": CODE_PROMPT * 3, "max_tokens": 8,
                                                     "ignore_eos": True}).json()["usage"]
        assert usage["spec_draft_tokens"] <= usage["spec_verify_steps"]  # k = 1 now
        for bad in ({"draft_length": -1}, {"draft_length": "4"}, {"draft_policy": "magic"}, {"warp_speed": 9},
                    {"ngram_min": 5, "ngram_max": 2}, ["draft_length", 4]):
            response = client.post("/admin/runtime", json=bad)
            assert response.status_code == 400 and response.json()["error"]["message"], bad
        assert client.post("/admin/runtime", content=b"{oops").status_code == 400
        assert client.get("/admin/runtime").json() == updated  # a refused update changes nothing
    finally:
        client.post("/admin/runtime", json=original)
    assert client.get("/admin/runtime").json() == original


def test_openai_client(embedded_server):
    api = openai.OpenAI(base_url=f"{embedded_server}/v1", api_key="unused", max_retries=0)
    model = api.models.list().data[0].id
    extra = {"ignore_eos": True}
    chat = api.chat.completions.create(model=model, messages=CHAT, max_tokens=6, extra_body=extra)
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 6
    stream = api.chat.completions.create(model=model, messages=CHAT, max_tokens=6, extra_body=extra, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 6

    text = api.completions.create(model=model, prompt=CODE_PROMPT, max_tokens=6, extra_body=extra)
    assert text.choices[0].finish_reason == "length" and text.usage.completion_tokens == 6
    parts = api.completions.create(model=model, prompt=CODE_PROMPT, max_tokens=6, extra_body=extra, stream=True)
    assert "".join(c.choices[0].text for c in parts) == text.choices[0].text
    with pytest.raises(openai.BadRequestError, match="temperature"):
        api.completions.create(model=model, prompt=CODE_PROMPT, temperature=5)


@pytest.mark.slow
def test_small_context_caps_max_tokens_and_sigterm_exits_0(start_embedded_server):
    server = start_embedded_server(drafter="none", verify_slots=1, max_seq_len=256)
    full = httpx.post(f"{server.url}/v1/completions", timeout=60,  # the default max_tokens, 16, is capped
                      json={"prompt": list(range(100, 352)), "ignore_eos": True}).json()
    assert (full["choices"][0]["finish_reason"], full["usage"]["completion_tokens"]) == ("length", 4)  # 256 - 252
    asked = httpx.post(f"{server.url}/v1/completions", timeout=60,  # an explicit one is refused, as vLLM does
                       json={"prompt": list(range(100, 352)), "max_tokens": 50, "ignore_eos": True})
    assert asked.status_code == 400 and asked.json()["error"]["param"] == "max_tokens"

    # SIGTERM with a stream in flight: the stream ends with "abort" and [DONE], the server exits 0.
    payloads, first_token = [], threading.Event()

    def consume():
        body = {"prompt": CODE_PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line:
                    payloads.append(line)
                    first_token.set()

    reader = threading.Thread(target=consume)
    reader.start()
    assert first_token.wait(60)
    # Exit 0 within stop()'s grace (else SIGKILL: -9), and the stream ended by the abort rather than by running
    # its 200 tokens out (finish_reason "length"): what shows the server did not wait for it, at any speed.
    assert server.stop() == 0, server.log()[-2000:]
    reader.join(60)  # the stream's own timeout: the server is gone, its socket closed
    assert not reader.is_alive()
    assert payloads[-1] == "data: [DONE]"
    assert json.loads(payloads[-2][6:])["choices"][0]["finish_reason"] == "abort"
    assert "Traceback" not in server.log()


@pytest.mark.slow
def test_gguf_blocks_server_answers_as_the_float32_one(client, start_embedded_server):
    """--quantization gguf (the GGUF's own blocks through the C kernel) with n-gram drafting: the float32 greedy
    text up to a near tie (its 8-bit activations, as llama.cpp's, flip near ties: tests/embedded/test_kquants.py)."""
    server = start_embedded_server(quantization="gguf", drafter="ngram", draft_length=4, verify_slots=2, max_seq_len=1024)
    body = {"prompt": CODE_PROMPT, "max_tokens": 32, "ignore_eos": True}
    on_blocks = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
    in_float32 = client.post("/v1/completions", json=body).json()
    texts = [on_blocks["choices"][0]["text"], in_float32["choices"][0]["text"]]
    assert len(os.path.commonprefix(texts)) >= 40, texts  # the whole first body line: the function's code
    assert on_blocks["usage"]["completion_tokens"] == 32


@pytest.mark.slow
def test_serve_rejects_bad_flags_in_one_line(embedded_server):
    taken = embedded_server.rsplit(":", 1)[1]
    for flags, phrase, code in ((["--cuda-graph-batch-sizes", "1,x"], "cuda-graph", 2), (["--port", "0"], "port", 2),
                                (["--model", "/nonexistent/model.gguf"], "does not exist", 2),
                                (["--quantization", "gguf", "--dtype", "bfloat16"], "CPU in float32", 2),
                                (["--port", taken], "in use", 1)):
        done = subprocess.run([sys.executable, "-m", "autotune.cli", "serve", *flags], capture_output=True,
                              text=True, timeout=120, check=False)
        assert done.returncode == code, (flags, done.stderr)
        assert done.stderr.count("\n") == 1 and phrase in done.stderr and done.stderr.startswith("error:"), done.stderr


class CharTokenizer:
    vocab_size, stop_token_ids = 256, frozenset({0})

    def encode(self, text: str) -> list[int]:
        return list(text.encode("latin-1"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("latin-1")

    def apply_chat_template(self, messages: list[dict]) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages)


class FailingEngine:
    """The real engine reports a broken step as finish_reason "error"; a healthy engine cannot be made to."""

    max_seq_len, model_name, device, tokenizer = 64, "failing", "cpu", CharTokenizer()

    def __init__(self):
        self.cancelled = []

    def submit(self, request, on_event) -> int:
        on_event(GenerationEvent(self.tokenizer.encode(" partial")))
        on_event(GenerationEvent([], "error", len(request.prompt_ids), 8, error="engine step failed: boom"))
        return 7

    def cancel(self, request_id):
        self.cancelled.append(request_id)


def test_engine_errors_reach_the_client_as_errors():
    engine = FailingEngine()

    async def exchange():
        transport = httpx.ASGITransport(app=build_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            whole = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
            stream = await client.post("/v1/chat/completions", json={"messages": CHAT, "stream": True})
            health = await client.get("/health")
        return whole, stream, health

    whole, stream, health = asyncio.run(exchange())
    assert whole.status_code == 500 and "boom" in whole.json()["error"]["message"]
    payloads = sse_payloads(stream)
    assert payloads[0]["choices"][0]["delta"]["role"] == "assistant"
    assert payloads[1]["choices"][0]["delta"]["content"] == " partial"
    assert payloads[-1]["error"]["message"] == "engine step failed: boom"
    assert health.status_code == 200 and engine.cancelled == []  # finished requests are not cancelled
