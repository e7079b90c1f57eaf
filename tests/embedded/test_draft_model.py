"""The distilled draft model (scripts/distill_draft_model.py, issue 17 point 4): a tiny CPU distillation
writes a checkpoint the server loads; its proposals are the full-vocabulary ids of its head's subset;
greedy output with it is plain greedy output (fp32 and the GGUF kernel), over HTTP; rejection sampling
with a law that is zero outside the subset keeps the target's law, and a law put on the wrong ids fails.
"""
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import httpx
import numpy as np
import pytest
import torch
from test_speculative import VOCAB, batch_settings, tiny_model, two_step_joint_pvalue

from autotune.embedded.drafters import ModelDrafter
from autotune.embedded.generate import StepInput
from autotune.embedded.model import KVCache, Linear
from autotune.embedded.runner import ModelRunner
from autotune.embedded.sampling import SamplingBatch
from autotune.embedded.weights import load_draft_model, load_model

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--device", "cpu", "--layers", "1", "--vocab", "512", "--samples", "2", "--new-tokens", "8",
        "--limit-prompts", "3", "--train-seconds", "2", "--batch", "4"]
PROMPTS = ["def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n",
           "The three primary colours are", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def distilled(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("distill")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "distill_draft_model.py"), "--out", str(out), *TINY],
                          capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": ""},
                          check=False, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def target():
    return load_model()


@pytest.mark.slow
def test_distillation_writes_a_small_checkpoint_that_borrows_the_target(distilled, target):
    report = json.loads((distilled / "distill.json").read_text())
    assert report["checkpoint"]["bytes"] == (distilled / "draft.gguf").stat().st_size <= 15e6
    assert report["loss"]["steps"] >= 1 and np.isfinite(report["loss"]["last"]) and report["loss"]["last"] >= 0
    assert report["held_out_checkpoint"]["positions"] == report["generated_tokens"]["held_out_of_training"] > 0
    assert report["prompts"]["held_out_of_training"] >= 1
    names = {t.name for t in gguf.GGUFReader(distilled / "draft.gguf").tensors}
    assert "token_embd.weight" not in names and "output.weight" in names  # no second embedding table stored
    draft = load_draft_model(str(distilled / "draft.gguf"), target)
    assert draft.model.tok_embeddings.weight.data_ptr() == target.model.tok_embeddings.weight.data_ptr()
    assert draft.model.output.weight.shape == (512, target.args.dim) and draft.args.n_layers == 1
    subset = draft.vocab_subset
    assert len(subset) == 512 == len(subset.unique()) and 0 <= subset.min() and subset.max() < target.args.vocab_size
    with pytest.raises(ValueError, match="distilled draft"):  # alone it is no model: it has no embedding
        load_model(str(distilled / "draft.gguf"))


def propose(drafter: ModelDrafter, history: list[int], k: int, sampling: SamplingBatch):
    step = StepInput(np.array([[history[-1], len(history) - 1, 0]]), [np.array(history)], [k], len(history) + k,
                     sampling)
    return drafter.propose(step)


@pytest.mark.slow
@torch.no_grad()
def test_proposals_are_full_vocabulary_ids_of_the_subset(distilled, target):
    draft = load_draft_model(str(distilled / "draft.gguf"), target)
    subset = draft.vocab_subset
    history = target.tokenizer.encode(PROMPTS[0])
    runner = ModelRunner(draft.model, KVCache(draft.args, 1, 128, torch.float32))
    drafter = ModelDrafter(runner, shares_target_cache=False, prefill_forward=runner, vocab_subset=subset,
                           vocab_size=target.args.vocab_size)
    prompt = torch.tensor([history[:-1]])
    drafter.prefill(prompt, torch.arange(prompt.shape[1])[None], None, prompt.shape[1])
    greedy = SamplingBatch(temperature=torch.zeros(1), top_k=torch.zeros(1, dtype=torch.long), top_p=torch.ones(1),
                           repetition_penalty=torch.ones(1), presence=None, generators=[None], any_sampled=False,
                           any_filtered=False)
    drafts, laws, proposed, _ = propose(drafter, history, 3, greedy)
    # The reference: the draft model run alone, its head's argmax looked up in the subset.
    cache, expected, ids = KVCache(draft.args, 1, 128, torch.float32), [], torch.tensor([history])
    logits = draft.model(ids, torch.arange(len(history))[None], cache, kv_len=len(history))[:, -1]
    for j in range(3):
        expected.append(int(subset[logits.argmax(-1)]))
        position = torch.tensor([[len(history) + j]])
        logits = draft.model(torch.tensor([[expected[-1]]]), position, cache, kv_len=len(history) + j + 1)[:, -1]
    assert proposed == [3] and laws is None and drafts[0].tolist() == expected
    assert set(expected) <= set(subset.tolist())

    drafts, laws, _, _ = propose(drafter, history, 3, batch_settings(1, temperature=0.7, seed=5))
    assert laws.shape == (1, 3, target.args.vocab_size)
    outside = torch.ones(target.args.vocab_size, dtype=torch.bool)
    outside[subset] = False
    assert laws[0, :, outside].abs().max() == 0 and torch.allclose(laws.sum(-1), torch.ones(1, 3))
    assert (laws[0].gather(-1, drafts[0][:, None]) > 0).all()  # each proposal has mass under its own law
    first = draft.model(torch.tensor([history]), torch.arange(len(history))[None], KVCache(draft.args, 1, 128, torch.float32),
                        kv_len=len(history))[0, -1]
    assert torch.allclose(laws[0, 0, subset], torch.softmax(first / 0.7, -1), atol=1e-6)  # row i of the head is subset[i]


class MislabelledLaw(ModelDrafter):
    """Tokens mapped right, their law handed to verification on the wrong ids: what a broken mapping does."""

    def _full_law(self, law):
        return super()._full_law(law.roll(1, -1))


def joint_pvalue(drafter_class) -> float:
    """test_speculative's exact two-step joint-law test, for a random 1-layer draft whose head scores 5 of the 8
    tokens (a sub-vocabulary), proposing through drafter_class."""
    subset = torch.tensor([6, 0, 3, 7, 2])
    draft = tiny_model(1, 1)
    draft.output = Linear(draft.args.dim, len(subset), bias=False)
    draft.output.weight.data.normal_(0, 0.5)
    return two_step_joint_pvalue(lambda forward: drafter_class(forward, shares_target_cache=False, vocab_subset=subset,
                                                                vocab_size=VOCAB), draft)


@torch.no_grad()
def test_rejection_sampling_with_a_subvocabulary_draft_keeps_the_target_law():
    assert joint_pvalue(ModelDrafter) > 1e-3
    assert joint_pvalue(MislabelledLaw) < 1e-6  # the same test fails a law on the wrong ids


def completions(url: str, prompts: list[str], concurrent: bool, **body) -> list[dict]:
    def one(prompt):
        response = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 16, "temperature": 0,
                                                              "ignore_eos": True, **body}, timeout=300)
        response.raise_for_status()
        return response.json()

    if not concurrent:
        return [one(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:  # one batch of requests of different lengths
        return list(pool.map(one, prompts))


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_greedy_with_the_draft_model_is_plain_greedy(distilled, start_embedded_server, quantization):
    flags = {"max_seq_len": 256, "threads": 2, "quantization": quantization}
    plain = start_embedded_server(drafter="none", **flags)
    reference = [r["choices"][0]["text"] for r in completions(plain.url, PROMPTS, concurrent=False)]
    plain.stop()
    served = start_embedded_server(drafter="draft_model", draft_model=str(distilled / "draft.gguf"), draft_length=3,
                                   verify_slots=3, **flags)
    answers = completions(served.url, PROMPTS, concurrent=True)
    assert [r["choices"][0]["text"] for r in answers] == reference
    assert sum(r["usage"]["spec_draft_tokens"] for r in answers) > 0  # it really drafted
    sampled = completions(served.url, PROMPTS[1:2], concurrent=False, temperature=0.8, seed=1)[0]
    assert sampled["usage"]["completion_tokens"] == 16 and sampled["usage"]["spec_draft_tokens"] > 0
