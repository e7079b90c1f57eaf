"""The study report: one self-contained HTML file (Plotly inlined once), PNG copies of the key plots
when a browser is installed (kaleido), and `show`, the same summary in the terminal.

Sections: summary (winner, gain, hardware, versions, validation verdicts), optimization history,
Pareto fronts (throughput vs p95 latency; tok/s per user vs tok/s per GPU), parameter importances,
draft-length curve per drafter, accept length vs prompt entropy, latency distributions of the winner
vs the baseline, the top configurations with their launch commands, and every trial with its fate.
Per-request data comes from studies/<name>/validation/*.parquet and studies/<name>/requests/*.parquet
where they exist; otherwise the per-trial summaries stand in, and the section says so.
"""
from __future__ import annotations

import html
import itertools
import json
import math
import shlex
import warnings
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from autotune.export import hardware_line, versions
from autotune.study.record import is_ok
from autotune.study.schedule import read_fit
from autotune.study.storage import StudyContext, load_study
from autotune.validate.baseline import baseline_config
from autotune.validate.record import Validation

NO_DRAFTER = (None, "none")
PNG_FIGURES = ("history", "pareto", "draft_length", "latency")
CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}
table{border-collapse:collapse;font-size:13px;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;
text-align:left;vertical-align:top}th{background:#f3f3f3}code{font-size:12px;word-break:break-all}
.note{color:#666;font-style:italic}.bad{color:#b00}.good{color:#080}"""


# -- data ------------------------------------------------------------------------------------------
def trials_frame(ctx: StudyContext) -> pd.DataFrame:
    """One row per trial: number, status, reason, config, and the benchmark metrics where measured."""
    rows = []
    for t in ctx.study.get_trials(deepcopy=False):
        a = t.user_attrs
        m = a.get("metrics") or {}
        status = a.get("status", t.state.name.lower())
        if status == "duplicate":
            status = f"duplicate ({a.get('original_status')})"
        rows.append({"number": t.number, "state": t.state.name, "status": status, "ok": is_ok(t),
                     "reason": a.get("failure") or "", "config": a.get("config") or dict(t.params),
                     "warmup_s": a.get("warmup_s"), "value": t.values[0] if t.values else None, **{k: v for k, v in m.items() if
                                                                      isinstance(v, (int, float)) and not isinstance(v, bool)}})
    return pd.DataFrame(rows, columns=None if rows else ["number", "state", "status", "ok", "reason", "config", "value"])


def validation_doc(ctx: StudyContext) -> Validation | None:
    return Validation.load(ctx.best_dir)


def request_frames(ctx: StudyContext) -> dict[str, pd.DataFrame]:
    """Per-request tables by label: "trial-N" (the study's own runs) and "validation trial-N" / "validation baseline"."""
    out = {}
    for path in sorted((ctx.directory / "requests").glob("trial-*.parquet")):
        out[path.stem] = pd.read_parquet(path)
    for path in sorted((ctx.directory / "validation").glob("*-repeat-*.parquet")):
        label = "validation " + path.stem.rsplit("-repeat-", 1)[0]
        out[label] = pd.concat([out[label], pd.read_parquet(path)]) if label in out else pd.read_parquet(path)
    return out


def pareto_front(points: list[tuple[float, float, int]], x_max: bool, y_max: bool) -> list[tuple[float, float, int]]:
    """Points no other point beats on both axes, sorted by x."""
    def beats(a, b):
        ge = (a[0] >= b[0] if x_max else a[0] <= b[0]) and (a[1] >= b[1] if y_max else a[1] <= b[1])
        return ge and (a[0], a[1]) != (b[0], b[1])
    return sorted((p for p in points if not any(beats(q, p) for q in points)), key=lambda p: p[0])


def gpu_count(ctx: StudyContext) -> int:
    return max(1, len((ctx.provenance.get("hardware") or {}).get("gpus") or []))


def launch_text(ctx: StudyContext, config: dict) -> str:
    adapter = ctx.adapter
    try:
        argv, env = adapter.command(config, model=ctx.model, draft_model=ctx.draft_model,
                                    host="127.0.0.1", port=adapter.facts.default_port)
    except ValueError as e:
        return f"(no command: {e})"
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(argv)])


# -- figures: each returns a figure, or a note saying why there is none ---------------------------
def fig_history(ctx: StudyContext, df: pd.DataFrame):
    metric, direction = ctx.primary()
    measured = df[df["value"].notna()]
    if measured.empty:
        return "no trial was measured"
    fig = go.Figure()
    for status, part in measured.groupby("status"):
        fig.add_scatter(x=part["number"], y=part["value"], mode="markers", name=status,
                        text=[_config_short(c) for c in part["config"]], hovertemplate="#%{x}: %{y:.4g}<br>%{text}")
    ok = measured[measured["ok"]].sort_values("number")
    if not ok.empty:
        best = ok["value"].cummax() if direction == "maximize" else ok["value"].cummin()
        fig.add_scatter(x=ok["number"], y=best, mode="lines", name="best so far", line={"shape": "hv"})
    failed = df[df["value"].isna()]
    if not failed.empty:
        fig.add_scatter(x=failed["number"], y=[measured["value"].min()] * len(failed), mode="markers", name="no value",
                        marker={"symbol": "x", "color": "gray"}, text=failed["status"] + ": " + failed["reason"].str[:120],
                        hovertemplate="#%{x}: %{text}")
    fig.update_layout(title=f"Optimization history ({metric}, {direction})", xaxis_title="trial", yaxis_title=metric)
    return fig


def fig_pareto(ctx: StudyContext, df: pd.DataFrame):
    need = {"output_tok_s", "e2e_ms_p95"}
    data = df[df["ok"]].dropna(subset=list(need & set(df.columns))) if need <= set(df.columns) else df.iloc[0:0]
    if data.empty:
        return "no trial met its requirements with throughput and latency measured"
    fig = make_subplots(rows=1, cols=2, subplot_titles=("throughput vs p95 latency", "tok/s per user vs tok/s per GPU"))
    per_gpu = data["output_tok_s"] / gpu_count(ctx)
    per_user = data["decode_tok_s_p50"] if "decode_tok_s_p50" in data else data["output_tok_s"] / data.get("concurrency", 1)
    text = [f"#{n} {_config_short(c)}" for n, c in zip(data["number"], data["config"])]
    for col, (x, y, x_max) in enumerate(((data["e2e_ms_p95"], data["output_tok_s"], False), (per_user, per_gpu, True)), 1):
        fig.add_scatter(x=x, y=y, mode="markers", name="trials", text=text, showlegend=col == 1, row=1, col=col,
                        marker={"color": "#888"}, hovertemplate="%{text}<br>x %{x:.4g}, y %{y:.4g}")
        front = pareto_front(list(zip(x, y, data["number"])), x_max, True)
        fig.add_scatter(x=[p[0] for p in front], y=[p[1] for p in front], mode="lines+markers", name="Pareto front",
                        showlegend=col == 1, row=1, col=col, marker={"color": "#d62728"}, line={"shape": "hv"})
    fig.update_xaxes(title_text="p95 end-to-end latency (ms)", row=1, col=1)
    fig.update_yaxes(title_text="output tok/s", row=1, col=1)
    fig.update_xaxes(title_text="decode tok/s per user (median)", row=1, col=2)
    fig.update_yaxes(title_text=f"output tok/s per GPU ({gpu_count(ctx)} device(s))", row=1, col=2)
    fig.update_layout(title="Pareto fronts")
    return fig


def fig_importance(ctx: StudyContext, df: pd.DataFrame):
    import optuna

    complete = [t for t in ctx.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)) if t.values]
    if len(complete) < 2:
        return f"parameter importances need at least 2 completed trials ({len(complete)} here)"
    try:
        with warnings.catch_warnings():  # few trials per parameter value: said by the plot's trial count instead
            warnings.simplefilter("ignore")
            # PED-ANOVA (Optuna's default, no scikit-learn) ranks what leads to low targets: flip a maximized one.
            sign = -1.0 if ctx.primary()[1] == "maximize" else 1.0
            importances = optuna.importance.get_param_importances(ctx.study, target=lambda t: sign * t.values[0])
    except Exception as e:  # noqa: BLE001 - optuna refuses in several ways (one value per param, one trial...)
        return f"parameter importances unavailable: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    if not importances:
        return "no parameter varied across the completed trials"
    names = list(importances)[::-1]
    fig = go.Figure(go.Bar(x=[importances[n] for n in names], y=names, orientation="h"))
    fig.update_layout(title=f"Parameter importances for {ctx.primary()[0]} (PED-ANOVA over {len(complete)} trials)",
                      xaxis_title="importance")
    return fig


def fig_draft_length(ctx: StudyContext, df: pd.DataFrame):
    drafter_key, k_key = ctx.adapter.facts.draft_keys
    rows = [{"drafter": c.get(drafter_key), "k": c.get(k_key), "tok_s": r.get("output_tok_s"),
             "accept": r.get("accept_length")} for c, (_, r) in zip(df["config"], df.iterrows())
            if r.get("ok") and c.get(drafter_key) not in NO_DRAFTER and c.get(k_key) is not None]
    if not rows:
        return "no speculative trial with a draft length was measured"
    data = pd.DataFrame(rows)
    data[["tok_s", "accept"]] = data[["tok_s", "accept"]].apply(pd.to_numeric, errors="coerce")
    data = data.groupby(["drafter", "k"], as_index=False)[["tok_s", "accept"]].median()
    fig = make_subplots(rows=1, cols=2, subplot_titles=("output tok/s vs draft length", "accept length vs draft length"))
    for i, (drafter, part) in enumerate(data.groupby("drafter")):
        part = part.sort_values("k")
        color = _color(i)
        fig.add_scatter(x=part["k"], y=part["tok_s"], mode="lines+markers", name=str(drafter), row=1, col=1,
                        line={"color": color}, legendgroup=str(drafter))
        fig.add_scatter(x=part["k"], y=part["accept"], mode="lines+markers", name=str(drafter), row=1, col=2,
                        line={"color": color}, legendgroup=str(drafter), showlegend=False)
    fig.update_xaxes(title_text=f"draft length ({k_key})")
    fig.update_layout(title="Draft-length curve per drafter (median over trials)")
    return fig


def fig_schedule(ctx: StudyContext):
    """Throughput vs batch size, one line per draft length, the fitted schedule's choice drawn over them; the
    per-(batch, k) table (median, 90% interval, runs) in the hover."""
    fit = read_fit(ctx.best_dir)
    if fit is None:
        return "no draft-length schedule fitted (autotune run --fit-schedule, or a --load-profile that varies)"
    fig = go.Figure()
    lengths = sorted({c.draft_length for c in fit.cells})
    for i, k in enumerate(lengths):
        cells = sorted((c for c in fit.cells if c.draft_length == k), key=lambda c: c.batch)
        fig.add_scatter(x=[c.batch for c in cells], y=[c.median for c in cells], mode="lines+markers",
                        name="plain (k=0)" if k == 0 else f"k={k}", line={"color": _color(i)},
                        error_y={"type": "data", "symmetric": False, "array": [c.high - c.median for c in cells],
                                 "arrayminus": [c.median - c.low for c in cells]},
                        text=[f"{c.runs} runs, 90% {c.low:.4g}..{c.high:.4g}" for c in cells],
                        hovertemplate="batch %{x}: %{y:.4g} tok/s<br>%{text}")
    medians = {(c.batch, c.draft_length): c.median for c in fit.cells}
    batches = sorted(fit.chosen)
    fig.add_scatter(x=batches, y=[medians[(b, fit.chosen[b])] for b in batches], mode="lines+markers+text",
                    name="schedule", text=[f"k={fit.chosen[b]}" for b in batches], textposition="top center",
                    line={"color": "black", "width": 4, "dash": "dot"}, marker={"size": 12, "symbol": "star"})
    fig.update_xaxes(title_text="batch size (streams in flight)", type="log", tickvals=batches)
    fig.update_yaxes(title_text="output tok/s")
    fig.update_layout(title=fit.summary_line())
    return fig


def schedule_table(ctx: StudyContext) -> str:
    """The fit's cells: per batch size and draft length, the median, its interval and whether it was chosen."""
    fit = read_fit(ctx.best_dir)
    if fit is None:
        return ""
    rows = [[c.batch, c.draft_length, c.median, f"{c.low:.4g}..{c.high:.4g}", c.runs, c.accept_length, c.step_ms,
             "chosen" if fit.chosen.get(c.batch) == c.draft_length else ""] for c in fit.cells]
    return ("<h2>Draft-length schedule</h2>" + _table(["batch", "k", "output tok/s", "90% interval", "runs",
                                                       "accept len", "step ms", ""], rows))


def fig_entropy(ctx: StudyContext, df: pd.DataFrame, frames: dict[str, pd.DataFrame]):
    drafter_key, _ = ctx.adapter.facts.draft_keys
    configs = dict(zip(df["number"], df["config"]))
    points = []
    for label, frame in frames.items():
        if not {"accept_length", "prompt_entropy"} <= set(frame.columns):
            continue
        number = label.rsplit("trial-", 1)[1] if "trial-" in label else None
        drafter = (configs.get(int(number)) or {}).get(drafter_key) if number and number.isdigit() else None
        if drafter in NO_DRAFTER:  # the baseline and plain decoding accept nothing
            continue
        ok = frame.dropna(subset=["accept_length", "prompt_entropy"])
        ok = ok[ok["accept_length"] > 0]
        points += [{"drafter": str(drafter), "entropy": e, "accept": a}
                   for e, a in zip(ok["prompt_entropy"], ok["accept_length"])]
    note = None
    if not points:  # per-trial means: always recorded
        note = "per-request data not saved for this study: one point per trial (means)"
        for c, (_, r) in zip(df["config"], df.iterrows()):
            if r.get("prompt_entropy_mean") is not None and r.get("accept_length") and c.get(drafter_key) not in NO_DRAFTER:
                points.append({"drafter": str(c.get(drafter_key)), "entropy": r["prompt_entropy_mean"], "accept": r["accept_length"]})
    points = [p for p in points if pd.notna(p["entropy"]) and pd.notna(p["accept"])]
    if not points:
        return "no accept length with prompt entropy was measured (no speculative trial, or the engine reports no entropy)"
    data = pd.DataFrame(points)
    fig = go.Figure()
    for i, (drafter, part) in enumerate(data.groupby("drafter")):
        fig.add_scatter(x=part["entropy"], y=part["accept"], mode="markers", name=drafter, marker={"color": _color(i)})
    fig.update_layout(title="Accept length vs prompt entropy" + (f" ({note})" if note else ""),
                      xaxis_title="prompt entropy (nats, mean over the first prompt tokens)", yaxis_title="accept length")
    return fig


def fig_stop_rule(ctx: StudyContext):
    """The fitted estimator's acceptance-vs-draft-entropy curve and its stop threshold per temperature band
    (estimator.json's stop_rule), with the held-out evaluation's gain where it ran."""
    path = ctx.directory / "estimator.json"
    rule = json.loads(path.read_text()).get("stop_rule") if path.exists() else None
    if not rule:
        return "no stop rule was fitted (no estimator.json with traced proposals in this study)"
    signal = rule["signal"]  # entropy (nats) or doubt (1 - top-1 probability) of the draft's distribution
    curve = rule["curve"][signal]
    fig = go.Figure()
    fig.add_scatter(x=[(c["risk"][0] + c["risk"][1]) / 2 for c in curve], y=[c["accept"] for c in curve],
                    mode="lines+markers", name="acceptance (tokens up to a step's first rejection)",
                    text=[f"{c['tokens']} tokens" for c in curve], marker={"color": _color(0)})
    edges = rule["temperature_edges"]
    bands = [f"T <= {edges[0]}", *(f"{lo} < T <= {hi}" for lo, hi in itertools.pairwise(edges)), f"T > {edges[-1]}"] \
        if edges else ["all temperatures"]
    for b, (label, threshold) in enumerate(zip(bands, rule["thresholds"])):
        if threshold is not None:  # None: that band never stops
            fig.add_vline(x=threshold, line_dash=["solid", "dash", "dot"][b % 3], line_color=_color(b + 1),
                          annotation_text=f"stop above {threshold:.2f} ({label})")
    evaluated = ctx.directory / "estimator-eval" / "eval.json"
    gain = json.loads(evaluated.read_text()) if evaluated.exists() else None
    result = "" if not gain else (f"; held out: {1 + gain['gain']:.3f} x best fixed ({gain['best_fixed']}), 90 % "
                                  f"{1 + gain['gain_interval_90'][0]:.3f}..{1 + gain['gain_interval_90'][1]:.3f}")
    fig.update_layout(title=f"Draft acceptance vs draft {signal} (AUC {rule['auc'][signal]}{result})",
                      xaxis_title="draft entropy (nats)" if signal == "entropy" else "draft doubt (1 - top-1 probability)",
                      yaxis_title="acceptance rate", yaxis_range=[0, 1.05])
    return fig


def fig_latency(ctx: StudyContext, df: pd.DataFrame, frames: dict[str, pd.DataFrame], validation: Validation | None):
    winner = validation.winner.trial if validation and validation.winner else None
    best = ctx.ranked()
    winner = winner if winner is not None else (best[0].number if best else None)
    same = bool(validation) and validation.baseline.trial == winner  # the winner is the baseline config
    pairs = []  # (name, frame)
    for name, labels in (("winner" + (" (= baseline)" if same else ""),
                          [f"validation trial-{winner}", *(["validation baseline"] if same else []), f"trial-{winner}"]),
                         ("baseline", ["validation baseline", _default_label(ctx, df)])):
        frame = next((frames[lb] for lb in labels if lb in frames), None)
        if frame is not None:
            pairs.append((name, frame[frame["ok"].astype(bool)]))
    if not pairs:
        return "no per-request latencies saved (run `autotune validate` to record them)"
    fig = make_subplots(rows=1, cols=3, subplot_titles=("TTFT (ms)", "inter-token latency (ms)", "end-to-end (ms)"))
    for i, (name, frame) in enumerate(pairs):
        itl = [x for xs in frame["itl_ms"] for x in (list(xs) if xs is not None else [])]
        for col, values in enumerate((frame["ttft_ms"], itl, frame["e2e_ms"]), 1):
            fig.add_box(y=list(values), name=name, boxpoints="all", jitter=0.4, marker={"color": _color(i)},
                        showlegend=col == 1, legendgroup=name, row=1, col=col)
    fig.update_layout(title=f"Latency distributions: winner (trial {winner}) vs baseline")
    return fig


def _default_label(ctx: StudyContext, df: pd.DataFrame) -> str:
    _, number = baseline_config(ctx)
    return f"trial-{number}"


def _color(i: int) -> str:
    return ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")[i % 8]


def _config_short(config: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in config.items() if v not in (None, [], "none")) or "(defaults)"


# -- the HTML --------------------------------------------------------------------------------------
def _table(headers: list[str], rows: list[list], raw_columns: tuple[int, ...] = ()) -> str:
    def cell(i, v):
        blank = v is None or (isinstance(v, float) and math.isnan(v))  # NaN: a frame column's missing value
        return v if i in raw_columns else html.escape("" if blank else f"{v:.4g}" if isinstance(v, float) else str(v))
    body = "".join("<tr>" + "".join(f"<td>{cell(i, v)}</td>" for i, v in enumerate(r)) + "</tr>" for r in rows)
    return "<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in headers) + "</tr>" + body + "</table>"


def summary_lines(ctx: StudyContext, df: pd.DataFrame, validation: Validation | None) -> list[str]:
    counts = df["status"].value_counts().to_dict() if not df.empty else {}
    lines = [f"study {ctx.name}: engine {ctx.engine}, objective {ctx.objective}, workload {ctx.workload}",
             f"trials: {len(df)} ({', '.join(f'{v} {k}' for k, v in counts.items()) or 'none'})",
             f"hardware: {hardware_line(ctx.provenance)}",
             "versions: " + ", ".join(f"{k} {v}" for k, v in versions(ctx.provenance).items() if v)]
    metric = ctx.primary()[0]
    if validation and validation.winner:
        w = validation.winner
        s = w.stats[metric]
        gain = f", {w.gain_over_baseline:.2f}x the baseline" if w.gain_over_baseline else ""
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
    parts, inlined = [], False
    for name, fig in figures.items():
        if isinstance(fig, str):
            parts.append(f'<p class="note">{html.escape(name.replace("_", " "))}: {html.escape(fig)}</p>')
            continue
        fig.update_layout(template="plotly_white", height=450)
        parts.append(fig.to_html(full_html=False, include_plotlyjs="inline" if not inlined else False,
                                 div_id=f"fig-{name}"))
        inlined = True
    path = Path(out) if out else ctx.directory / "report.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    pngs = write_pngs({k: v for k, v in figures.items() if k in PNG_FIGURES and not isinstance(v, str)},
                      path.parent / "png") if png else "PNG copies not requested"
    summary = "".join(f"<li>{html.escape(line)}</li>" for line in summary_lines(ctx, df, validation))
    doc = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>autotune report: {html.escape(ctx.name)}</title>"
           f"<style>{CSS}</style></head><body><h1>autotune report: {html.escape(ctx.name)}</h1><ul>{summary}</ul>"
           + "".join(parts) + schedule_table(ctx) + "<h2>Top configurations</h2>" + top_table(ctx, validation)
           + "<h2>All trials</h2>" + all_table(df) + f'<p class="note">{html.escape(pngs)}</p></body></html>')
    path.write_text(doc)
    return path


def top_table(ctx: StudyContext, validation: Validation | None, limit: int = 10) -> str:
    verdicts = {c.trial: c for c in validation.candidates} if validation else {}
    metric = ctx.primary()[0]
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
                     verdict, _config_short(t.user_attrs.get("config") or {}),
                     f"<code>{html.escape(launch_text(ctx, t.user_attrs.get('config') or {}))}</code>"])
    if not rows:
        return '<p class="note">no trial met its requirements</p>'
    # warm-up: compiling and graph capture before the measured requests (launch cost, not speed)
    return _table(["#", metric, "p95 e2e ms", "accept len", "warm-up s", "validation", "config", "launch command"],
                  rows, (7,))


def all_table(df: pd.DataFrame) -> str:
    rows = [[r["number"], r["status"], r["value"], r.get("warmup_s"), _config_short(r["config"]), r["reason"]]
            for _, r in df.iterrows()]
    return _table(["#", "status", "value", "warm-up s", "config", "why (failures, SLO misses)"], rows)


def write_pngs(figures: dict, directory: Path) -> str:
    """PNG copies through kaleido in one batch; a missing browser is a note, not an error."""
    import plotly.io as pio

    if not figures:
        return "no plots to copy as PNG"
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f"{name}.png" for name in figures]
    try:
        pio.write_images(list(figures.values()), paths, width=1100, height=450)
    except Exception as e:  # noqa: BLE001 - no Chrome/Chromium, or kaleido could not drive it
        return f"PNG copies skipped: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    return f"PNG copies in {directory}: {', '.join(p.name for p in paths)}"


# -- autotune show ---------------------------------------------------------------------------------
def show(study: str | Path, *, storage: str | None = None, console=None, limit: int = 10) -> None:
    from rich.console import Console
    from rich.table import Table

    ctx = load_study(study, storage)
    console = console or Console()
    df = trials_frame(ctx)
    validation = validation_doc(ctx)
    for line in summary_lines(ctx, df, validation):
        console.print(line, highlight=False, markup=False)
    metric = ctx.primary()[0]
    table = Table(title=f"top configurations by {metric}")
    for col in ("#", metric, "p95 e2e ms", "accept len", "config"):
        table.add_column(col, overflow="fold")
    for t in ctx.ranked()[:limit]:
        m = t.user_attrs.get("metrics") or {}
        table.add_row(str(t.number), f"{t.values[0]:.4g}", _fmt(m.get("e2e_ms_p95"), 0), _fmt(m.get("accept_length"), 2),
                      _config_short(t.user_attrs.get("config") or {}))
    console.print(table)
    failed = df[~df["ok"]]
    if not failed.empty:
        console.print(f"not ok: {len(failed)} trial(s): " + "; ".join(
            f"#{r['number']} {r['status']}" + (f" ({r['reason'][:80]})" if r["reason"] else "") for _, r in failed.iterrows()),
            highlight=False, markup=False)
    files = [p for p in (ctx.best_dir / "launch.sh", ctx.directory / "report.html") if p.exists()]
    if files:
        console.print("files: " + ", ".join(map(str, files)), highlight=False, markup=False)


def _fmt(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
