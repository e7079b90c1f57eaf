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
from autotune.embedded.openai_api import BadRequest, parse_request
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
