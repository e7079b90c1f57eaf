"""Drafters: who proposes the k tokens a speculative step verifies.

propose(step) -> (drafts [B, K] long, draft_probs [B, K, V] | None, proposed per row, signals [B, K, 2] |
None), with K the longest row's proposal; a row's proposal is drafts[b, :proposed[b]] (the rest is padding
the target never accepts). draft_probs are the laws the proposals were drawn from, for rejection sampling;
None means deterministic (one-hot) proposals. Drafters that propose on the host (proposes_on_host) also give
host_proposals(step) -> (drafts as a numpy array, proposed), which a greedy step takes without a device copy. signals (entropy, top-1 probability per proposed token, only
when step.trace) are what the stop rule reads (generate.py), for the estimator's fit.

- none: no proposals (plain decoding: one token per target pass).
- ngram: prompt lookup. The newest n tokens (n = ngram_max down to ngram_min) are searched in the
  sequence's own history; what followed their latest earlier occurrence is proposed.
- early_exit: the target's first L layers + its final norm and head. It writes those layers' KV
  into the target's own cache; verification rewrites the same positions, so nothing is duplicated.
- draft_model / quantized_self: a second model (another checkpoint, or an int8 copy of the target)
  with its own cache, fed the prompt during prefill. A distilled draft's head scores a subset of the
  vocabulary only (FR-Spec, arXiv 2502.14856): its proposals are mapped to full ids and its law is zero
  outside the subset, which rejection sampling needs no more than any other draft law to stay exact.
"""
import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from autotune.embedded.generate import StepInput, risk_of, signals_of
from autotune.embedded.sampling import draw, exponential_noise


def _empty(step: StepInput):
    return torch.empty((len(step.draft_lengths), 0), dtype=torch.long, device=step.device), None, [
        0] * len(step.draft_lengths), None


class NoDrafter:
    proposes_on_host = True

    def prefill(self, input_ids, input_pos, row, kv_len):
        pass

    def host_proposals(self, step: StepInput) -> tuple[np.ndarray, list[int]]:
        return np.zeros((len(step.draft_lengths), 0), dtype=np.int64), [0] * len(step.draft_lengths)

    def propose(self, step: StepInput):
        drafts, proposed = self.host_proposals(step)
        return torch.from_numpy(drafts).to(step.device, non_blocking=True), None, proposed, None


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

    def host_proposals(self, step: StepInput) -> tuple[np.ndarray, list[int]]:
        ks = list(step.draft_lengths)
        if step.stop_above is not None:
            risks = risk_of(torch.tensor(self._prior(step)), step.stop_signal).tolist()
            ks = [0 if risk > above else k for k, risk, above in zip(ks, risks, step.stop_above)]
        found = [
            ngram_lookup(history, k, self.ngram_min, self.ngram_max) if k else history[:0]
            for history, k in zip(step.histories, ks)
        ]
        padded = np.zeros((len(found), max(len(f) for f in found)), dtype=np.int64)
        for row, tokens in enumerate(found):
            padded[row, : len(tokens)] = tokens
        return padded, [len(f) for f in found]

    def propose(self, step: StepInput):
        drafts, _, proposed, _ = super().propose(step)
        width = drafts.shape[1]
        signals = torch.tensor(self._prior(step))[:, None].expand(-1, width, -1) if step.trace and width else None
        return drafts, None, proposed, signals

    @staticmethod
    def _prior(step: StepInput) -> list[tuple[float, float]]:
        """No distribution of its own: the stop rule reads the target's at the last accepted position."""
        return [s or (0.0, 1.0) for s in step.target_signals or [None] * len(step.draft_lengths)]


class ModelDrafter(NoDrafter):
    """Autoregressive proposals from a model: k forward passes of one token each (the first may feed two).

    forward(input_ids, input_pos, rows, kv_len) -> logits. shares_target_cache: the drafter is the
    target's own first layers and its cache is the target's, which already holds every token but
    the newest. Otherwise its cache may also lack the token before (the last proposal of a fully
    accepted step), so the first pass re-feeds it (an idempotent rewrite when it was there).
    vocab_subset [N]: the full token id of each of the draft head's N rows (None: the head is the whole
    vocabulary); vocab_size: the target's, the width of the laws handed to verification.
    """

    proposes_on_host = False

    def __init__(self, forward, shares_target_cache: bool, prefill_forward=None, vocab_subset=None,
                 vocab_size: int | None = None):
        self.forward, self.shares_target_cache, self.prefill_forward = forward, shares_target_cache, prefill_forward
        self.vocab_subset, self.vocab_size = vocab_subset, vocab_size

    def prefill(self, input_ids, input_pos, row, kv_len):
        if not self.shares_target_cache:
            self.prefill_forward(input_ids, input_pos, row, kv_len, logits_from=input_ids.shape[1] - 1)

    def propose(self, step: StepInput):
        k = max(step.draft_lengths)
        if not k:
            return _empty(step)
        device, sampling = step.device, step.sampling
        input_ids, input_pos = step.last_tokens[:, None], step.positions[:, None]
        if not self.shares_target_cache:
            before = torch.tensor([int(h[-2]) if len(h) > 1 else int(h[-1]) for h in step.histories], device=device)
            input_ids = torch.stack([before, step.last_tokens], 1)
            input_pos = torch.stack([(step.positions - 1).clamp_min(0), step.positions], 1)
        temperature = torch.where(sampling.greedy, 1.0, sampling.temperature)[:, None]
        lengths = torch.tensor(step.draft_lengths, device=device)
        proposed, signals = lengths, []
        stop_above = None if step.stop_above is None else torch.tensor(step.stop_above, device=device)
        drafts, laws = [], []
        for j in range(k):
            logits = self.forward(input_ids, input_pos, step.rows, step.kv_len)[:, -1]
            if stop_above is not None or step.trace:
                signals.append(signals_of(logits))
            if stop_above is not None:  # a row stops before its first too-uncertain token
                stopping = (proposed > j) & (risk_of(signals[-1], step.stop_signal) > stop_above)
                proposed = torch.where(stopping, j, proposed)
                if not (proposed > j).any():  # no row proposes this token
                    break
            if sampling.any_sampled:
                law = torch.softmax(logits.float() / temperature, dim=-1)
                token = draw(law, exponential_noise(law.shape[-1:], sampling.generators, device))
                token = torch.where(sampling.greedy, logits.argmax(-1), token)
                laws.append(law if self.vocab_subset is None else self._full_law(law))
            else:
                token = logits.argmax(-1)
            if self.vocab_subset is not None:
                token = self.vocab_subset[token]
            drafts.append(token)
            if stop_above is not None and not (proposed > j + 1).any():  # no row needs another draft pass
                break
            input_ids, input_pos = token[:, None], step.positions[:, None] + j + 1
        proposed = proposed.tolist()
        width = max(proposed)  # the verify pass is only as wide as the longest proposal left
        if not width:
            return _empty(step)
        return (torch.stack(drafts, 1)[:, :width], torch.stack(laws, 1)[:, :width] if laws else None, proposed,
                torch.stack(signals, 1)[:, :width] if step.trace else None)

    def _full_law(self, law):
        """[B, N] law over the head's subset -> [B, vocab_size], zero outside the subset."""
        full = torch.zeros((law.shape[0], self.vocab_size), dtype=law.dtype, device=law.device)
        return full.index_copy_(1, self.vocab_subset, law)
