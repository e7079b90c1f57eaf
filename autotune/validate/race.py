"""The race: who cannot win and why (`judge`), who gets one more fresh launch (`next_round`), whom the
winner must beat beyond the noise (`rivals`), and what is exported when it does not (`settle`).

A configuration is demoted, with its reasons, when it fails to launch, has errors, misses an SLO in any
repeat, or is noisy (MAD above `max_noise` of the median). Noise alone does not demote: it widens the
interval a winner's gain must clear, so a noisy configuration 5x faster than a steady one still wins (on
the H200 a bf16 + CUDA-graph engine at 13% MAD lost to the float32 defaults at a fifth of its speed when
noise ranked it below every steady one), and one inside the noise of a rival ties with it. Decisions read
a reason's kind, never its text.
"""
from __future__ import annotations

from autotune.bench.metric_registry import MAXIMIZE
from autotune.study.budget import FLOOR, Finish, Prices
from autotune.study.record import effective_key
from autotune.study.storage import StudyContext
from autotune.validate.measure import launch_groups
from autotune.validate.record import Reason
from autotune.validate.statistics import beats


def repeat_reasons(runs: list[dict], slo) -> list[Reason]:
    """What the repeats showed, repeat by repeat: failed requests and SLO misses."""
    reasons = []
    for r, run in enumerate(runs):
        if run.get("error_rate"):
            reasons.append(Reason(kind="request_errors", text=f"flaky: repeat {r} had errors {run.get('errors_by_kind')}"))
        reasons += [Reason(kind="slo", text=f"slo: repeat {r} {miss}") for miss in (slo.check(run) if slo else [])]
    return reasons


def judge(ctx: StudyContext, rec: dict, slo, max_noise: float) -> list[Reason]:
    """Why this configuration cannot be the winner (empty: it passes)."""
    if rec.get("failure"):
        return [Reason(kind=rec["failure"].kind, text=f"flaky: {rec['failure'].text}")]
    reasons = repeat_reasons(rec["runs"], slo)
    metric = ctx.primary().name
    noise = rec["stats"][metric]["rel_mad"]
    if noise is not None and noise > max_noise:
        reasons.append(Reason(kind="noisy", text=f"noisy: {metric} MAD {noise:.0%} of the median > {max_noise:.0%}"))
    if rec.get("greedy_error"):
        reasons.append(Reason(kind="quality", text=f"quality: greedy requests failed ({rec['greedy_error']})"))
    return reasons


def only_noisy(reasons: list[Reason]) -> bool:
    """No fault but noise, if any (the interval weighs noise)."""
    return all(r.kind == "noisy" for r in reasons)


def contenders(results: list[dict], metric: str) -> list[dict]:
    """Measured configurations that may win: those whose only fault, if any, is noise (the interval weighs it)."""
    measured = [r for r in results if r.get("stats") and r["stats"][metric]["median"] is not None]
    return [r for r in measured if only_noisy(r["reasons"])]


def pick_winner(results: list[dict], metric: str, direction: str) -> tuple[dict | None, str | None]:
    """The best configuration whose only fault, if any, is noise, with a warning when it is noisy. Whether it
    beats the others beyond that noise is for `settle` (a tie exports the simpler configuration)."""
    pool = contenders(results, metric)
    if not pool:
        return None, None
    pick = max if direction == MAXIMIZE else min
    best = pick(pool, key=lambda r: r["stats"][metric]["median"])
    steady = not best["reasons"]
    return best, None if steady else f"trial {best['trial']} wins by median with {best['reasons'][0].text}"


def rivals(ctx: StudyContext, winner: dict, results: list[dict], baseline: dict, metric: str, direction: str) -> list[dict]:
    """What the winner must beat beyond the noise: the runner-up (noisy ones included: the interval weighs
    their noise), and the baseline (the engine defaults)."""
    pool = [r for r in contenders(results, metric) if r is not winner]
    pick = max if direction == MAXIMIZE else min
    out = [pick(pool, key=lambda r: r["stats"][metric]["median"])] if pool else []
    base_key = effective_key(ctx.adapter, baseline["config"])
    measured = (baseline.get("stats") or {}).get(metric, {}).get("median") is not None
    if measured and all(effective_key(ctx.adapter, r["config"]) != base_key for r in (winner, *out)):
        out.append(baseline)  # unless the winner or the runner-up is the baseline's configuration
    return out


def next_round(ctx: StudyContext, results: list[dict], baseline: dict, *, confidence: float, looks: int,
               max_repeats: int) -> list[dict]:
    """Who gets one more fresh launch: the winner and each rival it does not yet beat beyond the noise (below
    `max_repeats`), with every runtime variant that shares a launch with one of them, so variants stay paired
    launch for launch. Empty once the race is settled or capped."""
    primary = ctx.primary()
    metric, direction = primary.name, primary.direction
    winner, _ = pick_winner(results, metric, direction)
    if winner is None:
        return []
    close = [r for r in rivals(ctx, winner, results, baseline, metric, direction)
             if not beats(winner, r, metric, direction, confidence, looks)]
    more = [r for r in (winner, *close) if len(r["runs"]) < max_repeats and not r.get("failure")]
    if not close or not more:
        return []
    chosen = {id(r) for r in more}
    for group in launch_groups(ctx, results):
        if any(id(r) in chosen for r in group):
            more += [r for r in group if id(r) not in chosen and not r.get("failure")]
    return more


def settle(ctx: StudyContext, winner: dict | None, comparisons: list[dict], results: list[dict], baseline: dict,
           race_cut: bool = False):
    """(the configuration to export, the tie or None). A winner that does not beat a rival beyond the noise
    ties with it; of the tied ones, the one closest to the engine defaults (fewest settings changed: the
    simpler launch) is exported, the faster one on equal counts. `race_cut`: the budget ended the race
    before its repeats were in, so the fastest by median is exported."""
    if winner is None:
        return None, None
    exportable = only_noisy(baseline.get("reasons", []))  # not flaky, SLOs met
    tied = [c["b"] for c in comparisons if not c["beyond_noise"] and (c["b"] is not baseline or exportable)]
    if not tied:
        return winner, None
    group = [winner, *tied]
    primary = ctx.primary()
    metric, direction = primary.name, primary.direction
    sign = -1 if direction == MAXIMIZE else 1
    changed = {r["label"]: sorted(ctx.adapter.effective(r["config"])) for r in group}
    others = ", ".join(r["label"] for r in tied)
    if race_cut:
        chosen = winner
        why = (f"{winner['label']} is fastest by median; the budget ended the race before it beat {others} beyond "
               f"the noise; exported {winner['label']}, the fastest on the evidence the race gathered")
    else:
        chosen = min(group, key=lambda r: (len(ctx.adapter.effective(r["config"])), sign * r["stats"][metric]["median"]))
        why = (f"{winner['label']} is fastest by median but does not beat {others} beyond the noise; exported "
               f"{chosen['label']}, the one with fewest settings changed from the engine defaults")
    return chosen, {"between": [r["label"] for r in group], "trials": [r.get("trial") for r in group],
                    "fastest": winner["label"], "exported": chosen["label"], "changed": changed,
                    "race_cut": race_cut, "why": why}


def fitting_round(prices: Prices, seconds: float, top: int, repeats: int, quality_prompts: int) -> tuple[int, int]:
    """(top, repeats) of the largest first round that fits in `seconds`: configurations dropped first (the
    best ones stay), then repeats; at least the best configuration and the baseline, twice each."""
    finish = Finish(top, repeats, quality_prompts, estimator_passes=False)
    least = min(repeats, FLOOR["repeats"])
    for n in range(repeats, least - 1, -1):
        for k in range(top, FLOOR["top"] - 1, -1):
            if finish.validation_s(prices, k + 1, n) <= seconds:
                return k, n
    return FLOOR["top"], least


def round_seconds(ctx: StudyContext, recs: list[dict], prices: Prices) -> float:
    """One more round of `recs`: a launch per launch group, a benchmark per record."""
    return len(launch_groups(ctx, recs)) * prices.launch_s + len(recs) * prices.bench_s
