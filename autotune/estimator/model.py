"""The speedup model the fit optimises: geometric acceptance, tokens per verify step over its cost.

A drafter proposes k tokens; the target accepts each with probability alpha until the first
rejection (Leviathan et al., arXiv:2211.17192), so a step yields (1 - alpha^(k+1)) / (1 - alpha)
tokens. A step proposing k tokens costs 1 + k c plain steps, or step_cost[k] where each k's cost
was measured. k = 0 (no speculation) has a speedup of exactly 1.
"""


def expected_speedup(alpha: float, k: int, c: float, step_cost: dict[int, float] | None = None) -> float:
    """Tokens per unit of time relative to no speculation (Leviathan et al.'s formula). A step proposing k
    tokens costs 1 + k c plain steps, or step_cost[k] where the cost of each k was measured."""
    tokens = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (step_cost[k] if step_cost else 1 + k * c)


def best_k(alpha: float, c: float, max_k: int, step_cost: dict[int, float] | None = None) -> int:
    """The k (0 = no speculation: speedup exactly 1) of the highest expected speedup; with measured
    step costs, among the k measured."""
    ks = sorted(step_cost) if step_cost else range(max_k + 1)
    return max(ks, key=lambda k: (expected_speedup(alpha, k, c, step_cost), -k))


def alpha_mle(accepted: float, rejections: float) -> float | None:
    """Maximum likelihood of alpha under the geometric model: a step that accepts a < k proposals is a
    accepts and one rejection, a fully accepted step k accepts and none. (accepted / proposed is biased
    low: proposals after the first rejection were never tested.)"""
    trials = accepted + rejections
    return accepted / trials if trials > 0 else None


def rejections_from_moments(steps: float, proposed: float, accepted: float) -> float:
    """Rejections when the data lacks them: solve mean accepts per step = a(1-a^k)/(1-a), k = proposed/steps."""
    if steps <= 0 or proposed <= 0:
        return 0.0
    k, mean = proposed / steps, accepted / steps
    if mean >= k - 1e-9:
        return 0.0
    lo, hi = 0.0, 1.0 - 1e-9
    for _ in range(60):  # the mean rises with a: bisection
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mid * (1 - mid ** k) / (1 - mid) < mean else (lo, mid)
    return steps * (1 - lo ** k)
