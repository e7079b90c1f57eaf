"""A request the estimator gives cap 0 runs exactly what a `draft_length: 0` request runs (issue 17).

On the real engine (bundled model), every target forward pass (its width and depth: a draft pass of the
early-exit drafter is a call with num_layers) and every step's input to the drafter (draft lengths, stop
thresholds, whether the target's law signals are asked for) are recorded for both requests: they must be
the same, and there must be no draft pass. The work is counted, not timed.
"""
import json
import threading

import pytest

from autotune.embedded.config import EngineConfig, GenerationRequest, SamplingParams
from autotune.embedded.scheduler import Engine

PROMPT = "def area(width, height):\n    return width * height\n\n# Same function, with type hints:\ndef area("
EARLY_EXIT_LAYERS = 20
# Every cap 0, and a stop rule whose threshold applies to every temperature: a cap-0 request has nothing to stop.
CAP_ZERO = {"feature": "prompt_tokens", "thresholds": [], "temperature_edges": [], "k_table": [[0]],
            "stop_rule": {"signal": "entropy", "temperature_edges": [], "thresholds": [0.5]}}


class Recorded:
    """The engine's target runner, every call recorded as (width, num_layers, which logits)."""

    def __init__(self, runner):
        self.runner, self.calls = runner, []

    def __call__(self, input_ids, input_pos, rows, kv_len, num_layers=None, **head):
        self.calls.append((input_ids.shape[1], num_layers, tuple(sorted(head.items()))))
        return self.runner(input_ids, input_pos, rows, kv_len, num_layers=num_layers, **head)

    def __getattr__(self, name):
        return getattr(self.runner, name)


def recording_engine(tmp_path, drafter: str) -> Engine:
    (tmp_path / "cap_zero.json").write_text(json.dumps(CAP_ZERO))
    engine = Engine(EngineConfig(drafter=drafter, early_exit_layers=EARLY_EXIT_LAYERS, draft_policy="estimator",
                                 draft_estimator=str(tmp_path / "cap_zero.json"), verify_slots=1, max_seq_len=256,
                                 threads=1))
    engine.target = Recorded(engine.target)
    engine.steps = []
    propose = engine.drafter.propose

    def recorded_propose(step):
        engine.steps.append((step.draft_lengths, step.stop_above, step.trace, step.target_signals is not None,
                             step.kv_len))
        return propose(step)

    engine.drafter.propose = recorded_propose
    return engine


def run(engine: Engine, **params) -> tuple[list, list, list, object]:
    """One greedy request alone on the engine: (target calls, drafter step inputs, tokens, final event)."""
    events, done = [], threading.Event()

    def on_event(event):
        events.append(event)
        if event.finish_reason:
            done.set()

    engine.target.calls.clear()
    engine.steps.clear()
    ids = engine.tokenizer.encode(PROMPT)
    engine.submit(GenerationRequest(ids, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, **params),
                                    frozenset(), PROMPT), on_event)
    assert done.wait(300), "request did not finish"
    return list(engine.target.calls), list(engine.steps), [t for e in events for t in e.new_token_ids], events[-1]


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["early_exit", "ngram"])
def test_cap_zero_request_does_the_work_of_draft_length_zero(tmp_path, drafter):
    engine = recording_engine(tmp_path, drafter)
    engine.start()
    try:
        capped_calls, capped_steps, capped_tokens, capped = run(engine)  # the estimator's cap: 0
        plain_calls, plain_steps, plain_tokens, plain = run(engine, draft_length=0)
        drafting_calls, _, _, drafting = run(engine, draft_length=3)
    finally:
        engine.stop()
    assert capped.finish_reason == plain.finish_reason == "length"
    assert capped_tokens == plain_tokens
    assert capped.spec.draft_tokens == plain.spec.draft_tokens == 0
    assert capped.spec.verify_steps == plain.spec.verify_steps == 12
    assert capped_calls == plain_calls  # the same target passes: prefill chunks, then one width-1 pass per token
    assert not [c for c in capped_calls if c[1] is not None], "a draft pass ran for a cap-0 request"
    assert capped_steps == plain_steps  # the same step inputs: no stop threshold, no target-law signals asked for
    # The recording sees drafting where there is some: the early-exit drafter's passes, the n-gram's proposals.
    assert drafting.spec.draft_tokens > 0
    if drafter == "early_exit":
        assert [c for c in drafting_calls if c[1] == EARLY_EXIT_LAYERS]
