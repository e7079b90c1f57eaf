"""The embedded server's limits, live (`autotune serve` over HTTP): what a request may ask, as a property.

Hypothesis draws request bodies from the schema openai_api documents: every body it allows must get 200 and
a well-formed response, every body it does not allow (one field broken at a time, or a body that is no JSON
object) must get 400 with `param` naming the field, refused before the engine sees it (its /metrics counters do
not move). The server must stay healthy and its /metrics must count every request sent, by status. Then
`--request-timeout`: a request that outlives it, running or queued, ends with finish_reason "length" and frees
its slot. Nothing here is timed against this machine's speed: what is checked is counted.
"""
import json
import subprocess
import sys
import time
from collections import Counter
from functools import partial

import httpx
import pytest
from conftest import EmbeddedServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autotune.embedded.bundled import bundled_gguf_path
from autotune.embedded.config import MAX_DRAFT_LENGTH
from autotune.embedded.gguf_header import read_header
from autotune.embedded.openai_api import INT32_MAX, ROLES, UNSUPPORTED
from autotune.embedded.tokenizer import tokenizer_from_gguf

CONTEXT = 512  # the allowed bodies' prompts stay far below it, whatever characters they hold
VOCAB = 49152  # the bundled SmolLM2-135M's
MAX_TOKENS = 4  # small: every allowed body generates, on a shared 2-core machine
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
sent: Counter = Counter()  # (path, status) -> requests this module sent to the validation server


@pytest.fixture(scope="module")
def server():
    server = EmbeddedServer(drafter="ngram", draft_length=3, verify_slots=2, max_seq_len=CONTEXT)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        client.model = client.get("/v1/models").json()["data"][0]["id"]
        yield client
    server.stop()


# -- the schema as strategies -----------------------------------------------------------------------------
num = partial(st.floats, allow_nan=False, allow_infinity=False)  # what json.dumps writes as a JSON number
text = st.text(st.characters(exclude_categories=("Cs",)), max_size=20)  # JSON strings (no lone surrogates)
nonempty = text.filter(bool)
other_json = st.one_of(st.none(), st.booleans(), st.integers(), num(), text,
                       st.lists(st.integers(), max_size=2), st.dictionaries(text, st.integers(), max_size=2))


def not_number(integer: bool):
    """JSON values a number (or an integer) field refuses: never null, which means "the default"; for an
    integer, any float too (16.0 included)."""
    wrong = other_json.filter(lambda v: v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))))
    return st.one_of(wrong, num()) if integer else wrong


# field -> (values allowed, values refused), the ranges of openai_api's docstring
FIELDS = {
    "temperature": (num(0, 2), st.one_of(num(max_value=0, exclude_max=True), num(min_value=2, exclude_min=True), not_number(False))),
    "top_p": (num(0, 1, exclude_min=True), st.one_of(num(max_value=0), num(min_value=1, exclude_min=True), not_number(False))),
    "top_k": (st.integers(-1, 200), st.one_of(st.integers(max_value=-2), st.integers(min_value=INT32_MAX + 1), not_number(True))),
    "repetition_penalty": (num(0.5, 2), st.one_of(num(max_value=0), num(min_value=10, exclude_min=True), not_number(False))),
    "seed": (st.integers(-2**63, 2**63 - 1), st.one_of(st.integers(min_value=2**63), st.integers(max_value=-2**63 - 1), not_number(True))),
    "n": (st.just(1), st.one_of(st.integers(max_value=0), st.integers(min_value=2), not_number(True))),
    "best_of": (st.just(1), st.one_of(st.integers(max_value=0), st.integers(min_value=2), not_number(True))),
    "draft_length": (st.integers(0, MAX_DRAFT_LENGTH), st.one_of(st.integers(max_value=-1), st.integers(min_value=MAX_DRAFT_LENGTH + 1), not_number(True))),
    "ignore_eos": (st.booleans(), other_json.filter(lambda v: v is not None and not isinstance(v, bool))),
    "stop": (st.one_of(nonempty, st.lists(nonempty, min_size=1, max_size=3)),
             st.one_of(st.just(""), st.lists(st.integers(), min_size=1, max_size=2), st.integers(), st.just([""]))),
}
# Values of the unsupported fields that mean "off" (allowed) and some that do not (refused).
UNSUPPORTED_ON = {
    "logprobs": st.one_of(st.just(True), st.integers(0, 5)), "top_logprobs": st.integers(1, 5),
    "echo": st.just(True), "presence_penalty": num(0.1, 2), "frequency_penalty": num(-2, -0.1),
    "logit_bias": st.just({"50": -100}), "min_tokens": st.integers(1, 9),
    "tools": st.just([{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    "response_format": st.just({"type": "json_object"}), "guided_regex": st.just("a+"),
    "use_beam_search": st.just(True), "skip_special_tokens": st.just(False), "stop_token_ids": st.just([2]),
}


def message():
    content = st.one_of(text, st.lists(st.builds(lambda t: {"type": "text", "text": t}, text), min_size=1, max_size=2))
    return st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": content}, optional={"name": nonempty})


# A prompt the tokenizer reads as no tokens at all ("\x1d": its normalizer drops it) is refused, naming 'prompt'.
TOKENIZER = tokenizer_from_gguf(read_header(bundled_gguf_path()).meta)
tokens = nonempty.filter(lambda t: TOKENIZER.encode(t))


def prompt():
    ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20)
    return st.one_of(tokens, ids, tokens.map(lambda t: [t]), ids.map(lambda i: [i]))


@st.composite
def allowed(draw, api: str, model: str) -> dict:
    body = {"messages": draw(st.lists(message(), min_size=1, max_size=2))} if api == "chat" else {"prompt": draw(prompt())}
    body[draw(st.sampled_from(["max_tokens", "max_completion_tokens"]))] = draw(st.integers(1, MAX_TOKENS))
    for name in draw(st.sets(st.sampled_from(sorted(FIELDS)), max_size=5)):
        body[name] = draw(st.one_of(st.none(), FIELDS[name][0]))
    for name in draw(st.sets(st.sampled_from(sorted(UNSUPPORTED)), max_size=2)):  # their "off" values
        body[name] = draw(st.sampled_from(UNSUPPORTED[name]))
    if draw(st.booleans()):
        body["stream"] = True
        if draw(st.booleans()):
            body["stream_options"] = {"include_usage": draw(st.booleans())}
    if draw(st.booleans()):
        body["model"] = draw(st.sampled_from([model, "", None]))
    if draw(st.booleans()):  # fields nobody defines are ignored, as vLLM ignores them
        body[draw(st.sampled_from(["user", "metadata", "store", "x_trace"]))] = draw(other_json)
    return body


@st.composite
def refused(draw, api: str, model: str) -> tuple[bytes, str | None]:
    """(raw body, the param the 400 must name): an allowed body with one thing broken."""
    body = draw(allowed(api, model))
    kind = draw(st.sampled_from(["field", "unsupported", "context", "stream_options", "model", "prompt", "raw"]))
    param = kind
    if kind == "field":
        param = draw(st.sampled_from(sorted(FIELDS)))
        body[param] = draw(FIELDS[param][1])
    elif kind == "unsupported":
        param = draw(st.sampled_from(sorted(UNSUPPORTED_ON)))
        body[param] = draw(UNSUPPORTED_ON[param])
    elif kind == "context":  # max_tokens beyond what the context leaves after the prompt (>= 1 token)
        body.pop("max_completion_tokens", None)
        param, body["max_tokens"] = "max_tokens", draw(st.integers(CONTEXT, 10**15))
    elif kind == "stream_options":
        body["stream"] = draw(st.sampled_from([False, None]))
        body["stream_options"] = {"include_usage": True}
    elif kind == "model":
        body["model"] = draw(st.one_of(nonempty.filter(lambda m: m != model), st.integers(), st.lists(text, max_size=1)))
    elif kind == "prompt" and api == "chat":
        param = "messages"
        body["messages"] = draw(st.one_of(
            st.just([]), text, st.just([{"role": "user"}]),  # no content: the empty turn
            st.builds(lambda r: [{"role": r, "content": "hi"}], text.filter(lambda r: r not in ROLES)),
            st.just([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
            st.just([{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]),
            st.builds(lambda v: [{"role": "user", "content": v}], st.one_of(st.integers(), st.booleans())),
            st.just(["hi"])))
    elif kind == "prompt":
        body["prompt"] = draw(st.one_of(
            st.just(""), st.just("\x1d"), st.just([]), st.integers(), st.just({"text": "hi"}),
            st.lists(nonempty, min_size=2, max_size=3),
            st.lists(st.integers(VOCAB, 10**12), min_size=1, max_size=3), st.just([-1]), st.just([True])))
    else:  # not a JSON object at all
        param = None
        return draw(st.sampled_from([b'{"prompt": "hi", ', b"[1, 2]", b"null", b"42", b'"hi"', b"\xff\xfe",
                                     b'{"prompt": "hi", "temperature": NaN}', b"[" * 100000])), param
    return json.dumps(body).encode(), param


# -- checks -----------------------------------------------------------------------------------------------
def post(client: httpx.Client, api: str, raw: bytes) -> tuple[httpx.Response, list[dict] | None]:
    """(response, stream payloads or None)."""
    response = client.post(PATHS[api], content=raw, headers={"content-type": "application/json"})  # streams read whole
    sent[PATHS[api], response.status_code] += 1
    if not response.headers["content-type"].startswith("text/event-stream"):
        return response, None
    lines = [line for line in response.text.splitlines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines), lines
    return response, [json.loads(line[6:]) for line in lines[:-1]]


# What the engine counts of the work it is given (autotune/embedded/metrics.py): a request the server refuses
# must move none of them.
ENGINE_WORK = ("autotune_requests_total", "autotune_prompt_tokens_total", "autotune_generation_tokens_total")


def engine_work(client: httpx.Client) -> dict[str, float]:
    lines = client.get("/metrics").text.splitlines()
    return {name: float(value) for name, value in (line.split() for line in lines if line.split()[:1] and line.split()[0] in ENGINE_WORK)}


def check_response(body: dict, api: str, model: str, response: httpx.Response, payloads: list[dict] | None):
    assert response.status_code == 200, (body, response.text)
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    stops = [body["stop"]] if isinstance(body.get("stop"), str) else body.get("stop") or []
    if payloads is None:
        assert not body.get("stream")
        whole = response.json()
        assert whole["model"] == model and whole["object"] == ("chat.completion" if api == "chat" else "text_completion")
        [choice] = whole["choices"]
        text = choice["message"]["content"] if api == "chat" else choice["text"]
        finish, usage = choice["finish_reason"], whole["usage"]
    else:
        assert body.get("stream") is True
        assert len({p["id"] for p in payloads}) == 1 and {p["model"] for p in payloads} == {model}
        choices = [p["choices"][0] for p in payloads if p["choices"]]
        pieces = [c["delta"].get("content", "") for c in choices] if api == "chat" else [c["text"] for c in choices]
        text, finish = "".join(pieces), choices[-1]["finish_reason"]
        assert all(c["finish_reason"] is None for c in choices[:-1])
        with_usage = (body.get("stream_options") or {}).get("include_usage")
        assert (payloads[-1]["choices"] == []) == bool(with_usage)
        usage = payloads[-1]["usage"] if with_usage else None
    assert isinstance(text, str) and finish in ("stop", "length")
    assert not any(s in text for s in stops)  # cut before the first stop string
    if usage is not None:
        assert usage["prompt_tokens"] >= 1 and 0 <= usage["completion_tokens"] <= limit
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), api=st.sampled_from(sorted(PATHS)))
def test_allowed_bodies_get_200_and_a_well_formed_response(server, data, api):
    body = data.draw(allowed(api, server.model))
    response, payloads = post(server, api, json.dumps(body).encode())
    check_response(body, api, server.model, response, payloads)


@settings(max_examples=250, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), api=st.sampled_from(sorted(PATHS)))
def test_refused_bodies_get_400_naming_the_field_before_the_engine_sees_them(server, data, api):
    raw, param = data.draw(refused(api, server.model))
    before = engine_work(server)
    response, _ = post(server, api, raw)
    assert response.status_code == 400, (raw[:300], response.text)
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"], error
    assert error["param"] == param, (raw[:300], error)
    # Refused up front, not after the engine took it (submitted, prefilled or generated): counted, not timed,
    # so that a loaded machine answers as slowly as it must.
    assert engine_work(server) == before and len(before) == len(ENGINE_WORK), (raw[:300], before)


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_of_no_tokens_is_refused_naming_it(server, stream):
    """Hypothesis's find on a fresh clone: "\x1d" is a non-empty string the tokenizer reads as no tokens, and the
    engine's "the prompt is empty" came back as a 500 server_error."""
    raw = json.dumps({"prompt": "\x1d", "max_tokens": 1, "stream": stream}).encode()
    before = engine_work(server)
    response, _ = post(server, "completions", raw)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text
    assert engine_work(server) == before


def test_server_stays_healthy_and_metrics_count_every_request(server):
    assert server.get("/health").json()["status"] == "ok"
    counted = {}
    for line in server.get("/metrics").text.splitlines():
        if line.startswith("autotune_http_requests_total{"):
            labels, value = line.split("} ")
            fields = dict(part.split("=") for part in labels.split("{")[1].split(","))
            counted[fields["path"].strip('"'), int(fields["status"].strip('"'))] = float(value)
    assert sent, "no request was sent"
    assert {k: v for k, v in counted.items() if k[0] in PATHS.values()} == dict(sent)
    stats = server.get("/metrics").text
    assert "autotune_requests_running 0.0" in stats and "autotune_requests_waiting 0.0" in stats


# -- the request timeout ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_request_timeout_ends_running_and_queued_requests_with_length(start_embedded_server):
    # 480 tokens without a drafter: far more than any CPU decodes in the 3 s (each token reads the model's
    # 540 MB of float32 weights), so both requests outlive their deadlines at any speed. What is checked is
    # counted (tokens, the server's timeout counter), never how long a loaded machine took.
    timeout = 3.0
    server = start_embedded_server(drafter="none", verify_slots=1, max_seq_len=CONTEXT, request_timeout=timeout)
    long = {"prompt": "def fibonacci(n):", "max_tokens": 480, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        start = time.monotonic()
        body = long | {"stream": True, "stream_options": {"include_usage": True}}
        with client.stream("POST", "/v1/completions", json=body) as running:
            assert running.status_code == 200
            lines = iter(running.iter_lines())
            first = next(line for line in lines if line.startswith("data: "))  # it holds the only slot now
            queued = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                               "max_tokens": 480, "ignore_eos": True})
            rest = [first] + [line for line in lines if line.startswith("data: ")]
        elapsed = time.monotonic() - start
        assert rest[-1] == "data: [DONE]"
        *chunks, last = [json.loads(line[6:]) for line in rest[:-1]]
        streamed = "".join(c["choices"][0]["text"] for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length" and streamed
        assert last["choices"] == [] and 0 < last["usage"]["completion_tokens"] < 480  # cut short by the deadline
        assert queued.status_code == 200, queued.text
        choice, usage = queued.json()["choices"][0], queued.json()["usage"]
        assert choice["finish_reason"] == "length" and usage["completion_tokens"] < 480  # cut short by the deadline
        # Not cut before it: the running request's deadline is `timeout` after it arrived, after `start` (a lower
        # bound that only grows on a slower machine).
        assert elapsed >= timeout
        after = client.get("/metrics").text
        assert "autotune_request_timeouts_total 2.0" in after  # both ended at their deadlines
        assert "autotune_requests_running 0.0" in after and "autotune_requests_waiting 0.0" in after
        again = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True})
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 2  # the slot is free


@pytest.mark.slow
def test_serve_refuses_a_bad_request_timeout_in_one_line():
    for value in ("0", "-3", "inf"):
        out = subprocess.run([sys.executable, "-m", "autotune.cli", "serve", "--request-timeout", value],
                             check=False, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and out.stderr.strip().count("\n") == 0, out.stderr
        assert "--request-timeout must be a positive number of seconds" in out.stderr
