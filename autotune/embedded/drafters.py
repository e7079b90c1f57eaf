"""Drafters: who proposes the k tokens a speculative step verifies.

propose(step) -> (drafts [B, K] long, draft_probs [B, K, V] | None, proposed per row), with K the
longest row's k; a row's proposal is drafts[b, :proposed[b]] (the rest is padding the target never
accepts). draft_probs are the laws the proposals were drawn from, for rejection sampling; None
means deterministic (one-hot) proposals.

- none: no proposals (plain decoding: one token per target pass).
- ngram: prompt lookup. The newest n tokens (n = ngram_max down to ngram_min) are searched in the
  sequence's own history; what followed their latest earlier occurrence is proposed.
- early_exit: the target's first L layers + its final norm and head. It writes those layers' KV
  into the target's own cache; verification rewrites the same positions, so nothing is duplicated.
- draft_model / quantized_self: a second model (another checkpoint, or an int8 copy of the target)
  with its own cache, fed the prompt during prefill.
"""
import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from autotune.embedded.generate import StepInput
from autotune.embedded.sampling import draw, exponential_noise


def _empty(step: StepInput):
    return torch.empty((len(step.draft_lengths), 0), dtype=torch.long, device=step.last_tokens.device), None, [
        0] * len(step.draft_lengths)


class NoDrafter:
    def prefill(self, input_ids, input_pos, row, kv_len):
        pass

    def propose(self, step: StepInput):
        return _empty(step)


def ngram_lookup(history: np.ndarray, k: int, ngram_min: int, ngram_max: int) -> np.ndarray:
    """Up to k tokens that followed the latest earlier occurrence of the history's longest matching suffix."""
    for n in range(min(ngram_max, len(history) - 1), ngram_min - 1, -1):
        windows = sliding_window_view(history[:-1], n)  # every earlier n-gram (not the suffix itself)
        starts = np.flatnonzero((windows == history[-n:]).all(axis=1))
        if len(starts):
            follow = starts[-1] + n
            return history[follow : follow + k]
    return history[:0]


class NgramDrafter(NoDrafter):
    def __init__(self, ngram_min: int, ngram_max: int):
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def propose(self, step: StepInput):
        found = [
            ngram_lookup(history, k, self.ngram_min, self.ngram_max) if k else history[:0]
            for history, k in zip(step.histories, step.draft_lengths)
        ]
        width = max(len(f) for f in found)
        if not width:
            return _empty(step)
        padded = np.zeros((len(found), width), dtype=np.int64)
        for row, tokens in enumerate(found):
            padded[row, : len(tokens)] = tokens
        drafts = torch.from_numpy(padded).to(step.last_tokens.device, non_blocking=True)
        return drafts, None, [len(f) for f in found]


class ModelDrafter(NoDrafter):
    """Autoregressive proposals from a model: k forward passes of one token each (the first may feed two).

    forward(input_ids, input_pos, rows, kv_len) -> logits. shares_target_cache: the drafter is the
    target's own first layers and its cache is the target's, which already holds every token but
    the newest. Otherwise its cache may also lack the token before (the last proposal of a fully
    accepted step), so the first pass re-feeds it (an idempotent rewrite when it was there).
    """

    def __init__(self, forward, shares_target_cache: bool, prefill_forward=None):
        self.forward, self.shares_target_cache, self.prefill_forward = forward, shares_target_cache, prefill_forward

    def prefill(self, input_ids, input_pos, row, kv_len):
        if not self.shares_target_cache:
            self.prefill_forward(input_ids, input_pos, row, kv_len, logits_from=input_ids.shape[1] - 1)

    def propose(self, step: StepInput):
        k = max(step.draft_lengths)
        if not k:
            return _empty(step)
        device, sampling = step.last_tokens.device, step.sampling
        input_ids, input_pos = step.last_tokens[:, None], step.positions[:, None]
        if not self.shares_target_cache:
            before = torch.tensor([int(h[-2]) if len(h) > 1 else int(h[-1]) for h in step.histories], device=device)
            input_ids = torch.stack([before, step.last_tokens], 1)
            input_pos = torch.stack([(step.positions - 1).clamp_min(0), step.positions], 1)
        temperature = torch.where(sampling.greedy, 1.0, sampling.temperature)[:, None]
        drafts, laws = [], []
        for j in range(k):
            logits = self.forward(input_ids, input_pos, step.rows, step.kv_len)[:, -1]
            if sampling.any_sampled:
                law = torch.softmax(logits.float() / temperature, dim=-1)
                token = draw(law, exponential_noise(law.shape[-1:], sampling.generators, device))
                token = torch.where(sampling.greedy, logits.argmax(-1), token)
                laws.append(law)
            else:
                token = logits.argmax(-1)
            drafts.append(token)
            input_ids, input_pos = token[:, None], step.positions[:, None] + j + 1
        proposed = list(step.draft_lengths)
        return torch.stack(drafts, 1), torch.stack(laws, 1) if laws else None, proposed
