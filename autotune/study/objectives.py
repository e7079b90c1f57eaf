"""What a study optimises: metric names from the benchmark summary, their directions, the sampler."""
from __future__ import annotations

import math
import warnings

import optuna

from autotune.bench.metric_registry import Metric, metric

# objective -> the summary metrics it optimises, primary first (directions: the metric registry)
OBJECTIVES = {
    "throughput": ["output_tok_s"],
    "latency": ["e2e_ms_p95"],
    "pareto": ["output_tok_s", "e2e_ms_p95"],
}


def metrics(objective: str) -> list[Metric]:
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r} (choose from {', '.join(OBJECTIVES)})")
    return [metric(name) for name in OBJECTIVES[objective]]


def primary(objective: str) -> Metric:
    return metrics(objective)[0]


def directions(objective: str) -> list[str]:
    return [m.direction for m in metrics(objective)]


def values(summary: dict, objective: str) -> list[float] | None:
    """The objective values of a benchmark summary; None when a metric is missing or not finite."""
    out = []
    for m in metrics(objective):
        v = summary.get(m.name)
        if v is None or not math.isfinite(float(v)):
            return None
        out.append(float(v))
    return out


def is_better(a: list[float], b: list[float] | None, objective: str) -> bool:
    """a beats b on the first (primary) objective."""
    return b is None or primary(objective).better(a[0], b[0])


def make_sampler(objective: str, seed: int | None = None, n_startup_trials: int = 6) -> optuna.samplers.BaseSampler:
    """TPE for one objective and for `pareto` (its multi-objective form), multivariate with group
    decomposition so the conditional parameters (draft settings under each drafter) are modelled
    per sub-space instead of being sampled independently. Few random start-up trials: the seeds
    enqueued first already spread over the space, and each trial costs a launch. constant_liar: trials
    still running (parallel runners, other workers) count as bad, so workers don't all pick one spot."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # `group` is experimental
        return optuna.samplers.TPESampler(
            n_startup_trials=n_startup_trials, multivariate=True, group=True, constant_liar=True, seed=seed)


def make_pruner(objective: str) -> optuna.pruners.BasePruner:
    """Prune a trial whose quick first measurement is in the bottom quarter of those seen so far.
    Optuna's pruners are single-objective: `pareto` runs every trial to the end."""
    if len(metrics(objective)) > 1:
        return optuna.pruners.NopPruner()
    # Optuna's percentile is the share kept: 75 keeps the top three quarters.
    return optuna.pruners.PercentilePruner(75.0, n_startup_trials=5, n_warmup_steps=0)
