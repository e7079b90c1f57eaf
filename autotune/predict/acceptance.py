"""How many tokens a speculative step yields, by drafter family, from published acceptance lengths.

A chain of k drafts: the i-th drafted token is accepted, given the ones before it were, with probability
    alpha_i = alpha_1 * decay^(i - trained)   for i > trained, alpha_1 up to `trained`
so a step yields E = 1 + sum_i prod_{j<=i} alpha_j tokens (the bonus token included). `trained` is 1 except for
an MTP checkpoint with several MTP layers, each trained for its own position; a single layer reused for later
positions decays (DeepSeek-V3's module: tau 1.875 at one draft, 3.20 at seven). A tree (SGLang topk > 1) is
EAGLE-2's dynamic tree as SGLang drafts it: the root's topk children, then at each of `steps` levels the topk
children of that level's topk best nodes, and the target verifies the draft_tokens - 1 best of all of them. A
node's value is its path's acceptance, the product of its ancestors' and its own share: the r-th ranked candidate
at depth i is accepted with q_i(r) = c_i(r) - c_i(r - 1), where c_i(m) = 1 - (1 - alpha_i)^(m^s) is the chance
that one of the m best is: m^s independent tries (s < 1: siblings are correlated, so each extra one helps less,
and none helps a drafter that never agrees). E = 1 + the sum of the verified nodes' values: the optimal tree of a
positional acceptance vector (Sequoia, arXiv 2402.12374, sec. 3.1), picked as EAGLE-2 reranks by value (arXiv
2406.16858: the draft's confidence approximates acceptance). A small budget thus stays close to a chain, and a
large one widens the shallow levels first. The verify pass already pays for all of the tree's tokens (speed.py);
this side credits only what they accept.

Per family, alpha_1 and decay are fitted to the published tau (and per-position shares, where published) at the
settings they were published for (autotune/data/acceptance.yaml); s is the one that best reproduces the published
trees (sibling_exponent).
Measured accept lengths replace the prior's alpha_1 and keep its decay (calibration.py).
"""
from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass, replace

import numpy as np
import yaml
from scipy.optimize import minimize_scalar

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
SIBLING_GRID = np.linspace(0.0, 2.0, 101)
DECAY_RIDGE = 1e-3


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
    # Rows of one draft head measured at several settings in one run: they fit the tree's sibling exponent with
    # an alpha_1 of their own (another head than the family's prior is fitted to), not the family's prior.
    sweep: str = ""


def tokens_per_step(acc: Acceptance, steps: int, topk: int, draft_tokens: int, sibling_exponent: float) -> float:
    """E: tokens a step yields. A chain drafts draft_tokens - 1 tokens; a tree is verified_tree's."""
    if topk > 1:
        return verified_tree(acc, steps, topk, draft_tokens - 1, sibling_exponent)
    total, reach = 1.0, 1.0
    for i in range(1, draft_tokens):
        reach *= acc.rate(i)
        total += reach
    return total


@functools.lru_cache(maxsize=4096)
def verified_tree(acc: Acceptance, steps: int, topk: int, nodes: int, s: float) -> float:
    """1 + the values of the `nodes` best candidates of SGLang's draft tree (select_top_k_tokens expands the topk
    best of each level; organize_draft_results keeps the best over all levels), a value being the path's acceptance."""
    def share(i: int, r: int) -> float:  # q_i(r) = c_i(r) - c_i(r - 1), c_i(0) = 0
        missed = lambda m: (1 - acc.rate(i)) ** (m ** s)
        return (1.0 if r == 1 else missed(r - 1)) - missed(r)
    level, candidates = [1.0], []
    for i in range(1, steps + 1):
        children = sorted((v * share(i, r) for v in level for r in range(1, topk + 1)), reverse=True)
        candidates += children
        level = children[:topk]
    return 1 + sum(heapq.nlargest(nodes, candidates))


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
        for row in (r for r in published() if r.family == family and r.topk == 1 and not r.sweep):
            tau, reach = _chain_grid(row)
            loss = loss + np.log(tau / row.tau) ** 2
            if row.per_position:
                loss = loss + ((reach - np.array(row.per_position)) ** 2).sum(axis=-1)
        i, j = np.unravel_index(np.argmin(loss), loss.shape)
        out[family] = Acceptance(float(ALPHA_GRID[i]), float(DECAY_GRID[j]))
    return out


@functools.cache
def sibling_exponent() -> float:
    """The exponent whose trees best reproduce every published tree (squared log ratio of tau). A sweep's rows
    take, at each exponent, the alpha_1 that fits the sweep best (its chain, where it has one, pins it) with the
    family's decay; other trees their family's prior."""
    def error(acc: Acceptance, r: Published, s: float) -> float:
        e = tokens_per_step(replace(acc, trained=r.mtp_layers), r.steps, r.topk, r.draft_tokens, s)
        return float(np.log(e / r.tau) ** 2)

    def sweep_error(rows: list[Published], s: float) -> float:
        shape = priors()[rows[0].family]
        fit = minimize_scalar(lambda a: sum(error(replace(shape, alpha_1=a), r, s) for r in rows),
                              bounds=(ALPHA_GRID[0], MAX_RATE), method="bounded")
        return float(fit.fun)

    sweeps = {r.sweep for r in published() if r.sweep}

    def loss(s: float) -> float:
        alone = sum(error(priors()[r.family], r, s) for r in published() if r.topk > 1 and not r.sweep)
        return alone + sum(sweep_error([r for r in published() if r.sweep == w], s) for w in sweeps)
    return float(min(SIBLING_GRID, key=loss))


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
