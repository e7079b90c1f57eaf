"""How many tokens a speculative step yields, by drafter family, from published acceptance lengths.

A chain of k drafts: the i-th drafted token is accepted, given the ones before it were, with probability
    alpha_i = alpha_1 * decay^(i - trained)   for i > trained, alpha_1 up to `trained`
so a step yields E = 1 + sum_i prod_{j<=i} alpha_j tokens (the bonus token included). `trained` is 1 except for
an MTP checkpoint with several MTP layers, each trained for its own position; a single layer reused for later
positions decays (DeepSeek-V3's module: tau 1.875 at one draft, 3.20 at seven). A tree (SGLang topk > 1) offers
m = min(topk, (draft_tokens - 1) / steps) candidates per level; a level misses when every candidate does, with
probability (1 - alpha_i) * m^-s (siblings are correlated, so each extra one helps less). The verify pass
already pays for all of the tree's tokens (speed.py); this side credits only what they accept.

Per family, alpha_1 and decay are fitted to the published tau (and per-position shares, where published) at the
settings they were published for (autotune/data/acceptance.yaml); s is the smallest that reproduces the
published trees (sibling_exponent).
Measured accept lengths replace the prior's alpha_1 and keep its decay (calibration.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np
import yaml

from autotune import package_path
from autotune.predict.knobs import Knobs

DATA_FILE = package_path("data", "acceptance.yaml")
MAX_RATE = 0.99  # no drafted position is ever certain; keeps E finite and the inversions well posed
# Self-drafters of the embedded engine: no published acceptance; its own measured accept lengths replace these.
UNPUBLISHED = {
    "early_exit": 0.50,  # a guess
    "quantized_self": 0.90,  # an int8 copy of the target agrees with it almost always; a guess
}
# Fit grids: alpha_1 and decay per family, the sibling exponent over all trees. A weak pull of decay towards 1
# (flat) decides between fits that match equally (one published depth cannot tell alpha_1 from decay). Decay
# stops at 1: published per-position shares that rise with depth (vLLM's EAGLE-3 at seven drafts) are the easy
# contexts that got that far, which a per-position rate cannot tell from depth; flat errs against deep chains.
ALPHA_GRID = np.linspace(0.05, MAX_RATE, 189)
DECAY_GRID = np.linspace(0.5, 1.0, 51)
SIBLING_GRID = np.linspace(0.0, 1.0, 101)
DECAY_RIDGE = 1e-3
# A published tree counts as reproduced within this share of its tau (the sibling exponent's fit, below).
TREE_TOLERANCE = 0.10


@dataclass(frozen=True)
class Acceptance:
    """Per-position acceptance of a drafter: alpha_1 for the first `trained` positions, then decaying."""
    alpha_1: float
    decay: float = 1.0
    trained: int = 1

    @classmethod
    def flat(cls, alpha: float) -> Acceptance:
        """The same rate at every position (an acceptance given as one number)."""
        return cls(alpha, 1.0)

    def rate(self, i: int) -> float:
        """Acceptance of the i-th drafted token (1-based), given the ones before it were accepted."""
        return min(MAX_RATE, self.alpha_1 * self.decay ** max(0, i - self.trained))


@dataclass(frozen=True)
class Published:
    """One published acceptance length and the setting it was measured at (autotune/data/acceptance.yaml)."""
    family: str
    source: str
    model: str
    benchmark: str
    steps: int
    topk: int
    draft_tokens: int  # tokens verified per step, the root included
    tau: float
    per_position: tuple[float, ...] = ()
    mtp_layers: int = 1


def tokens_per_step(acc: Acceptance, steps: int, topk: int, draft_tokens: int, sibling_exponent: float) -> float:
    """E: tokens a step yields. A chain drafts draft_tokens - 1 tokens; a tree `steps` levels of m candidates."""
    if topk > 1:
        depth = min(steps, draft_tokens - 1)  # a path through the verified tree has at most its drafted nodes
        m = min(topk, max(1.0, (draft_tokens - 1) / steps))
        rates = [1 - (1 - acc.rate(i)) * m ** -sibling_exponent for i in range(1, depth + 1)]
    else:
        rates = [acc.rate(i) for i in range(1, draft_tokens)]
    total, reach = 1.0, 1.0
    for r in rates:
        reach *= r
        total += reach
    return total


def expected_tokens(acceptance: Acceptance | float, k: Knobs) -> float:
    """Tokens per sequence per step of config `k`; a float is a flat per-token rate."""
    if not k.drafter:
        return 1.0
    acc = acceptance if isinstance(acceptance, Acceptance) else Acceptance.flat(acceptance)
    return tokens_per_step(acc, k.draft_steps, k.topk, k.verify_tokens, sibling_exponent())


def scaled_to(length: float, k: Knobs, shape: Acceptance) -> Acceptance:
    """The acceptance of `shape`'s decay whose alpha_1 reproduces a measured accept length at config `k`
    (bisection: E grows with alpha_1)."""
    lo, hi = 0.0, MAX_RATE
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(replace(shape, alpha_1=mid), k) < length else (lo, mid)
    return replace(shape, alpha_1=(lo + hi) / 2)


def alpha_from_accept_length(length: float, k: Knobs) -> float:
    """The flat per-token rate whose E (expected_tokens) is a measured accept length at config `k`."""
    return scaled_to(length, k, Acceptance.flat(0.0)).alpha_1


@functools.cache
def published() -> tuple[Published, ...]:
    rows = yaml.safe_load(DATA_FILE.read_text())["sources"]
    return tuple(Published(**{**r, "per_position": tuple(r.get("per_position") or ())}) for r in rows)


def _chain_grid(row: Published) -> tuple[np.ndarray, np.ndarray]:
    """(E, cumulative shares per position) of `row`'s chain for every (alpha_1, decay) of the fit grid."""
    a, d = np.meshgrid(ALPHA_GRID, DECAY_GRID, indexing="ij")
    positions = np.arange(1, row.draft_tokens)
    rates = np.minimum(MAX_RATE, a[..., None] * d[..., None] ** np.maximum(0, positions - row.mtp_layers))
    reach = np.cumprod(rates, axis=-1)
    return 1 + reach.sum(axis=-1), reach


@functools.cache
def priors() -> dict[str, Acceptance]:
    """Per family: the (alpha_1, decay) whose chains best reproduce the published chains (squared log ratio of
    tau, so that over- and under-predicting by a factor weigh alike, plus the per-position shares where
    published). Trees do not enter: they fit the sibling exponent."""
    out = {}
    for family in sorted({r.family for r in published()}):
        loss = DECAY_RIDGE * np.log(DECAY_GRID)[None, :] ** 2
        for row in (r for r in published() if r.family == family and r.topk == 1):
            tau, reach = _chain_grid(row)
            loss = loss + np.log(tau / row.tau) ** 2
            if row.per_position:
                loss = loss + ((reach - np.array(row.per_position)) ** 2).sum(axis=-1)
        i, j = np.unravel_index(np.argmin(loss), loss.shape)
        out[family] = Acceptance(float(ALPHA_GRID[i]), float(DECAY_GRID[j]))
    return out


@functools.cache
def sibling_exponent() -> float:
    """The smallest exponent whose sibling gain reproduces every published tree (with its family's chain prior)
    within TREE_TOLERANCE, else the best fit. Smallest: the published trees come from the EAGLE authors' own
    tree search (EAGLE-2's reranking over 60 tokens), the best case; an engine's tree is credited no more."""
    trees = [r for r in published() if r.topk > 1]

    def errors(s: float) -> list[float]:
        return [tokens_per_step(replace(priors()[r.family], trained=r.mtp_layers), r.steps, r.topk,
                                r.draft_tokens, s) / r.tau - 1 for r in trees]
    within = [s for s in SIBLING_GRID if all(abs(e) <= TREE_TOLERANCE for e in errors(s))]
    return float(within[0] if within else min(SIBLING_GRID, key=lambda s: sum(e * e for e in errors(s))))


def prior(family: str, mtp_layers: int = 1) -> Acceptance:
    """The family's prior; an MTP checkpoint keeps alpha_1 over its own layers."""
    if family in UNPUBLISHED:
        return Acceptance.flat(UNPUBLISHED[family])
    acc = priors()[family]
    return replace(acc, trained=max(1, mtp_layers)) if family == "mtp" else acc


def drafter_acceptance(family: str, mtp_layers: int = 1, alpha_1: float | None = None) -> Acceptance:
    """The family's prior, its alpha_1 replaced by a measured one (calibration) where given."""
    acc = prior(family, mtp_layers)
    return replace(acc, alpha_1=alpha_1) if alpha_1 is not None else acc


# First-position acceptance per drafter family, fitted with a per-position decay to published acceptance
# lengths (autotune/data/acceptance.yaml); measured accept lengths replace it.
ALPHA_PRIORS = {family: prior(family).alpha_1 for family in (*priors(), *UNPUBLISHED)}
