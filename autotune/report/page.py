"""report.html: the figures, the summary and the tables rendered through templates/report.html.j2 (autoescaped),
with the Plotly library inlined once, in the first figure drawn."""
from __future__ import annotations

from pathlib import Path

import jinja2

from autotune.report.data import request_frames, trials_frame, validation_doc
from autotune.report.figures import (
    fig_draft_length,
    fig_entropy,
    fig_history,
    fig_importance,
    fig_latency,
    fig_pareto,
    fig_schedule,
    fig_stop_rule,
)
from autotune.report.png import PNG_FIGURES, write_pngs
from autotune.report.tables import all_table, cell_text, schedule_table, top_table
from autotune.report.text import summary_lines
from autotune.study.storage import StudyContext, load_study

TEMPLATES = jinja2.Environment(loader=jinja2.PackageLoader("autotune.report", "templates"), autoescape=True,
                               trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
TEMPLATES.filters["cell"] = cell_text


def write_report(study: str | Path | StudyContext, *, storage: str | None = None, out: str | Path | None = None,
                 png: bool = True) -> Path:
    """Write report.html (and png/*.png when a browser is there); returns the HTML path."""
    ctx = study if isinstance(study, StudyContext) else load_study(study, storage)
    df = trials_frame(ctx)
    validation = validation_doc(ctx)
    frames = request_frames(ctx)
    builders = {"history": lambda: fig_history(ctx, df), "pareto": lambda: fig_pareto(ctx, df),
                "importance": lambda: fig_importance(ctx, df), "draft_length": lambda: fig_draft_length(ctx, df),
                "entropy": lambda: fig_entropy(ctx, df, frames), "stop_rule": lambda: fig_stop_rule(ctx),
                "schedule": lambda: fig_schedule(ctx),
                "latency": lambda: fig_latency(ctx, df, frames, validation)}
    figures = {}
    for name, build in builders.items():
        try:
            figures[name] = build()
        except (KeyError, ValueError, TypeError, IndexError) as e:  # odd data in one plot must not cost the report
            figures[name] = f"could not be drawn ({type(e).__name__}: {e})"
    sections, inlined = [], False  # (name, a note saying why there is no plot, or the plot's HTML)
    for name, fig in figures.items():
        if isinstance(fig, str):
            sections.append({"name": name.replace("_", " "), "note": fig})
            continue
        fig.update_layout(template="plotly_white", height=450)
        sections.append({"name": name, "html": fig.to_html(full_html=False, div_id=f"fig-{name}",
                                                           include_plotlyjs="inline" if not inlined else False)})
        inlined = True
    path = Path(out) if out else ctx.directory / "report.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    pngs = write_pngs({k: v for k, v in figures.items() if k in PNG_FIGURES and not isinstance(v, str)},
                      path.parent / "png") if png else "PNG copies not requested"
    path.write_text(TEMPLATES.get_template("report.html.j2").render(
        name=ctx.name, summary=summary_lines(ctx, df, validation), sections=sections, schedule=schedule_table(ctx),
        top=top_table(ctx, validation), trials=all_table(df), pngs=pngs))
    return path
