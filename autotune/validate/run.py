"""The whole validation: the first round, the added rounds of a close race, the winner, validation.json."""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from autotune.bench import load_workload, parse_slo
from autotune.bench.metric_registry import HEADLINE, MAXIMIZE
from autotune.study.budget import Prices
from autotune.study.record import effective_key
from autotune.study.storage import StudyContext, load_study
from autotune.validate.baseline import baseline_config
from autotune.validate.measure import launch_groups, measure, new_record
from autotune.validate.quality import quality
from autotune.validate.race import (
    fitting_round,
    judge,
    next_round,
    pick_winner,
    rivals,
    round_seconds,
    settle,
)
from autotune.validate.record import ValidatedConfig, Validation
from autotune.validate.settings import ValidationSettings
from autotune.validate.statistics import compare


def validate(study: str | Path | StudyContext, *, settings: ValidationSettings | None = None,
             storage: str | None = None, slo: str | None = None, load: dict | None = None,
             launch_timeout_s: float = 300.0, console=None, progress: bool = True,
             deadline: float | None = None) -> Validation:
    """Validate the top configurations of a study; writes best/validation.json and returns it.
    Repeats are added (one more launch each) to the winner and every rival it does not yet beat beyond the
    noise, up to `settings.max_repeats` each (at least `repeats`). `deadline` (time.time(), a run's --budget):
    the first round shrinks to fit it (fewer configurations, then fewer repeats, never below the best one and
    the baseline twice each) at the prices the study's trials paid, and a round is added only while it fits.
    `load` overrides the study's load for this validation only (the caller's context keeps its own)."""
    s = settings or ValidationSettings()
    top, repeats, max_repeats, confidence = s.top, s.repeats, s.repeat_cap, s.confidence
    ctx = study if isinstance(study, StudyContext) else load_study(study, storage)
    ctx = dataclasses.replace(ctx, load={**ctx.load, **{k: v for k, v in (load or {}).items() if v is not None}})
    slo_text = slo or ctx.slo
    slo_parsed = parse_slo(slo_text) if slo_text else None
    workload = load_workload(ctx.workload, ctx.load["seed"])
    candidates = ctx.ranked()[:top]
    if not candidates:
        raise ValueError(f"study {ctx.name!r} has no measured trial that met its requirements: nothing to validate")
    prices = Prices.of(ctx.study.get_trials(deepcopy=False), ctx.load["concurrency"] or 1) if deadline else None
    asked = {"top": top, "repeats": repeats}
    if prices:
        top, repeats = fitting_round(prices, deadline - time.time(), min(top, len(candidates)), repeats,
                                     s.quality_prompts)
        candidates = candidates[:top]
    base_config, base_trial = baseline_config(ctx)
    prompts = workload.requests[:s.quality_prompts]
    (ctx.directory / "validation").mkdir(parents=True, exist_ok=True)
    console = console or Console(stderr=True)
    primary = ctx.primary()
    metric, direction = primary.name, primary.direction
    base_key = effective_key(ctx.adapter, base_config)
    steps = repeats * (len(candidates) + 1)
    looks = max_repeats - repeats + 1  # times the intervals are looked at: once per added repeat, and first
    with Progress(TextColumn("[bold]validate[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, disable=not progress) as bar:
        task = bar.add_task("", total=steps)

        def run(recs, n=repeats):
            for group in launch_groups(ctx, recs):
                bar.update(task, description=" + ".join(rec["label"] for rec in group))
                measure(ctx, group, repeats=n, prompts=prompts, quality_tokens=s.quality_tokens, workload=workload,
                        launch_timeout_s=launch_timeout_s, tick=lambda: bar.advance(task))

        def judged(rec):
            rec["reasons"] = judge(ctx, rec, slo_parsed, s.max_noise)
            rec["status"] = "demoted" if rec["reasons"] else "passed"
            return rec

        baseline = new_record("baseline", base_config)
        run([baseline])
        tokenizer = ctx.adapter.tokenizer(ctx.model)
        encode = tokenizer.encode if tokenizer is not None else None
        baseline.update(trial=base_trial, quality=quality(ctx, base_config, base_config, baseline.get("greedy") or [],
                                                          baseline.get("greedy"), encode))
        reference = baseline.get("greedy")
        results, fresh = [], []
        for t in candidates:
            config = t.user_attrs.get("config") or {}
            if effective_key(ctx.adapter, config) == base_key:
                # the baseline's measurements, as a record of its own (more repeats go to one of them)
                rec = {**baseline, "label": f"trial-{t.number}", "config": config, "runs": list(baseline.get("runs", [])),
                       "request_files": list(baseline.get("request_files", [])),
                       "launches": list(baseline.get("launches", []))}
                bar.advance(task, repeats)
            else:
                rec = new_record(f"trial-{t.number}", config)
                fresh.append(rec)
            rec.update(trial=t.number, study_value=t.values[0])
            results.append(rec)
        run(fresh)
        for rec in results:
            rec["quality"] = quality(ctx, rec["config"], base_config, rec.get("greedy") or [], reference, encode)
            judged(rec)
        judged(baseline)

        # Close races get more repeats: the winner and each rival it does not beat beyond the noise.
        budget_stop = None
        while more := next_round(ctx, results, baseline, confidence=confidence, looks=looks, max_repeats=max_repeats):
            if prices and time.time() + round_seconds(ctx, more, prices) > deadline:
                budget_stop = f"the budget ended the race: another round needs ~{round_seconds(ctx, more, prices):.0f} s"
                break
            bar.update(task, total=bar.tasks[0].total + len(more))
            run(more, 1)
            for rec in more:
                judged(rec)
    winner, warning = pick_winner(results, metric, direction)
    comparisons = [compare(winner, r, metric, direction, confidence, looks)
                   for r in rivals(ctx, winner, results, baseline, metric, direction)] if winner else []
    chosen, tie = settle(ctx, winner, comparisons, results, baseline, race_cut=budget_stop is not None)
    doc = {"study": ctx.name, "storage": ctx.storage, "engine": ctx.engine, "objective": ctx.objective,
           "metric": metric, "direction": direction, "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "settings": {"top": top, "repeats": repeats, "max_repeats": max_repeats, "confidence": confidence,
                        **({"budget": {"asked": asked, "left_s": round(deadline - time.time(), 1),
                                       "stopped": budget_stop}} if deadline else {}),
                        "slo": slo_text, "max_noise": s.max_noise, "workload": ctx.workload,
                        "quality_prompts": len(prompts), "quality_tokens": s.quality_tokens,
                        "model": ctx.model, "draft_model": ctx.draft_model, **ctx.load},
           "baseline": _public(baseline),
           "candidates": [_public(r) for r in results],
           "demoted": [{"trial": r["trial"], "reasons": r["reasons"]} for r in results if r["reasons"]],
           "comparisons": [{k: v for k, v in c.items() if k not in ("a", "b")} for c in comparisons],
           "tie": tie, "winner": None}
    if chosen is not None:
        base_median = (baseline.get("stats") or {}).get(metric, {}).get("median")
        win_median = chosen["stats"][metric]["median"]
        gain = None
        if base_median and win_median:
            gain = win_median / base_median if direction == MAXIMIZE else base_median / win_median
        doc["winner"] = {"trial": chosen["trial"], "label": chosen["label"], "config": chosen["config"],
                         "argv": chosen["argv"], "env": chosen["env"], "median": win_median,
                         "gain_over_baseline": gain, "repeats": len(chosen["runs"]), "stats": chosen["stats"],
                         "tie": tie is not None, "warning": warning}
    ctx.study.set_user_attr("validated_best_trial", chosen["trial"] if chosen else None)
    validation = Validation.model_validate(doc)
    validation.write(ctx.best_dir / "validation.json")
    return validation


def _public(rec: dict) -> ValidatedConfig:
    """The record as written to validation.json (the greedy texts are long: only the quality verdict stays)."""
    keep = ("label", "trial", "config", "argv", "env", "log", "launch_s", "warmup_s", "bench_requests",
            "greedy_error", "study_value", "stats", "quality", "status", "reasons", "request_files")
    out = {k: rec[k] for k in keep if k in rec}
    if rec.get("failure"):
        out["failure"] = rec["failure"].text
    out["runs"] = [{k: run.get(k) for k in (*HEADLINE, "completed", "failed", "duration_s", "errors_by_kind")}
                   for run in rec.get("runs", [])]
    return ValidatedConfig.model_validate(out)
