"""The study report: one self-contained HTML file (Plotly inlined once), PNG copies of the key plots
when a browser is installed (kaleido), and `show`, the same summary in the terminal.

Sections: summary (winner, gain, hardware, versions, validation verdicts), optimization history,
Pareto fronts (throughput vs p95 latency; tok/s per user vs tok/s per GPU), parameter importances,
draft-length curve per drafter, accept length vs prompt entropy, latency distributions of the winner
vs the baseline, the top configurations with their launch commands, and every trial with its fate.
Per-request data comes from studies/<name>/validation/*.parquet and studies/<name>/requests/*.parquet
where they exist; otherwise the per-trial summaries stand in, and the section says so.

Modules: data.py reads the study, figures.py draws, tables.py and text.py say it in rows and sentences,
page.py renders templates/report.html.j2, png.py copies plots as PNG, terminal.py is `autotune show`.
"""
from autotune.report.figures import fig_stop_rule
from autotune.report.page import write_report
from autotune.report.png import PNG_FIGURES
from autotune.report.terminal import show

__all__ = ["PNG_FIGURES", "fig_stop_rule", "show", "write_report"]
