"""The target distribution of a batch of rows, and draws from it.

Every row carries its own temperature, top-k, top-p and repetition penalty (as [B] tensors), so
greedy and sampled requests verify together. All of it stays on the device: no per-token Python.
"""
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class SamplingBatch:
    """Per-row sampling settings of one step, as device tensors (built once per step)."""

    temperature: Tensor  # [B] float; 0 = greedy
    top_k: Tensor  # [B] long; 0 = off
    top_p: Tensor  # [B] float
    repetition_penalty: Tensor  # [B] float
    presence: Tensor | None  # [B, V] bool: tokens already in the sequence (only when a row has a penalty)
    generators: list[torch.Generator | None]  # per row; None for greedy rows
    any_sampled: bool
    any_filtered: bool  # some row has top_k or top_p < 1

    @property
    def greedy(self) -> Tensor:
        return self.temperature == 0


def penalise(logits: Tensor, penalty: Tensor, presence: Tensor) -> Tensor:
    """HF's repetition penalty: divide positive logits of seen tokens by the penalty, multiply negative ones.

    logits [B, T, V]; presence [B, T, V] (position t sees the tokens before it, drafts included).
    """
    penalty = penalty[:, None, None]
    scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(presence, scaled, logits)


def presence_along(presence: Tensor, tokens: Tensor) -> Tensor:
    """[B, V] seen-before mask -> [B, T+1, V]: position t also sees tokens[:, :t] ([B, T] proposals)."""
    steps = [presence]
    for t in range(tokens.shape[1]):
        steps.append(steps[-1].scatter(1, tokens[:, t : t + 1], True))
    return torch.stack(steps, 1)


def probabilities(logits: Tensor, sampling: SamplingBatch) -> Tensor:
    """Softmax at each row's temperature, then its top-k and top-p cut (HF's order). Greedy rows get T=1."""
    temperature = torch.where(sampling.greedy, 1.0, sampling.temperature)
    probs = torch.softmax(logits.float() / temperature[:, None, None], dim=-1)
    if not sampling.any_filtered:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)
    top_k = torch.where(sampling.top_k > 0, sampling.top_k, probs.shape[-1])
    keep = rank < top_k[:, None, None]
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    keep = keep & (mass_before < sampling.top_p[:, None, None])
    filtered = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
    return filtered / filtered.sum(-1, keepdim=True)


def exponential_noise(shape: tuple[int, ...], generators: list[torch.Generator | None], device) -> Tensor:
    """Exp(1) noise per row from that row's generator; argmax(p / noise) is a draw from p."""
    noise = torch.ones((len(generators), *shape), device=device)
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    return noise


def uniform_noise(shape: tuple[int, ...], generators: list[torch.Generator | None], device) -> Tensor:
    noise = torch.zeros((len(generators), *shape), device=device)
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].uniform_(generator=generator)
    return noise


def draw(probs: Tensor, noise: Tensor) -> Tensor:
    """One token per distribution: the exponential-race form of inverse sampling (no host sync)."""
    return torch.argmax(probs / noise, dim=-1)
