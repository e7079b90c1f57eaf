"""The report's tables as rows of values (the page's template lays them out): the fitted draft-length schedule,
the top configurations with their validation verdicts and launch commands, and every trial with its fate."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from autotune.report.data import launch_text
from autotune.report.text import agreement_line, config_short
from autotune.study.schedule import read_fit
from autotune.study.storage import StudyContext
from autotune.validate.record import Validation


@dataclass
class Table:
    headers: list[str]
    rows: list[list]
    code_columns: tuple[int, ...] = ()  # cells shown as <code> (launch commands)


def cell_text(value) -> str:
    """A cell as text: blank where missing (None, or NaN: a frame column's missing value), floats to 4 digits."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def schedule_table(ctx: StudyContext) -> Table | None:
    """The fit's cells: per batch size and draft length, the median, its interval and whether it was chosen."""
    fit = read_fit(ctx.best_dir)
    if fit is None:
        return None
    rows = [[c.batch, c.draft_length, c.median, f"{c.low:.4g}..{c.high:.4g}", c.runs, c.accept_length, c.step_ms,
             "chosen" if fit.chosen.get(c.batch) == c.draft_length else ""] for c in fit.cells]
    return Table(["batch", "k", "output tok/s", "90% interval", "runs", "accept len", "step ms", ""], rows)


def top_table(ctx: StudyContext, validation: Validation | None, limit: int = 10) -> Table | None:
    """The best trials (None: no trial met its requirements)."""
    verdicts = {c.trial: c for c in validation.candidates} if validation else {}
    metric = ctx.primary().name
    rows = []
    for t in ctx.ranked()[:limit]:
        m = t.user_attrs.get("metrics") or {}
        v = verdicts.get(t.number)
        verdict = "not validated" if v is None else v.status + (f": {'; '.join(r.text for r in v.reasons)}"
                                                                if v.reasons else f" (median {v.stats[metric].median:.4g})")
        q = (v.quality if v else None) or {}
        agreement = agreement_line(q)
        if agreement:
            verdict += f"; greedy output vs the baseline: {agreement}"
        if q.get("first_divergence"):
            d = q["first_divergence"]
            verdict += f" ({d['baseline']!r} vs {d['candidate']!r})" + (f"; {q['note']}" if q.get("note") else "")
        rows.append([t.number, t.values[0], m.get("e2e_ms_p95"), m.get("accept_length"), t.user_attrs.get("warmup_s"),
                     verdict, config_short(t.user_attrs.get("config") or {}),
                     launch_text(ctx, t.user_attrs.get("config") or {})])
    if not rows:
        return None
    # warm-up: compiling and graph capture before the measured requests (launch cost, not speed)
    return Table(["#", metric, "p95 e2e ms", "accept len", "warm-up s", "validation", "config", "launch command"],
                 rows, (7,))


def all_table(df: pd.DataFrame) -> Table:
    rows = [[r["number"], r["status"], r["value"], r.get("warmup_s"), config_short(r["config"]), r["reason"]]
            for _, r in df.iterrows()]
    return Table(["#", "status", "value", "warm-up s", "config", "why (failures, SLO misses)"], rows)
