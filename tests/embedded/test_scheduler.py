"""The engine's serving semantics on the bundled model: counters, cancel, FIFO queueing, rejection of
requests that cannot fit, runtime knobs, draft-length policies."""
import json
import queue
import threading

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from autotune.embedded.config import MAX_DRAFT_LENGTH, EngineConfig, GenerationRequest, SamplingParams
from autotune.embedded.draft_policy import DraftPolicy, load_estimator
from autotune.embedded.generate import ENTROPY_POSITIONS
from autotune.embedded.model import KVCache
from autotune.embedded.runner import MAX_GRAPH_WIDTH, WIDTH_BUCKETS, ModelRunner, bucket
from autotune.embedded.scheduler import Engine
from autotune.embedded.weights import load_model

CODE_PROMPT = ("def area(width, height):\n    return width * height\n\n"
               "# Same function, with type hints:\ndef area(")


@pytest.fixture(scope="module")
def engine():
    engine = Engine(EngineConfig(drafter="ngram", draft_length=4, verify_slots=2, max_seq_len=192, threads=2))
    engine.start()
    yield engine
    engine.stop()


class Collector:
    """on_event target: every event of one request, and when it ended."""

    def __init__(self, log: queue.Queue | None = None, name=None):
        self.events, self.done, self.log, self.name = [], threading.Event(), log, name

    def __call__(self, event):
        self.events.append(event)
        if self.log is not None and len(self.events) == 1:
            self.log.put(("first", self.name))
        if event.finish_reason:
            if self.log is not None:
                self.log.put(("done", self.name))
            self.done.set()

    def wait(self, timeout=120):
        assert self.done.wait(timeout), "request did not finish"
        return self.events[-1]

    @property
    def tokens(self):
        return [t for e in self.events for t in e.new_token_ids]


def submit(engine, prompt=CODE_PROMPT, collector=None, **params) -> tuple[int, Collector]:
    collector = collector or Collector()
    ids = engine.tokenizer.encode(prompt)
    request_id = engine.submit(GenerationRequest(ids, SamplingParams(**params), frozenset(), prompt), collector)
    return request_id, collector


@pytest.mark.slow
def test_counters_add_up(engine):
    before = engine.stats()
    _, greedy = submit(engine, max_tokens=24)
    _, sampled = submit(engine, "Tell me a story about a cat.", max_tokens=12, temperature=0.8, top_p=0.9, seed=7)
    finals = [greedy.wait(), sampled.wait()]
    for collector, final in zip((greedy, sampled), finals):
        assert final.finish_reason == "length"
        assert final.completion_tokens == len(collector.tokens)
        spec = final.spec
        assert 0 <= spec.accepted_tokens <= spec.draft_tokens
        # every verify step emits its accepted proposals plus one token of the target's own
        assert final.completion_tokens == spec.verify_steps + spec.accepted_tokens
        assert final.prompt_entropy > 0
    assert finals[0].spec.accepted_tokens > 0  # the code prompt repeats itself: n-gram drafts land
    after = engine.stats()
    generated = after["generation_tokens_total"] - before["generation_tokens_total"]
    steps = after["verify_steps"] - before["verify_steps"]
    assert generated == sum(f.completion_tokens for f in finals)
    assert steps == sum(f.spec.verify_steps for f in finals)
    assert after["accept_length"] == pytest.approx(after["generation_tokens_total"] / after["verify_steps"])
    assert after["requests_running"] == 0 and after["requests_waiting"] == 0


@pytest.mark.slow
def test_cancel_frees_the_slot_and_queue_is_fifo(engine):
    log = queue.Queue()
    # All five are queued before the engine thread can admit any (it admits under this lock, which submit
    # re-enters): a and b take the two slots together. Submitted one by one, a busy machine could let the engine
    # admit a alone and emit its first token while b still waits with the others.
    with engine._lock:
        long_a, a = submit(engine, collector=Collector(log, "a"), max_tokens=150, ignore_eos=True)
        long_b, b = submit(engine, collector=Collector(log, "b"), max_tokens=150, ignore_eos=True)
        waiting = [submit(engine, f"Question {i}: what is {i} + {i}?", Collector(log, f"w{i}"), max_tokens=3)[1]
                   for i in range(3)]
    assert log.get(timeout=120) == ("first", "a")  # both slots busy, three requests queued
    assert engine.stats()["requests_waiting"] == 3
    engine.cancel(long_a)
    assert a.wait().finish_reason == "abort"
    assert a.events[-1].completion_tokens < 150
    for w in waiting:
        assert w.wait().finish_reason in ("length", "stop")
    engine.cancel(long_b)
    assert b.wait().finish_reason == "abort"
    # One slot was free: the queued requests ran one after another, oldest first.
    order = [item for item in drain(log) if item[1].startswith("w")]
    assert order == [(kind, f"w{i}") for i in range(3) for kind in ("first", "done")]


def drain(log: queue.Queue) -> list:
    items = []
    while not log.empty():
        items.append(log.get_nowait())
    return items


@pytest.mark.slow
def test_requests_that_cannot_fit_are_rejected(engine):
    final = submit(engine, max_tokens=180)[1].wait()
    assert final.finish_reason == "error" and "context length of 192" in final.error
    assert submit(engine, max_tokens=0)[1].wait().finish_reason == "error"
    assert submit(engine, max_tokens=4)[1].wait().finish_reason == "length"  # and it keeps serving


def test_runtime_knobs_are_validated(engine):
    assert engine.update_runtime(draft_length=6, ngram_max=3) == {
        "draft_length": 6, "draft_policy": "fixed", "draft_schedule": None, "ngram_min": 1, "ngram_max": 3}
    for bad in ({"draft_length": 99}, {"ngram_min": 4}, {"draft_policy": "psychic"}, {"threads": 3},
                {"draft_policy": "estimator"}):
        with pytest.raises(ValueError):
            engine.update_runtime(**bad)
    assert engine.update_runtime(draft_length=4, ngram_max=4)["draft_length"] == 4


def test_draft_policies(tmp_path):
    adaptive = DraftPolicy("adaptive", 4)
    assert adaptive.next_k(4, proposed=4, accepted=4) == 5
    assert adaptive.next_k(4, proposed=4, accepted=1) == 3
    assert adaptive.next_k(4, proposed=0, accepted=0) == 4  # no proposal, no evidence
    assert DraftPolicy("fixed", 4).next_k(4, 4, 0) == 4
    spec = {"feature": "prompt_entropy", "buckets": [{"below": 1.0, "k": 8}, {"below": 2.5, "k": 4}, {"k": 2}]}
    (tmp_path / "estimator.json").write_text(json.dumps(spec))
    policy = DraftPolicy("estimator", 4, load_estimator(str(tmp_path / "estimator.json")))
    assert [policy.first_k({"prompt_entropy": e}) for e in (0.3, 2.0, 7.0)] == [8, 4, 2]
    (tmp_path / "estimator.py").write_text("def draft_length(features):\n    return 3 if features['temperature'] else 7\n")
    estimate = load_estimator(str(tmp_path / "estimator.py"))
    assert (estimate({"temperature": 0.0}), estimate({"temperature": 1.0})) == (7, 3)
    (tmp_path / "bad.json").write_text('{"feature": "moon phase", "buckets": []}')
    with pytest.raises(ValueError, match="feature must be one of"):
        load_estimator(str(tmp_path / "bad.json"))


# -- the compiled path: compiled and captured once, at start-up, for every shape it will see -----------
def test_step_shapes_map_onto_buckets():
    assert [bucket(w, WIDTH_BUCKETS) for w in (1, 2, 3, 4, 5, 6, 9, 10, MAX_GRAPH_WIDTH)] == [
        1, 2, 3, 5, 5, 9, 9, MAX_GRAPH_WIDTH, MAX_GRAPH_WIDTH]
    assert [bucket(b, [1, 2, 4, 8]) for b in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert WIDTH_BUCKETS[-1] == MAX_DRAFT_LENGTH + 1  # the longest verify step has a bucket


def mixed_load(engine, **params) -> list[list[int]]:
    """Prompts short (a step-sized first chunk) and long (several chunks), draft lengths 0..16, more
    requests than slots: batch sizes, widths and kv_len all vary."""
    prompts = ["a b a b a b", "x = 1\ny = 2\nx = 1\ny =", CODE_PROMPT * 2, "Hi", CODE_PROMPT]
    collectors = [submit(engine, p, max_tokens=24, ignore_eos=True, draft_length=k, **params)[1]
                  for p, k in zip(prompts, (0, 3, 16, 8, 5))]
    for c in collectors:
        assert c.wait().finish_reason == "length"
    return [c.tokens for c in collectors]


@pytest.mark.slow
def test_compiled_engine_does_not_recompile_after_warm_up(tiny_checkpoint):
    engine = Engine(EngineConfig(model=tiny_checkpoint, drafter="ngram", verify_slots=3, max_seq_len=100, threads=2,
                                 compile="aot_eager"))
    engine.start()
    try:
        compiled = counters["frames"]["total"]  # every compilation dynamo attempts (a failed one too)
        assert compiled > 0 and engine.stats()["warmup_seconds"] > 0  # compiled at start-up, not per request
        mixed_load(engine)
        mixed_load(engine, temperature=0.8, top_k=20, seed=3)
        assert counters["frames"]["total"] == compiled
    finally:
        engine.stop()


def test_a_greedy_step_on_host_arrays_gives_the_tokens_of_the_unpadded_step(tiny_checkpoint):
    """host_greedy pads in numpy what _padded pads on the device: rows out of slot order, at other
    positions and widths, must get the argmax of the same step run unpadded."""
    loaded = load_model(tiny_checkpoint, max_seq_len=64)
    cache = KVCache(loaded.args, 4, 64, torch.float32)
    runner = ModelRunner(loaded.model, cache, scratch_slot=3, fixed_shape=True)
    generator = torch.Generator().manual_seed(0)
    for slot, length in ((0, 9), (1, 20), (2, 14)):
        prompt = torch.randint(100, 1000, (1, length), generator=generator)
        runner(prompt, torch.arange(length)[None], torch.tensor([slot]), 64, logits_from=length - 1)
    ids = torch.randint(100, 1000, (2, 3), generator=generator).numpy()
    pos, rows = np.array([[14, 15, 16], [9, 10, 11]]), np.array([2, 0])
    with torch.inference_mode():
        on_host = runner.host_greedy(ids, pos, rows)
        unpadded = loaded.model(*map(torch.from_numpy, (ids, pos)), cache, rows=torch.from_numpy(rows), kv_len=64)
    assert on_host.shape == (2, 3) and (on_host == unpadded.argmax(-1).numpy()).all()
    assert ModelRunner(loaded.model, cache).host_greedy(ids, pos, rows) is None  # unpadded: the caller's general path


def test_fixed_step_shape_gives_the_same_greedy_tokens_with_or_without_drafts(tiny_checkpoint):
    engine = Engine(EngineConfig(model=tiny_checkpoint, drafter="ngram", verify_slots=3, max_seq_len=100, threads=2,
                                 step_shape="fixed"))
    engine.start()
    try:
        alone = [submit(engine, p, max_tokens=24, ignore_eos=True, draft_length=0)[1] for p in ("a b a b a b", "Hi")]
        alone = [c.wait() and c.tokens for c in alone]
        together = mixed_load(engine)
        assert [together[0], together[3]] == alone
        assert engine.stats()["accepted_tokens"] > 0
    finally:
        engine.stop()


def test_a_prompt_is_prefilled_in_one_forward_with_the_entropy_of_its_leading_positions(tiny_checkpoint):
    """A prompt longer than ENTROPY_POSITIONS, within one prefill_ubatch, reaches the target in one forward
    before its decode steps (on a GPU an eager forward is tens of ms of launches, more than its compute), and
    the prompt entropy is still the mean next-token entropy of its first ENTROPY_POSITIONS positions, as a
    forward over those positions alone gives it."""
    from test_estimator_cap_zero import Recorded  # the engine's target runner, every call recorded

    engine = Engine(EngineConfig(model=tiny_checkpoint, drafter="none", verify_slots=1, max_seq_len=160, threads=1))
    engine.target = Recorded(engine.target)
    engine.start()
    try:
        prompt = "one two three four five six seven eight nine ten " * 6
        ids = engine.tokenizer.encode(prompt)
        assert ENTROPY_POSITIONS + 1 < len(ids) - 1 <= engine.config.prefill_ubatch
        final = submit(engine, prompt, max_tokens=3, ignore_eos=True)[1].wait()
    finally:
        engine.stop()
    assert [width for width, _, _ in engine.target.calls] == [len(ids) - 1, 1, 1, 1]  # the prefill, then a step for each token

    loaded = load_model(tiny_checkpoint, max_seq_len=160)
    with torch.inference_mode():
        logits = loaded.model(torch.tensor([ids[:ENTROPY_POSITIONS]]), torch.arange(ENTROPY_POSITIONS)[None],
                              KVCache(loaded.args, 1, 160, torch.float32), kv_len=160)
    logp = torch.log_softmax(logits[0].float(), dim=-1)
    assert final.prompt_entropy == pytest.approx(float(-(logp.exp() * logp).sum()) / ENTROPY_POSITIONS, rel=1e-4)


def test_a_prefill_chunk_padded_to_its_width_bucket_leaves_the_logits_and_the_cache_of_the_unpadded_one(tiny_checkpoint):
    """Prefill chunks pad up to a width bucket (on CUDA, to replay one graph per bucket). The padding columns
    write the cache after the chunk, up to its end (clamped there), so the chunk's logits and every later
    step must be what the unpadded chunk gives: here in slot 1 of 3, the second chunk's padding past the
    cache's last position."""
    loaded = load_model(tiny_checkpoint, max_seq_len=64)
    padded = ModelRunner(loaded.model, KVCache(loaded.args, 3, 64, torch.float32), scratch_slot=2,
                         prefill_widths=(32, 48))
    plain = ModelRunner(loaded.model, KVCache(loaded.args, 3, 64, torch.float32))
    prompt = torch.randint(100, 1000, (1, 56), generator=torch.Generator().manual_seed(0))
    row = torch.tensor([1])
    with torch.inference_mode():
        for start, end, head in ((0, 20, {"logits_to": 12}), (20, 56, {"logits_from": 35})):  # pads to 32, then 48
            chunk, pos = prompt[:, start:end], torch.arange(start, end)[None]
            got, want = (r(chunk, pos, row, 64, **head) for r in (padded, plain))
            assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)
        token = want[:, -1].argmax(-1, keepdim=True)
        for position in range(56, 63):  # greedy steps over the positions the padding wrote
            got, want = (r(token, torch.tensor([[position]]), row, 64) for r in (padded, plain))
            assert torch.allclose(got, want, atol=1e-5)
            token = want[:, -1].argmax(-1, keepdim=True)
