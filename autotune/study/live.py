"""A live table of trials as they finish, the best so far, and the closing summary."""
from __future__ import annotations

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from autotune.bench.metric_registry import metric
from autotune.study import objectives, record

STATUS_STYLE = {"ok": "green", "infeasible": "yellow", "pruned": "cyan", "rejected": "magenta",
                "failed": "red", "duplicate": "dim", "interrupted": "red"}
# The measured columns, headed short: the table must fit a terminal beside the configuration column.
METRIC_COLUMNS = (("tok/s", "output_tok_s"), ("p95 e2e ms", "e2e_ms_p95"), ("p95 ITL ms", "itl_ms_p95"),
                  ("accept len", "accept_length"))


def config_text(config: dict, defaults: dict) -> str:
    """Only what differs from the engine defaults: the table stays narrow."""
    diff = [f"{k}={v}" for k, v in config.items() if defaults.get(k, object()) != v]
    return " ".join(diff) or "(defaults)"


class LiveView:
    def __init__(self, objective: str, defaults: dict | None = None, console: Console | None = None,
                 enabled: bool = True):
        self.objective, self.defaults = objective, defaults or {}
        self.console = console or Console()
        self.enabled = enabled
        self.rows: list[tuple] = []
        self.best_number: int | None = None
        self.best_value: list[float] | None = None
        self.current = ""
        self.live = Live(console=self.console, refresh_per_second=4, transient=False) \
            if enabled and self.console.is_terminal else None

    # -- lifecycle --------------------------------------------------------------------------------
    def __enter__(self):
        if self.live:
            self.live.start()
            self._refresh()
        return self

    def __exit__(self, *exc):
        self.current = ""
        if self.live:
            self._refresh()
            self.live.stop()

    def note(self, message: str):
        if self.enabled:
            self.console.print(f"[bold]{message}[/]")

    def started(self, number: int, config: dict):
        self.current = f"trial {number}: {config_text(config, self.defaults)}"
        self._refresh()
        self._plain(self.current)

    def phase(self, number: int, what: str):
        self.current = f"trial {number}: {what}"
        self._refresh()
        self._plain(self.current)

    def _plain(self, line: str):
        """Not on a terminal (piped, CI): progress as plain lines, never wrapped, instead of a redrawn table."""
        if self.enabled and not self.live:
            self.console.print(line, soft_wrap=True, highlight=False, markup=False)

    def show_history(self, study):
        for trial in study.get_trials(deepcopy=False):
            if trial.state.is_finished():
                self._add(trial)
        self._refresh()

    def finished(self, trial, study):
        self._add(trial)
        self.current = ""
        self._plain(" | ".join(str(c) for c in self.rows[-1]))
        self._refresh()

    # -- rendering --------------------------------------------------------------------------------
    def _add(self, trial):
        a = trial.user_attrs
        m = a.get("metrics") or a.get("quick") or {}  # a pruned trial shows its quick measurement
        status = a.get("status", trial.state.name.lower())
        if record.is_ok(trial):
            values = list(trial.values or [])
            if values and objectives.is_better(values, self.best_value, self.objective):
                self.best_number, self.best_value = trial.number, values
        reason = a.get("failure_kind") or ""
        self.rows.append((trial.number, status + (f" ({reason})" if reason else ""),
                          config_text(a.get("config", trial.params), self.defaults),
                          *(metric(name).format(m.get(name)) for _, name in METRIC_COLUMNS), a.get("launch", "-")))

    def table(self) -> Table:
        t = Table(title=f"autotune: trials ({self.objective})", expand=False)
        for col, justify in (("#", "right"), ("status", "left"), ("config (vs defaults)", "left"),
                             *((head, "right") for head, _ in METRIC_COLUMNS), ("server", "left")):
            t.add_column(col, justify=justify, overflow="fold")
        for row in self.rows:
            style = STATUS_STYLE.get(row[1].split(" ")[0], "")
            best = row[0] == self.best_number
            t.add_row(*(str(c) for c in row), style=("bold " + style) if best else style)
        return t

    def _render(self):
        parts = [self.table()]
        if self.best_number is not None:
            parts.append(Text(f"best so far: trial {self.best_number} ({self._metric_text(self.best_value)})",
                              style="bold green"))
        if self.current:
            parts.append(Text(self.current, style="italic"))
        return Group(*parts)

    def _refresh(self):
        if self.live:
            self.live.update(self._render())

    def _metric_text(self, values) -> str:
        return ", ".join(f"{m.name} {v:.4g}" for m, v in zip(objectives.metrics(self.objective), values))

    def summary(self, best, default, gain, *, launches: int, saved: int, directory, interrupted: bool):
        """The search's end (validation, which may export another configuration, comes after). Not on a terminal
        the rows were printed one a line as trials finished: they are not printed again as a wrapped table."""
        if not self.enabled:
            return
        c = self.console
        if interrupted:
            c.print("[yellow]stopped early (Ctrl-C); every finished trial is kept[/]")
        if best is None:
            c.print("[red]no trial met the requirements[/]; see the failure column and the logs in "
                    f"{directory / 'logs'}")
        else:
            c.print(f"[bold green]search best: trial {best.number}[/] "
                    f"{config_text(best.user_attrs.get('config', {}), self.defaults)} "
                    f"({self._metric_text(best.values)})")
            if gain is not None and default is not None:
                c.print(f"gain over the engine defaults (trial {default.number}, same study): [bold]{gain:.2f}x[/]")
            else:
                c.print("the engine defaults were not among the trials: the search alone shows no gain over them")
        c.print(f"launches: {launches}, saved by reusing a running server: {saved}; study in {directory}")
