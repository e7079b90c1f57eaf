"""The report's plots: each `fig_*` returns a Plotly figure, or a note saying why there is none."""
from __future__ import annotations

import itertools
import json
import warnings

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from autotune.bench.metric_registry import MAXIMIZE
from autotune.report.data import gpu_count, pareto_front
from autotune.report.text import config_short
from autotune.study.schedule import read_fit
from autotune.study.storage import StudyContext
from autotune.validate.baseline import baseline_config
from autotune.validate.record import Validation

NO_DRAFTER = (None, "none")


def fig_history(ctx: StudyContext, df: pd.DataFrame):
    primary = ctx.primary()
    metric, direction = primary.name, primary.direction
    measured = df[df["value"].notna()]
    if measured.empty:
        return "no trial was measured"
    fig = go.Figure()
    for status, part in measured.groupby("status"):
        fig.add_scatter(x=part["number"], y=part["value"], mode="markers", name=status,
                        text=[config_short(c) for c in part["config"]], hovertemplate="#%{x}: %{y:.4g}<br>%{text}")
    ok = measured[measured["ok"]].sort_values("number")
    if not ok.empty:
        best = ok["value"].cummax() if direction == MAXIMIZE else ok["value"].cummin()
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
    text = [f"#{n} {config_short(c)}" for n, c in zip(data["number"], data["config"])]
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
            sign = -1.0 if ctx.primary().direction == MAXIMIZE else 1.0
            importances = optuna.importance.get_param_importances(ctx.study, target=lambda t: sign * t.values[0])
    except Exception as e:  # noqa: BLE001 - optuna refuses in several ways (one value per param, one trial...)
        return f"parameter importances unavailable: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    if not importances:
        return "no parameter varied across the completed trials"
    names = list(importances)[::-1]
    fig = go.Figure(go.Bar(x=[importances[n] for n in names], y=names, orientation="h"))
    fig.update_layout(title=f"Parameter importances for {ctx.primary().label} (PED-ANOVA over {len(complete)} trials)",
                      xaxis_title="importance")
    return fig


def fig_draft_length(ctx: StudyContext, df: pd.DataFrame):
    drafter_key = ctx.adapter.facts.draft_keys[0]
    rows = [{"drafter": c.get(drafter_key), "k": ctx.adapter.draft_length(c), "tok_s": r.get("output_tok_s"),
             "accept": r.get("accept_length")} for c, (_, r) in zip(df["config"], df.iterrows())
            if r.get("ok") and ctx.adapter.draft_length(c) > 0]
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
    fig.update_xaxes(title_text="draft length (tokens drafted per step)")
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
