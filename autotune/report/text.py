"""The report's sentences, shared by the HTML page and `autotune show`: the summary, the winner against its
rivals, the greedy-output agreement with the baseline, and a configuration in one line."""
from __future__ import annotations

import pandas as pd

from autotune.export import hardware_line, versions
from autotune.study.schedule import read_fit
from autotune.study.storage import StudyContext
from autotune.validate.record import Validation


def summary_lines(ctx: StudyContext, df: pd.DataFrame, validation: Validation | None) -> list[str]:
    counts = df["status"].value_counts().to_dict() if not df.empty else {}
    lines = [f"study {ctx.name}: engine {ctx.engine}, objective {ctx.objective}, workload {ctx.workload}",
             f"trials: {len(df)} ({', '.join(f'{v} {k}' for k, v in counts.items()) or 'none'})",
             f"hardware: {hardware_line(ctx.provenance)}",
             "versions: " + ", ".join(f"{k} {v}" for k, v in versions(ctx.provenance).items() if v)]
    metric = ctx.primary().name
    if validation and validation.winner:
        w = validation.winner
        s = w.stats[metric]
        gain = f", {w.gain_over_baseline:.2f}x the baseline" if w.gain_over_baseline and validation.winner_changes() else ""
        who = f"trial {w.trial}" if w.trial is not None else w.label or "the baseline"
        lines.append(f"validated winner: {who}, {metric} median {s.median:.4g} "
                     f"(95% CI {s.ci95[0]:.4g}..{s.ci95[1]:.4g}) over {len(s.values)} repeats{gain}")
        if w.warning:
            lines.append(f"warning: {w.warning}")
        lines += comparison_lines(validation)
        winner = validation.candidate(w.trial)
        agreement = agreement_line((winner.quality if winner else None) or validation.baseline.quality)
        if agreement:
            lines.append(f"greedy output of the winner vs the baseline: {agreement}")
    elif validation:
        lines.append("validation: no configuration passed")
    best = ctx.ranked()
    if best:
        lines.append(f"best in the study: trial {best[0].number}, {metric} {best[0].values[0]:.4g}"
                     + ("" if validation else " (not validated: run `autotune validate`)"))
    for d in validation.demoted if validation else []:
        lines.append(f"demoted trial {d.trial}: {'; '.join(r.text for r in d.reasons)}")
    fit = read_fit(ctx.best_dir)
    if fit:
        lines.append(fit.summary_line() + "".join(f"; {note}" for note in fit.notes))
    return lines


def comparison_lines(validation: Validation) -> list[str]:
    """The winner against each rival (the runner-up, the baseline) with the noise, and the tie if one."""
    lines = []
    for c in validation.comparisons:
        if c.gain is None:
            lines.append(f"{c.winner} vs {c.rival}: too few repeats to compare ({c.repeats})")
            continue
        lo, hi = c.interval
        lines.append(f"{c.winner} vs {c.rival}: {c.gain:.3f}x ({c.confidence:.0%} interval {lo:.3f}..{hi:.3f}, "
                     f"{c.repeats[0]} and {c.repeats[1]} repeats): "
                     + ("beyond the noise" if c.beyond_noise else "within the noise"))
    if validation.tie:
        lines.append(f"tie: {validation.tie.why}")
    return lines


def agreement_line(q: dict | None) -> str | None:
    """Token agreement of a configuration's greedy outputs with the plain baseline's, in one line."""
    if not q or not q.get("checked") or "identical_share" not in q:
        return None
    parted = [f"prompt {p['prompt']} at {q['unit']} {p['first_divergence']} of {p['baseline_tokens']}"
              for p in q["per_prompt"] if p["first_divergence"] is not None]
    text = (f"{q['identical_share']:.0%} of the baseline's {q['unit']}s identical, {q['identical']} of {q['prompts']} "
            f"prompts identical ({q['mode']})")
    return text + (f"; first divergence: {', '.join(parted)}" if parted else "")


def config_short(config: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in config.items() if v not in (None, [], "none")) or "(defaults)"
