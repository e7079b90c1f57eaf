"""The embedded engine and its OpenAI API share one source of sampling limits (config.MAX_TEMPERATURE,
MAX_REPETITION_PENALTY): a value the API accepts the engine runs, one past the limit both refuse."""
import json
import threading

import pytest

from autotune.embedded.config import (
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    EngineConfig,
    GenerationRequest,
    SamplingParams,
)
from autotune.embedded.openai_api import BadRequest, parse_request, request_fields
from autotune.embedded.scheduler import Engine


@pytest.fixture(scope="module")
def engine():
    engine = Engine(EngineConfig(drafter="ngram", draft_length=2, verify_slots=1, max_seq_len=64, threads=1))
    engine.start()
    yield engine
    engine.stop()


def engine_finish(engine, **params) -> str:
    """How the engine ends a two-token request with these sampling settings: "length" or "error"."""
    ended, last = threading.Event(), []

    def on_event(event):
        if event.finish_reason:
            last.append(event)
            ended.set()

    engine.submit(GenerationRequest(engine.tokenizer.encode("def add(a, b):"),
                                    SamplingParams(max_tokens=2, ignore_eos=True, seed=0, **params)), on_event)
    assert ended.wait(120), "request did not finish"
    return last[0].finish_reason


@pytest.mark.parametrize(("field", "limit"), [("temperature", MAX_TEMPERATURE),
                                              ("repetition_penalty", MAX_REPETITION_PENALTY)])
def test_api_and_engine_agree_at_the_limit(engine, field, limit):
    def api(value):
        body = json.dumps({"prompt": "hi", field: value}).encode()
        return parse_request(body, False, engine.tokenizer, engine.model_name, engine.max_seq_len)

    assert getattr(api(limit).params, field) == limit
    assert engine_finish(engine, **{field: limit}) == "length"
    with pytest.raises(BadRequest) as refused:
        api(limit + 0.5)
    assert refused.value.param == field
    assert engine_finish(engine, **{field: limit + 0.5}) == "error"


@pytest.mark.parametrize(("body", "param"), [
    ({"max_tokens": 16.0}, "max_tokens"),  # an integer field takes no float, however whole
    ({"max_tokens": "10"}, "max_tokens"),
    ({"temperature": True}, "temperature"),  # nor a number field a boolean
    ({"seed": 2**63}, "seed"),  # past int64: torch could not take it
    ({"top_k": -2}, "top_k"),
    ({"stop": ""}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options"),
    ({"model": 3}, "model"),
])
def test_a_field_of_the_wrong_kind_or_range_is_refused_by_name(body, param):
    with pytest.raises(BadRequest) as refused:
        request_fields(body, chat=False)
    assert refused.value.param == param and f"'{param}'" in refused.value.message


def test_fields_other_servers_have_are_left_to_the_unsupported_check():
    fields = request_fields({"prompt": "hi", "user": "x", "logprobs": True, "stop": ["a", "b"], "top_k": -1}, chat=False)
    assert fields.stop == ["a", "b"] and fields.top_k == -1 and fields.prompt == "hi"
