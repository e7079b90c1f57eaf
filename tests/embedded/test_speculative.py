"""Speculative decoding is lossless.

Greedy: every drafter reproduces plain greedy token for token on the bundled model, alone and in a
batch of requests of different lengths. Sampling: rejection sampling (generate.accept) reproduces
the target's law, checked by chi-square against the exact law, and the same test rejects a sampler
fed the wrong draft law, so it has teeth.
"""
import functools
import threading

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from autotune.embedded import weights
from autotune.embedded.config import EngineConfig, GenerationRequest, SamplingParams
from autotune.embedded.drafters import ModelDrafter, ngram_lookup
from autotune.embedded.generate import StepInput, accept, speculative_step
from autotune.embedded.model import KVCache, ModelArgs, Transformer
from autotune.embedded.sampling import SamplingBatch, probabilities
from autotune.embedded.scheduler import Engine

PROMPTS = [
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n\n"
    "# The same function with type hints:\ndef mean(",
    "The three primary colours are",
    "Write a haiku about the sea.",
]
MAX_TOKENS = [14, 10, 6]


@pytest.fixture(scope="module")
def shared_weights():
    """Load the bundled model once for the module: every engine here serves the same weights."""
    cached = functools.lru_cache(maxsize=None)(weights.load_model)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(weights, "load_model", cached)
        yield weights.bundled_gguf_path()


def generate(engine: Engine, prompts, max_tokens, **params) -> list[list[int]]:
    """Submit all prompts at once (one batch) and collect every request's tokens."""
    tokens, finals, finished = [[] for _ in prompts], [None] * len(prompts), threading.Semaphore(0)

    def collect(i):
        def on_event(event):
            tokens[i].extend(event.new_token_ids)
            if event.finish_reason:
                finals[i] = event
                finished.release()
        return on_event

    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        ids = engine.tokenizer.encode(prompt)
        engine.submit(GenerationRequest(ids, SamplingParams(max_tokens=n, **params), frozenset(), prompt),
                      collect(i))
    for _ in prompts:
        assert finished.acquire(timeout=120)
    for final, got in zip(finals, tokens):
        assert final.finish_reason in ("stop", "length"), final.error
        assert final.completion_tokens == len(got)
    return tokens


def engine_for(**config) -> Engine:
    engine = Engine(EngineConfig(threads=2, max_seq_len=256, verify_slots=3, **config))
    engine.start()
    return engine


@pytest.fixture(scope="module")
def plain_greedy(shared_weights):
    engine = engine_for(drafter="none")
    try:  # one request at a time: the reference is plain greedy decoding, alone
        return [generate(engine, [p], [n])[0] for p, n in zip(PROMPTS, MAX_TOKENS)]
    finally:
        engine.stop()


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["ngram", "early_exit", "quantized_self", "draft_model"])
def test_greedy_identical_to_plain_greedy(drafter, plain_greedy, shared_weights):
    extra = {"draft_model": str(shared_weights)} if drafter == "draft_model" else {}
    engine = engine_for(drafter=drafter, draft_length=3, early_exit_layers=10, **extra)
    try:
        assert generate(engine, PROMPTS, MAX_TOKENS) == plain_greedy  # three requests in one batch
        assert generate(engine, PROMPTS[:1], MAX_TOKENS[:1], draft_length=5) == plain_greedy[:1]  # alone
        stats = engine.stats()
        assert stats["draft_tokens"] > 0 and stats["accepted_tokens"] > 0  # it really speculated
    finally:
        engine.stop()


def test_ngram_lookup_takes_latest_longest_match():
    history = np.array([5, 6, 7, 8, 1, 6, 7, 9, 4, 6, 7])
    assert ngram_lookup(history, 3, 1, 3).tolist() == [9, 4, 6]  # "6 7" latest seen before "9"
    assert ngram_lookup(history, 3, 3, 3).tolist() == []  # "4 6 7" never seen earlier
    assert ngram_lookup(np.array([1, 2, 3]), 2, 1, 4).tolist() == []


# -- rejection sampling keeps the target's law -------------------------------------------------------
VOCAB, SAMPLES = 8, 20000


def batch_settings(rows: int, temperature=1.0, top_k=0, top_p=1.0, seed=0) -> SamplingBatch:
    generator = torch.Generator().manual_seed(seed)
    return SamplingBatch(
        temperature=torch.full((rows,), temperature), top_k=torch.full((rows,), top_k),
        top_p=torch.full((rows,), top_p), repetition_penalty=torch.ones(rows), presence=None,
        generators=[generator] * rows, any_sampled=True, any_filtered=top_k > 0 or top_p < 1)


def first_token_pvalue(p_logits, q, claimed_q, top_k=0) -> float:
    """Draw proposals from q, verify them against p with `claimed_q` as the draft law; chi-square
    of the first emitted token against the target law after top-k."""
    generator = torch.Generator().manual_seed(1)
    drafts = torch.multinomial(q[0], SAMPLES, replacement=True, generator=generator)[:, None]
    logits = p_logits.expand(SAMPLES, 2, VOCAB)
    law = None if claimed_q is None else claimed_q.expand(SAMPLES, 1, VOCAB)
    sampling = batch_settings(SAMPLES, top_k=top_k)
    tokens, _ = accept(logits, drafts, law, torch.ones(SAMPLES, dtype=torch.long), sampling)
    expected = probabilities(p_logits[:, :1], batch_settings(1, top_k=top_k))[0, 0].double()
    counts = torch.bincount(tokens[:, 0], minlength=VOCAB).double()
    assert counts[expected == 0].sum() == 0  # nothing outside the top-k
    kept = expected > 0
    return chisquare(counts[kept], expected[kept] / expected[kept].sum() * SAMPLES).pvalue


def test_rejection_sampling_preserves_target_law():
    torch.manual_seed(0)
    p_logits = torch.randn(1, 2, VOCAB) * 1.5
    q = torch.softmax(torch.randn(1, VOCAB) * 1.5, -1)
    assert first_token_pvalue(p_logits, q, q[None]) > 1e-3  # model drafter, q known
    assert first_token_pvalue(p_logits, q, q[None], top_k=3) > 1e-3  # top-k applies to the target
    one_hot = torch.zeros(1, VOCAB)
    one_hot[0, 2] = 1
    assert first_token_pvalue(p_logits, one_hot, None) > 1e-3  # deterministic (n-gram) proposals
    # The same test fails a sampler told the wrong draft law (uniform, while proposals come from q).
    assert first_token_pvalue(p_logits, q, torch.full((1, 1, VOCAB), 1 / VOCAB)) < 1e-6


def tiny_model(seed: int, layers: int) -> Transformer:
    torch.manual_seed(seed)
    args = ModelArgs(dim=32, n_layers=layers, n_heads=4, n_kv_heads=2, intermediate_size=64, vocab_size=VOCAB,
                     max_seq_len=32)
    model = Transformer(args)
    for p in model.parameters():
        p.data.normal_(0, 0.5)
    return model.eval()


def two_step_joint_pvalue(make_drafter, draft: Transformer) -> float:
    """Two speculative steps of `draft` (proposing through make_drafter(forward)) over a random target: the
    chi-square p-value of the first two tokens' joint law against the target's, computed exactly."""
    rows, prompt = 3000, torch.tensor([1, 4, 2])
    target = tiny_model(0, 2)
    target_cache = KVCache(target.args, rows, 32, torch.float32)
    draft_cache = KVCache(draft.args, rows, 32, torch.float32)
    pos = torch.arange(2).expand(rows, 2)
    target(prompt[:2].expand(rows, 2), pos, target_cache)
    draft(prompt[:2].expand(rows, 2), pos, draft_cache)

    def forward(model, cache):
        return lambda ids, positions, rows_, kv_len: model(ids, positions, cache, rows=rows_, kv_len=kv_len)

    drafter = make_drafter(forward(draft, draft_cache))
    sampling = batch_settings(rows, temperature=0.9, seed=3)
    emitted = [[] for _ in range(rows)]
    for _ in range(2):  # each step emits >= 1 token, so two steps give every row two
        host = np.array([[(prompt.tolist() + e)[-1], len(prompt) - 1 + len(e), row] for row, e in enumerate(emitted)])
        step = StepInput(host, [np.array(prompt.tolist() + e) for e in emitted], [3] * rows, 32, sampling)
        for row, tokens in enumerate(speculative_step(forward(target, target_cache), drafter, step).tokens):
            emitted[row] += tokens
    pairs = np.array([e[0] * VOCAB + e[1] for e in emitted])

    # Exact joint law of (t1, t2) under the target at temperature 0.9.
    grid = torch.cat([prompt.expand(VOCAB, 3), torch.arange(VOCAB)[:, None]], 1)
    logits = target(grid, torch.arange(4).expand(VOCAB, 4), KVCache(target.args, VOCAB, 32, torch.float32))
    joint = (torch.softmax(logits[0, 2] / 0.9, -1)[:, None] * torch.softmax(logits[:, 3] / 0.9, -1)).flatten().double()
    counts = np.bincount(pairs, minlength=VOCAB * VOCAB)
    common = (joint * rows >= 5).numpy()  # chi-square wants expected counts >= 5; the rest pooled
    observed = np.append(counts[common], counts[~common].sum())
    expected = np.append((joint[common] * rows).numpy(), (joint[~common] * rows).sum().item())
    return chisquare(observed, expected * observed.sum() / expected.sum()).pvalue


@torch.no_grad()
def test_speculative_steps_sample_the_target_law_end_to_end():
    """Two steps of a random draft model over a random target sample the target's joint law."""
    assert two_step_joint_pvalue(lambda forward: ModelDrafter(forward, shares_target_cache=False), tiny_model(1, 1)) > 1e-3
