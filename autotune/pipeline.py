"""The end of `autotune run`, the design's diagram in code: the study's winners are proven on fresh
launches (validate), handed over as a script (export), the per-request acceptance the trials measured
becomes a draft-length estimator with its runtime stop rule (estimator fit; a short traced pass where the
setup runs on the embedded engine) and is measured against every fixed k (estimator eval), and all of it
is explained (report, which draws the acceptance-vs-entropy curve). Where the study's load varies or the
run asks (--fit-schedule), a draft-length schedule is fitted for the validated winner (batch size -> k,
from a sweep on its server) before the export, which then carries it.

Each step's failure is reported and the next still runs: a report without a validated winner still
helps, and nothing the study recorded is lost.
"""
from __future__ import annotations

from pathlib import Path

from rich.console import Console

from autotune import export, report
from autotune.estimator import evaluate_for_study, fit_from_study
from autotune.estimator.live import measurable
from autotune.study import schedule
from autotune.study.budget import REPORT_S, Budget, Finish, Prices, minutes
from autotune.study.storage import load_study
from autotune.validate.record import Validation
from autotune.validate.run import validate
from autotune.validate.settings import ValidationSettings

LOAD_KEYS = ("concurrency", "num_requests", "max_tokens", "seed", "min_measure_s")


def run_settings(p) -> ValidationSettings:
    """Validation as `autotune run` finishes: the defaults with the engine's own lighter round (its facts)."""
    return ValidationSettings().updated(p.adapter.facts.finish_validation)


def run_budget(p, *, estimator: bool, start: float, settings: ValidationSettings | None = None) -> Budget | None:
    """`autotune run --budget`'s: the search, then this module's finish as the plan's engine runs it (its
    validation settings unless given; the estimator's live passes where its setup runs on the embedded engine)."""
    if not p.opts.budget_s:
        return None
    settings = settings or run_settings(p)
    passes = estimator and measurable(p.space.defaults())
    varies = p.load_profile is not None and len(p.load_profile.concurrencies()) > 1
    sweep = (schedule.planned_sweep(p.adapter, schedule.levels_for(p.load_profile, p.opts.concurrency),
                                    p.opts.max_tokens or 1)
             if (p.opts.fit_schedule or varies) and p.space.params.get(p.adapter.facts.draft_keys[1] or "") else None)
    return Budget(p.opts.budget_s, Finish(settings.top, settings.repeats, settings.quality_prompts,
                                          estimator_passes=passes, sweep=sweep), start=start)


def finish(study: str | Path, storage: str | None = None, *, run_options=None,
           settings: ValidationSettings | None = None, slo: str | None = None, load: dict | None = None,
           console=None, estimator: bool = True, budget: Budget | None = None, progress: bool = True) -> dict:
    """validate -> draft-length schedule (when the load varies or run_options.fit_schedule) -> export ->
    estimator fit -> estimator eval -> report. `run_options` (the tuner's RunOptions)
    supplies the study's SLO and load. `budget` (the run's): validation keeps to what the estimator's passes
    and the report leave it; the passes run only if what is left holds them (else the estimator is fitted on
    the study's rows alone), and the schedule's sweep likewise. Returns {"validation": doc | None,
    "schedule": best/draft_schedule.yaml | None, "exported": [paths], "report": path | None,
    "estimator": path | None, "estimator_eval": eval.json path | None, "problems": [lines]}."""
    console = console or Console(stderr=True)
    if run_options is not None:
        slo = slo or run_options.slo
        load = {**{k: getattr(run_options, k) for k in LOAD_KEYS}, **(load or {})}
    ctx = load_study(study, storage)
    prices = budget and Prices.of(ctx.study.get_trials(deepcopy=False), ctx.load["concurrency"] or 1)
    passes_s = budget.finish.estimator_s(prices) if prices and estimator and budget.finish else 0.0
    sweep_s = budget.finish.sweep_s(prices) if prices and budget.finish else 0.0
    deadline = None
    if prices:  # validation first: the estimator's passes and the sweep keep their share only if a full round fits
        full = budget.finish.validation_s(prices) + passes_s + sweep_s + REPORT_S if budget.finish else 0.0
        deadline = budget.end - REPORT_S - (passes_s + sweep_s if budget.left() >= full else 0.0)

    def fit_schedule():
        if not ((run_options is not None and run_options.fit_schedule) or schedule.load_varies(ctx)):
            return None
        pick = export.chosen(ctx)
        if not schedule.drafts(ctx, pick["config"]):
            out["problems"].append("schedule: the exported configuration does not draft; no schedule fitted")
            return None
        if prices and budget.left() < sweep_s + passes_s + REPORT_S:
            out["problems"].append(f"schedule: not fitted; its sweep (~{sweep_s:.0f} s) did not fit in what was "
                                   f"left of the budget ({budget.left():.0f} s)")
            return None
        end = budget.end - REPORT_S - passes_s if budget else None  # a sweep cut short fits what it measured
        schedule.fit_for_study(ctx, pick["config"], pick["trial"], deadline=end, launch_timeout_s=timeout)
        return ctx.best_dir / schedule.SCHEDULE_FILE

    timeout = run_options.launch_timeout_s if run_options is not None else 300.0
    steps = [("validation", lambda: validate(ctx, settings=settings, slo=slo, load=load, launch_timeout_s=timeout,
                                              console=console, progress=progress, deadline=deadline)),
             ("schedule", fit_schedule),  # before the export: launch.sh carries it
             ("exported", lambda: export.export(ctx))]

    passes = {"run": True}  # the estimator's live passes: decided as its step starts, from the time left

    def fit_estimator():
        passes["run"] = prices is None or budget.left() >= passes_s + REPORT_S
        fitted = fit_from_study(ctx.directory, stop_rule=passes["run"])  # a study it cannot fit says why, alone
        if not passes["run"]:
            out["problems"].append(f"estimator: fitted on the study's rows alone; its traced pass and evaluation "
                                   f"(~{passes_s:.0f} s) did not fit in what was left of the budget ({budget.left():.0f} s)")
        return fitted

    def evaluate_estimator():
        return evaluate_for_study(out["estimator"]) if out["estimator"] and passes["run"] else None

    if estimator:  # the per-request draft-length policy and stop rule, from the acceptance the trials measured
        steps += [("estimator", fit_estimator), ("estimator_eval", evaluate_estimator)]
    steps.append(("report", lambda: report.write_report(ctx)))  # last: it shows the estimator's curve
    out = {"validation": None, "schedule": None, "exported": [], "report": None, "estimator": None,
           "estimator_eval": None, "problems": []}
    for name, step in steps:
        try:
            out[name] = step()
        except (ValueError, OSError) as e:
            problem = str(e).splitlines()[0] if str(e) else type(e).__name__
            out["problems"].append(f"{name}: {problem}")
            console.print(f"[yellow]{name}:[/] {problem}")
    return out


def closing_lines(done: dict, directory: Path, storage: str, budget: Budget | None = None) -> list[str]:
    """What `autotune run` ends on: what was exported (not the search's best), its validated numbers, whether it
    beat its rivals beyond the noise or tied, its greedy output against plain decoding, where it all is, and
    the time it took against its budget."""
    doc: Validation | None = done.get("validation")
    lines = []
    winner = doc.winner if doc else None
    if winner is None:
        lines.append("exported: nothing validated" + (f" ({done['problems'][0]})" if done["problems"] else ""))
    else:
        metric, stats = doc.metric, winner.stats[doc.metric]
        ci = stats.ci95
        changed = doc.winner_changes()
        lines.append(f"exported: trial {winner.trial} ({' '.join(changed) or 'the engine defaults'})")
        gain = winner.gain_over_baseline if changed else None  # the defaults themselves: a ratio would be noise
        lines.append(f"validated: {metric} {stats.median:.4g}" + (f" (95% CI {ci[0]:.4g}..{ci[1]:.4g})" if ci else "")
                     + f", median of {winner.repeats} benchmarks on fresh launches"
                     + (f"; {gain:.2f}x the engine defaults ({doc.baseline.label})" if gain else ""))
        if doc.tie:
            lines.append(f"tie: {doc.tie.why}")
        for c in doc.comparisons:
            if c.beyond_noise:
                low, high = c.interval
                lines.append(f"beats {c.rival} beyond the noise: {c.gain:.2f}x "
                             f"({c.confidence:.0%} interval {low:.2f}..{high:.2f})")
        quality = next((c.quality for c in doc.candidates if c.label == winner.label), None) or {}
        if quality.get("checked"):
            lines.append(f"greedy output vs plain decoding: {quality['identical']}/{quality['prompts']} prompts identical,"
                         f" {quality['identical_share']:.0%} of {quality['unit']}s agree ({quality['mode']})")
    best = directory / "best"
    if (best / "launch.sh").is_file():
        lines.append(f"launch: {best / 'launch.sh'}")
    fitted = done.get("schedule") and schedule.read_fit(directory / "best")
    if fitted:
        lines.append(fitted.summary_line())
    if done.get("report"):
        lines.append(f"report: {done['report']}")
    lines.append(f"study: {storage} (optuna-dashboard {storage})")
    if budget is not None:
        lines.append(f"time: {minutes(budget.total_s - budget.left())} of a {minutes(budget.total_s)} budget")
    return lines + [f"note: {problem}" for problem in done["problems"]]

