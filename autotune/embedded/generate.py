"""One speculative-decoding step for a batch of sequences: draft -> verify -> accept.

Invariant: the target's KV cache holds every token of a sequence except its newest, which sits at
position `positions[b]`. A step feeds [newest, d_1 .. d_K] at positions p .. p+K through the target
once, accepts a prefix of the proposals and appends the target's own next token, so every step
emits between 1 and k+1 tokens. Stale cache entries past the accepted prefix are masked by position
and overwritten by the next step.

Temperature 0 accepts a proposal iff it equals the target's argmax, so the output is the target's
own greedy output. Temperature > 0 uses rejection sampling (Leviathan et al., 2023): accept x ~ q
with probability min(1, p(x) / q(x)); at the first rejection draw from norm(max(p - q, 0)); after
k acceptances draw from p. The emitted tokens are then distributed exactly as sampling from p.

Draft stopping (the fitted estimator's rule): a model drafter stops proposing at the first token whose
draft distribution is too uncertain (its risk, the entropy or 1 - top-1 probability of softmax(draft
logits), above the row's threshold; that token is not proposed). The n-gram drafter has no distribution
of its own: it proposes nothing when the target's risk at the last accepted position is above it. A
stop depends on the draft side only, so greedy output and the sampled distribution stay exact.
"""
import time
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from torch import Tensor

from autotune.embedded.runner import ModelRunner
from autotune.embedded.sampling import (
    SamplingBatch,
    draw,
    exponential_noise,
    penalise,
    presence_along,
    probabilities,
    uniform_noise,
)

ENTROPY_POSITIONS = 32  # prompt entropy = mean next-token entropy over this many leading prompt positions
STOP_SIGNALS = ("entropy", "doubt")  # a stop rule's risk: entropy (nats), or doubt = 1 - top-1 probability
CPU = torch.device("cpu")


@dataclass
class StepInput:
    host: np.ndarray  # [B, 3] int64 per row: newest token (not yet in the target's cache), its position, cache slot
    histories: list[np.ndarray]  # every token of each sequence, newest last (for n-gram lookup)
    draft_lengths: list[int]  # k per row; 0 = plain decode
    kv_len: int  # attended cache length: covers every row's position + K
    sampling: SamplingBatch
    device: torch.device = CPU
    stop_above: list[float] | None = None  # per row: the risk above which drafting stops (inf: never); None: no rule
    stop_signal: str = "entropy"  # which risk (STOP_SIGNALS)
    trace: bool = False  # return each proposed token's signals (what `autotune estimator fit` collects)
    target_signals: list[tuple[float, float] | None] | None = None  # n-gram: the previous step's target_signals

    @cached_property
    def _on_device(self) -> Tensor:  # one copy, made only where a step needs the ids on the device
        return torch.from_numpy(self.host).to(self.device)

    @property
    def last_tokens(self) -> Tensor:  # [B]
        return self._on_device[:, 0]

    @property
    def positions(self) -> Tensor:  # [B]
        return self._on_device[:, 1]

    @property
    def rows(self) -> Tensor | None:  # the cache slots of the rows; None = slots 0..B-1 (the cache read as a view)
        slots = self.host[:, 2]
        return None if (slots == np.arange(len(slots))).all() else self._on_device[:, 2]

    @property
    def greedy_on_host(self) -> bool:
        """Every row greedy without penalty, and no signals asked: the step needs the target's argmax only."""
        sampling = self.sampling
        return not (sampling.any_sampled or sampling.presence is not None or self.trace or self.target_signals)


@dataclass
class StepOutput:
    tokens: list[list[int]]  # per row: the accepted proposals, then the target's own token
    proposed: list[int]
    accepted: list[int]
    draft_seconds: float
    verify_seconds: float
    signals: list[list[tuple[float, float]]] | None = None  # per row, per proposed token: (entropy, top-1 prob)
    target_signals: list[tuple[float, float]] | None = None  # per row: (entropy, top-1) of the target's last law


def signals_of(logits: Tensor) -> Tensor:
    """[..., V] logits -> [..., 2]: entropy (nats) and top-1 probability of softmax(logits), temperature 1."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    p = logp.exp()
    return torch.stack([-(p * logp).sum(-1), p.amax(-1)], -1)


def risk_of(signals: Tensor, signal: str) -> Tensor:
    """[..., 2] signals -> [...] the stop rule's risk: entropy, or doubt = 1 - top-1 probability."""
    return signals[..., 0] if signal == "entropy" else 1 - signals[..., 1]


def leading_true(ok: Tensor) -> Tensor:
    """[B, K] bool -> [B] length of the all-true prefix."""
    return ok.long().cumprod(1).sum(1)


def greedy_accepted(target_tokens: Tensor, drafts: Tensor, proposed: Tensor) -> Tensor:
    """The target's own tokens [B, K+1] and the proposals [B, K] -> [B] proposals accepted: the prefix that
    equals the target's tokens (temperature 0)."""
    k = drafts.shape[1]
    in_proposal = torch.arange(k, device=drafts.device) < proposed[:, None]
    return leading_true((drafts == target_tokens[:, :k]) & in_proposal)


def accept(logits: Tensor, drafts: Tensor, draft_probs: Tensor | None, proposed: Tensor, sampling: SamplingBatch):
    """Target logits [B, K+1, V] + proposals [B, K] -> (tokens [B, K+1], accepted [B]).

    tokens[b, :accepted[b] + 1] are emitted. draft_probs [B, K, V] are the distributions the
    proposals were drawn from; None means deterministic proposals (one-hot q, e.g. n-gram).
    """
    batch, width, vocab = logits.shape
    k = width - 1
    if sampling.presence is not None:
        logits = penalise(logits, sampling.repetition_penalty, presence_along(sampling.presence, drafts))
    greedy_tokens = logits.argmax(-1)
    greedy_ok = greedy_accepted(greedy_tokens, drafts, proposed)
    if not sampling.any_sampled:
        return greedy_tokens, greedy_ok

    p = probabilities(logits, sampling)
    p_x = p[:, :k].gather(-1, drafts[..., None])[..., 0]
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(-1, drafts[..., None])[..., 0]
    u = uniform_noise((k,), sampling.generators, logits.device)
    in_proposal = torch.arange(k, device=logits.device) < proposed[:, None]
    accepted = leading_true((u * q_x < p_x) & in_proposal)

    rows = torch.arange(batch, device=logits.device)
    p_next = p[rows, accepted]
    if k:
        at = accepted.clamp(max=k - 1)
        if draft_probs is None:
            q_next = torch.zeros_like(p_next).scatter(1, drafts[rows, at][:, None], 1.0)
        else:
            q_next = draft_probs[rows, at]
        rejected = (accepted < proposed)[:, None]
        residual = torch.where(rejected, (p_next - q_next).clamp_min(0), p_next)
        # p == q up to rounding leaves nothing to reject into; p itself is then the right law.
        p_next = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next)
    bonus = draw(p_next, exponential_noise((vocab,), sampling.generators, logits.device))
    tokens = torch.cat([drafts, bonus[:, None]], 1)
    tokens[rows, accepted] = bonus
    greedy = sampling.greedy
    return torch.where(greedy[:, None], greedy_tokens, tokens), torch.where(greedy, greedy_ok, accepted)


def speculative_step(verify, drafter, step: StepInput) -> StepOutput:
    """verify(input_ids, input_pos, rows, kv_len) -> logits is the target; drafter proposes (drafters.py).

    A greedy step of host proposals (plain decode, n-gram) through a ModelRunner with a graph for it is
    taken on host arrays (ModelRunner.host_greedy): the same tokens, without the device ops around the step.
    """
    start = time.perf_counter()
    if drafter.proposes_on_host and step.greedy_on_host and isinstance(verify, ModelRunner) and verify.pads_steps:
        host_drafts, proposed = drafter.host_proposals(step)
        drafted = time.perf_counter()
        k = host_drafts.shape[1]
        ids = np.concatenate([step.host[:, :1], host_drafts], 1)
        target = verify.host_greedy(ids, step.host[:, 1:2] + np.arange(k + 1), step.host[:, 2])
        if target is not None:
            accepted = greedy_accepted(torch.from_numpy(target), torch.from_numpy(host_drafts),
                                       torch.tensor(proposed)).tolist()
            return StepOutput(tokens=[row[: a + 1] for row, a in zip(target.tolist(), accepted)], proposed=proposed,
                              accepted=accepted, draft_seconds=drafted - start,
                              verify_seconds=time.perf_counter() - drafted)
        drafts, draft_probs, signals = torch.from_numpy(host_drafts).to(step.device), None, None
    else:
        drafts, draft_probs, proposed, signals = drafter.propose(step)
        drafted = time.perf_counter()
    k = drafts.shape[1]
    input_ids = torch.cat([step.last_tokens[:, None], drafts], 1)
    input_pos = step.positions[:, None] + torch.arange(k + 1, device=drafts.device)
    logits = verify(input_ids, input_pos, step.rows, step.kv_len)
    proposed_t = torch.tensor(proposed, device=drafts.device)
    tokens, accepted = accept(logits, drafts, draft_probs, proposed_t, step.sampling)
    packed = torch.cat([tokens, accepted[:, None]], 1)
    if packed.is_cuda:
        torch.cuda.current_stream().synchronize()  # wait with the GIL released: the server's loop runs meanwhile
    host = packed.tolist()  # the step's one host sync
    target_signals = None
    if step.target_signals is not None:  # n-gram stopping reads the law the target's own token came from
        rows = torch.arange(len(proposed), device=logits.device)
        target_signals = [tuple(s) for s in signals_of(logits[rows, accepted]).tolist()]
    done = time.perf_counter()
    return StepOutput(
        tokens=[row[: row[-1] + 1] for row in host],
        proposed=proposed,
        accepted=[row[-1] for row in host],
        draft_seconds=drafted - start,
        verify_seconds=done - drafted,
        signals=None if signals is None else [[tuple(s) for s in row[:n]] for row, n in zip(signals.tolist(), proposed)],
        target_signals=target_signals,
    )


def prefill_chunk(target, drafter, input_ids: Tensor, start: int, row: Tensor | None, kv_len: int) -> Tensor | None:
    """Feed prompt tokens [1, T] at positions start.. into the target (and a drafter's own cache).

    Returns the summed next-token entropy (nats) of the chunk's positions below ENTROPY_POSITIONS,
    or None when the chunk has none; the head runs only for those positions.
    """
    width = input_ids.shape[1]
    input_pos = torch.arange(start, start + width, device=input_ids.device)[None]
    entropy_width = max(0, min(width, ENTROPY_POSITIONS - start))
    # Without entropy positions the head still runs once: int8 heads cannot take an empty batch.
    head = {"logits_to": entropy_width} if entropy_width else {"logits_from": width - 1}
    logits = target(input_ids, input_pos, row, kv_len, **head)
    drafter.prefill(input_ids, input_pos, row, kv_len)
    if not entropy_width:
        return None
    logp = torch.log_softmax(logits[0].float(), dim=-1)
    return -(logp.exp() * logp).sum()
