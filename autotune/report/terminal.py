"""`autotune show`: the report's summary, top configurations and failures in the terminal (rich)."""
from __future__ import annotations

from pathlib import Path

from autotune.bench.metric_registry import metric as metric_of
from autotune.report.data import trials_frame, validation_doc
from autotune.report.text import config_short, summary_lines
from autotune.study.storage import load_study

SHOWN_COLUMNS = ("e2e_ms_p95", "accept_length")  # beside the objective: latency and acceptance


def show(study: str | Path, *, storage: str | None = None, console=None, limit: int = 10) -> None:
    from rich.console import Console
    from rich.table import Table

    ctx = load_study(study, storage)
    console = console or Console()
    df = trials_frame(ctx)
    validation = validation_doc(ctx)
    for line in summary_lines(ctx, df, validation):
        console.print(line, highlight=False, markup=False)
    metric = ctx.primary().name
    table = Table(title=f"top configurations by {metric}")
    for col in ("#", metric, *(metric_of(n).label for n in SHOWN_COLUMNS), "config"):
        table.add_column(col, overflow="fold")
    for t in ctx.ranked()[:limit]:
        m = t.user_attrs.get("metrics") or {}
        table.add_row(str(t.number), f"{t.values[0]:.4g}", *(metric_of(n).format(m.get(n)) for n in SHOWN_COLUMNS),
                      config_short(t.user_attrs.get("config") or {}))
    console.print(table)
    failed = df[~df["ok"]]
    if not failed.empty:
        console.print(f"not ok: {len(failed)} trial(s): " + "; ".join(
            f"#{r['number']} {r['status']}" + (f" ({r['reason'][:80]})" if r["reason"] else "") for _, r in failed.iterrows()),
            highlight=False, markup=False)
    files = [p for p in (ctx.best_dir / "launch.sh", ctx.directory / "report.html") if p.exists()]
    if files:
        console.print("files: " + ", ".join(map(str, files)), highlight=False, markup=False)

