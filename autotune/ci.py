"""`autotune ci`: after a driver, CUDA, torch or engine upgrade, re-check a study's exported best
configuration and re-tune it when it broke or fell behind.

1. Fingerprint this environment (GPUs, driver, CUDA, NVML, torch, engine version, model checksum;
   for the embedded engine also what changes a CPU/PyTorch engine's speed: CPU model, torch threads,
   fast dtypes) and compare it with the study's provenance.json. Unchanged: done (exit 0).
2. Changed (or --force): launch the exported command (best/launch.json, else best/launch.sh) on a
   free port; if it does not start, rewrite flags the engine renamed (its captured schema) and retry.
   Benchmark it with the load the study was validated with; compare the median with the validated
   median. Within tolerance: refresh provenance.json (the validated numbers stay the reference,
   so slow drift still shows), exit 0.
3. Regressed or broken: re-tune in a new study beside the old one (same storage, studies/<name>/ci/),
   warm-started: the previous top configurations are enqueued first and the previous failures are
   copied in as infeasible trials, so the tuner skips them and samples away from them. It runs as `autotune
   run` does (its plan, its budget over search and finish, `pipeline.finish`: validation with the settings
   the study was validated with, export and a report of its own); the new validated best is then exported
   into studies/<name>/best/, ci-summary.md is written for a pull request, exit 1.
The old trials are not resumed in place: measured under the old environment, their numbers are stale,
and the tuner would reuse them for any configuration it has seen.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import optuna
import yaml
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from autotune import export, pipeline, provenance
from autotune.bench import load_workload, parse_slo
from autotune.bench.metric_registry import MAXIMIZE, SHOWN
from autotune.engines import get_adapter
from autotune.engines.base import flag_lines
from autotune.engines.launcher import LaunchError, launch
from autotune.hardware import probe
from autotune.space.space import SpaceError, load_space
from autotune.study import loop, objectives, plan, record, storage
from autotune.study.storage import load_study
from autotune.validate.measure import benchmark, new_record
from autotune.validate.race import repeat_reasons
from autotune.validate.record import Reason, Validation
from autotune.validate.settings import ValidationSettings
from autotune.validate.statistics import spread

OK, CHANGED = 0, 1
WARM_START_TOP = 5
FAILED = (record.FAILED,)  # trial statuses remembered as failed regions (rule rejections are re-derived anyway)
BROKEN = ("request_errors", "server_exited")  # a re-check with these is broken; SLO misses only regressed


# -- fingerprint (autotune/provenance.py computes it) -------------------------------------------------
def recorded_fingerprint(provenance: dict) -> dict:
    """The fingerprint a study recorded: written by `autotune ci` itself, else read off provenance.json."""
    if provenance.get("fingerprint"):
        return provenance["fingerprint"]
    hw, versions = provenance.get("hardware") or {}, provenance.get("versions") or {}
    adapter = get_adapter(provenance.get("engine") or "embedded")
    fp = {"gpus": sorted(g.get("name") or "?" for g in hw.get("gpus") or []), "driver": hw.get("driver_version"),
          "cuda": hw.get("cuda_driver_version"), "nvml": hw.get("nvml_version"), "torch": versions.get("torch"),
          "torch_cuda": versions.get("cuda"), "engine": adapter.name,
          "engine_version": adapter.recorded_version(provenance),
          "model_sha256": provenance.get("model_sha256"), "draft_model_sha256": provenance.get("draft_model_sha256")}
    if "cpu" in adapter.facts.fingerprint_keys:
        fp["cpu"] = (hw.get("cpu") or {}).get("model")
    return fp


def compare(recorded: dict, current: dict) -> tuple[list[dict], list[str]]:
    """([{key, recorded, now}] for each difference, keys the study never recorded)."""
    changes = [{"key": k, "recorded": recorded[k], "now": v} for k, v in current.items()
               if k in recorded and recorded[k] != v]
    return changes, [k for k in current if k not in recorded]


# -- the stored command ----------------------------------------------------------------------------
def stored_command(best_dir: Path) -> tuple[list[str], dict[str, str], str]:
    """(argv, env, source) of the exported configuration, from best/launch.json (what `autotune export`
    writes for machines; launch.sh says the same for people)."""
    launch_json = best_dir / "launch.json"
    if not launch_json.exists():
        raise ValueError(f"nothing exported in {best_dir} (no launch.json): run `autotune export` first")
    doc = json.loads(launch_json.read_text())
    argv = [str(a) for a in doc["argv"]]
    if len(argv) > 2 and argv[1] == "-m":  # a Python module: run by this Python (CI images move the interpreter)
        argv[0] = sys.executable
    return argv, {k: str(v) for k, v in (doc.get("env") or {}).items()}, str(launch_json)


def start(adapter, argv: list[str], env: dict, log: Path, timeout_s: float):
    """Launch the stored command; on a failed start, retry once with renamed flags translated.
    Returns (launcher or None, argv used, translation notes, failure or None)."""
    notes, failure = [], None
    for attempt in range(2):
        try:
            return launch(adapter, argv=argv, env=env, log_path=log, timeout_s=timeout_s), argv, notes, None
        except LaunchError as e:
            failure = f"launch {e.kind}: {e.message}"
        if attempt == 0:
            argv, notes = adapter.translate_renamed(argv)
            if not notes:
                break
    if notes:
        failure += f" (also after translating renamed flags: {'; '.join(notes)})"
    return None, argv, notes, failure


# -- the re-check ----------------------------------------------------------------------------------
def reference(ctx) -> dict:
    """The validated numbers and the load they were measured with (unvalidated: the study's trial)."""
    primary = ctx.primary()
    metric, direction = primary.name, primary.direction
    doc = Validation.load(ctx.best_dir)
    settings = {**ctx.load, "slo": ctx.slo, **(doc.settings if doc else {})}
    winner = doc.winner if doc else None
    if winner:
        stats = {k: s.model_dump() for k, s in winner.stats.items()}
    else:
        launch = ctx.best_dir / "launch.json"
        stats = json.loads(launch.read_text()).get("metrics", {}) if launch.exists() else {}
    median = (stats.get(metric) or {}).get("median")
    return {"metric": metric, "direction": direction, "median": median, "stats": stats, "settings": settings,
            "validation": ValidationSettings().updated(settings), "validated": bool(winner),
            "trial": winner.trial if winner else None}


def recheck(ctx, ref: dict, *, tolerance: float, launch_timeout_s: float = 300.0, console=None) -> dict:
    """Launch the exported best, benchmark it `repeats` times as validation does (its measuring, its reasons);
    {verdict: ok|regressed|broken, ...}: broken when requests failed or the server exited."""
    adapter = ctx.adapter
    argv, env, source = stored_command(ctx.best_dir)
    log = ctx.directory / "ci" / "logs" / f"recheck-{time.strftime('%Y%m%d-%H%M%S')}.log"
    out = {"source": source, "argv": argv, "log": str(log), "runs": []}
    server, out["argv"], out["translated"], failure = start(adapter, argv, env, log, launch_timeout_s)
    if server is None:
        return {**out, "verdict": "broken", "reason": failure}
    s = ref["settings"]
    workload = load_workload(s.get("workload") or ctx.workload, s.get("seed", 0))
    slo = parse_slo(s["slo"]) if s.get("slo") else None
    repeats = ref["validation"].repeats
    rec = new_record("recheck", {})
    load = {"concurrency": s.get("concurrency"), "max_tokens": s.get("max_tokens"), "seed": s.get("seed", 0)}
    try:
        with Progress(TextColumn("[bold]ci[/] re-benchmark"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=True, disable=console is None) as bar:
            task = bar.add_task("", total=repeats)
            benchmark(server, [rec], repeats=repeats, workload=workload, load=load, num_requests=s.get("num_requests"),
                      log=log, tick=lambda: bar.advance(task))
    finally:
        server.stop()
    out["runs"] = [{k: run.get(k) for k in (*SHOWN, "completed", "error_rate", "errors_by_kind")} for run in rec["runs"]]
    problems = repeat_reasons(rec["runs"], slo) + ([rec["failure"]] if rec.get("failure") else [])
    median = spread([run.get(ref["metric"]) for run in out["runs"]])["median"]
    out["median"] = median
    if median is None or any(p.kind in BROKEN for p in problems):
        return {**out, "verdict": "broken", "reason": texts(problems) or f"no {ref['metric']} measured"}
    if ref["median"]:
        ratio = median / ref["median"]
        out["ratio"] = ratio
        worse = ratio < 1 - tolerance if ref["direction"] == MAXIMIZE else ratio > 1 + tolerance
        if worse:
            problems.insert(0, Reason(kind="regressed", text=f"{ref['metric']} {median:.4g} vs {ref['median']:.4g} "
                                      f"recorded ({ratio - 1:+.1%}, tolerance {tolerance:.0%})"))
    else:
        problems.append(Reason(kind="no_reference", text=f"the study recorded no {ref['metric']} to compare with"))
    return {**out, "verdict": "regressed" if problems else "ok", "reason": texts(problems) or None}


def texts(reasons: list[Reason]) -> str:
    return "; ".join(r.text for r in reasons)


def refresh_provenance(ctx, fp: dict, hardware, record: dict, recorded: dict) -> dict:
    """provenance.json describes this environment now; what it described before stays under ci.previous."""
    path = ctx.directory / "provenance.json"
    old = ctx.provenance
    new = provenance.write(path, hardware=hardware, adapter=ctx.adapter, model=old.get("model"),
                                   draft_model=old.get("draft_model"), workload=old.get("workload") or ctx.workload,
                                   space_source=old.get("space"))
    doc = {**old, **new, "fingerprint": fp,
           "ci": {**record, "previous": {"written": old.get("written"), "fingerprint": recorded}}}
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return doc


# -- the re-tune -----------------------------------------------------------------------------------
def warm_start_source(ctx):
    """The study the exported configuration came from: the original, or the last re-tune of it."""
    launch = ctx.best_dir / "launch.json"
    name = json.loads(launch.read_text()).get("study") if launch.exists() else None
    directory = ctx.directory / "ci" / str(name)
    if name and name != ctx.name and directory.exists():
        return load_study(directory, ctx.storage)
    return ctx


def recorded_space(source) -> dict:
    """The narrowing a study ran under (its --set/--space), read off its trials: what Optuna was asked
    (distributions) keeps its choices or range; what was never asked yet always had one value was pinned."""
    space = load_space(source.engine)
    trials = source.study.get_trials(deepcopy=False)
    asked = {name: d for t in trials for name, d in t.distributions.items()}
    out = {}
    for name, param in space.params.items():
        d = asked.get(name)
        if isinstance(d, optuna.distributions.CategoricalDistribution):
            spec = [json.loads(c) for c in d.choices] if param.type == "batch_sizes" else list(d.choices)
        elif d is not None:
            spec = {"low": d.low, "high": d.high}
        else:
            seen = {json.dumps((t.user_attrs.get("config") or {}).get(name)) for t in trials
                    if name in (t.user_attrs.get("config") or {})}
            if len(seen) != 1 or seen == {"null"}:
                continue
            spec = json.loads(seen.pop())
        try:
            space.narrowed({name: spec})
        except SpaceError:  # not expressible as a narrowing: the re-tune searches that parameter's full range
            continue
        out[name] = spec
    return out


def retune(ctx, ref: dict, *, budget_s: float | None, trials: int, top: int = WARM_START_TOP, console=None) -> dict:
    """A new study in the same storage, warm-started from the last one, finished as `autotune run` finishes
    (`budget_s` bounds both). Returns {study, directory, from, enqueued, remembered_failures, measured,
    validation, report, problem?}."""
    started = time.time()
    source = warm_start_source(ctx)
    s = ref["settings"]
    name = f"{ctx.name}-ci-{time.strftime('%Y%m%d-%H%M%S')}"
    narrowing = ctx.directory / "ci" / f"{name}.space.yaml"  # the re-tune searches the space the study searched
    narrowing.parent.mkdir(parents=True, exist_ok=True)
    narrowing.write_text(f"# narrowing of study {source.name}, read off its trials\n"
                         + yaml.safe_dump(recorded_space(source), sort_keys=False))
    opts = plan.RunOptions(engine=ctx.engine, model=ctx.model, draft_model=ctx.draft_model,
                             workload=s.get("workload") or ctx.workload, slo=s.get("slo"), objective=ctx.objective,
                             trials=trials, budget_s=budget_s, study=name, storage=ctx.storage, resume=True,
                             concurrency=s.get("concurrency"), num_requests=s.get("num_requests"),
                             max_tokens=s.get("max_tokens"), seed=s.get("seed", 0),
                             space=str(narrowing), studies_root=str(ctx.directory / "ci"), live=console is not None)
    the_plan = plan.build(opts)
    budget = pipeline.run_budget(the_plan, estimator=False, start=started, settings=ref["validation"])
    study, _ = storage.open_study(name, the_plan.storage, objectives.metrics(opts.objective),
                                  objectives.make_sampler(opts.objective), objectives.make_pruner(opts.objective), False)
    exported = json.loads((ctx.best_dir / "launch.json").read_text()).get("config") \
        if (ctx.best_dir / "launch.json").exists() else None
    configs = [exported] if exported else []  # first: what is deployed, measured afresh
    configs += [c for c in (t.user_attrs.get("config") or {} for t in source.ranked()[:top]) if c not in configs]
    remembered = 0
    for t in source.study.get_trials(deepcopy=False):
        if t.user_attrs.get("status") in FAILED and t.user_attrs.get("effective_key"):
            attrs = {**t.user_attrs, "measured": False, "remembered_from": f"{source.name} trial {t.number}"}
            study.add_trial(optuna.trial.create_trial(
                state=optuna.trial.TrialState.PRUNED, params=t.params, distributions=t.distributions,
                user_attrs=attrs, constraints=t.constraints or {"feasible": 1.0}))
            remembered += 1
    outcome = loop.run_study(the_plan, console=console, budget=budget,
                             first=[(config, {"seed_config": config, "warm_start": source.name}) for config in configs])
    if outcome.interrupted:  # Ctrl-C: the re-tune's trials are kept; nothing is validated or exported
        raise KeyboardInterrupt
    out = {"study": name, "directory": str(the_plan.directory), "from": source.name, "enqueued": len(configs),
           "remembered_failures": remembered, "measured": sum(bool(t.user_attrs.get("measured"))
                                                               for t in study.get_trials(deepcopy=False)),
           "validation": None, "report": None}
    if outcome.best is None:
        out["problem"] = "no configuration measured within the re-tune budget met the study's requirements"
        return out
    done = pipeline.finish(the_plan.directory, ctx.storage, run_options=opts, settings=ref["validation"],
                           load={"min_measure_s": s.get("min_measure_s")}, console=console, estimator=False,
                           budget=budget, progress=console is not None)
    out.update(validation=done["validation"], report=done["report"] and str(done["report"]))
    if done["problems"]:
        out["problem"] = "; ".join(done["problems"])
    return out


def install(ctx, tuned: dict) -> list[str]:
    """The re-tune's validated winner becomes the study's exported best (best/*, validation.json)."""
    new = load_study(tuned["directory"], ctx.storage)
    written = export.export(new, out=ctx.best_dir)
    copied = Validation.load(new.best_dir).write(ctx.best_dir / "validation.json")
    return [str(p) for p in written] + [str(copied)]


def flag_changes(adapter, old: list[str], new: list[str]) -> list[dict]:
    """[{flag, old, new}] between two engine commands (address flags left out)."""
    def options(argv):
        return {g[0]: " ".join(g[1:]) or "(set)" for g in flag_lines(adapter.engine_args(argv))
                if g[0] not in ("--host", "--port")}

    a, b = options(old), options(new)
    return [{"flag": f, "old": a.get(f), "new": b.get(f)} for f in sorted(set(a) | set(b)) if a.get(f) != b.get(f)]


# -- the whole check -------------------------------------------------------------------------------
def parse_tolerance(text: str) -> float:
    """"5%" or 0.05 -> 0.05."""
    try:
        value = float(text[:-1]) / 100 if text.strip().endswith("%") else float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise ValueError(f"--tolerance {text!r}: expected a share such as 5% or 0.05")
    return value


def check(study: str | Path, *, storage: str | None = None, tolerance: float = 0.05, retune_budget_s: float | None = 1200,
          retune_trials: int = 25, force: bool = False, launch_timeout_s: float = 300.0, console=None) -> dict:
    """Everything `autotune ci` does; returns the machine-readable result (its `exit_code` is the verdict).
    Raises ValueError (one line) on a study that cannot be checked."""
    ctx = load_study(study, storage)
    if not ctx.provenance:
        raise ValueError(f"study {ctx.name!r} has no provenance.json to compare with")
    hardware = probe()
    current = provenance.fingerprint(ctx.adapter, ctx.provenance.get("model"), ctx.provenance.get("draft_model"),
                                     hardware)
    recorded = recorded_fingerprint(ctx.provenance)
    changes, unrecorded = compare(recorded, current)
    result = {"study": ctx.name, "directory": str(ctx.directory), "changes": changes, "unrecorded": unrecorded,
              "fingerprint": current, "forced": force, "tolerance": tolerance}
    if not changes and not force:
        return {**result, "status": "unchanged", "exit_code": OK}
    ref = reference(ctx)
    result["recorded"] = {k: ref[k] for k in ("metric", "direction", "median", "validated", "trial")}
    result["recheck"] = recheck(ctx, ref, tolerance=tolerance, launch_timeout_s=launch_timeout_s, console=console)
    stamp = {"checked": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "verdict": result["recheck"]["verdict"],
             "measured": result["recheck"].get("median"), "recorded": ref["median"], "changes": changes}
    if result["recheck"]["verdict"] == "ok":
        refresh_provenance(ctx, current, hardware, stamp, recorded)
        return {**result, "status": "within_tolerance", "exit_code": OK}
    old_argv = result["recheck"]["argv"]
    tuned = retune(ctx, ref, budget_s=retune_budget_s, trials=retune_trials, console=console)
    result["retune"] = {k: v for k, v in tuned.items() if k != "validation"}
    winner = tuned["validation"].winner if tuned.get("validation") else None
    if winner:
        result["files"] = install(ctx, tuned)
        result["new"] = {"trial": winner.trial, "study": tuned["study"], "median": winner.median,
                         "stats": {k: v.median for k, v in winner.stats.items()},
                         "flags_changed": flag_changes(ctx.adapter, old_argv, winner.argv)}
        refresh_provenance(ctx, current, hardware, {**stamp, "retuned": tuned["study"]}, recorded)
    elif "problem" not in tuned:
        result["retune"]["problem"] = "no configuration passed validation"
    result.update(status="retuned" if winner else "regressed", exit_code=CHANGED)
    result["summary"] = str(write_summary(ctx, result))
    return result


def write_summary(ctx, result: dict) -> Path:
    """ci-summary.md: what changed, old vs new numbers, flags changed; written for a pull request."""
    re_, ref, new, tuned = result["recheck"], result["recorded"], result.get("new"), result["retune"]
    metric = ref["metric"]

    def num(v):
        return "-" if v is None else f"{v:.4g}"

    def code(v):
        return "-" if v is None else f"`{v}`"

    title = "re-tuned" if new else "regressed, and the re-tune found no validated replacement"
    lines = [f"# autotune ci: study `{ctx.name}` {title}", ""]
    if result["changes"]:
        lines += ["Environment changes since the study was tuned:", "", "| | recorded | now |", "|---|---|---|"]
        lines += [f"| {c['key']} | `{c['recorded']}` | `{c['now']}` |" for c in result["changes"]]
    else:
        lines.append("No environment change: re-checked because of `--force`.")
    lines += ["", f"Previous configuration ({Path(re_['source']).name}): **{re_['verdict']}**: {re_.get('reason')}"]
    if re_.get("translated"):
        lines += ["", "Renamed flags translated before retrying the launch:", ""]
        lines += [f"- {n}" for n in re_["translated"]]
    lines += ["", f"| {metric} | recorded{' (validated)' if ref['validated'] else ''} | previous configuration now | new configuration |",
              "|---|---|---|---|",
              f"| median | {num(ref['median'])} | {num(re_.get('median'))} | {num(new['median'] if new else None)} |"]
    if new and ref["median"]:
        ratio = "-" if re_.get("median") is None else f"{re_['median'] / ref['median']:.3g}x"
        lines.append(f"| vs recorded | | {ratio} | {new['median'] / ref['median']:.3g}x |")
    lines.append("")
    if new:
        if new["flags_changed"]:
            lines += ["Flags changed:", "", "| flag | old | new |", "|---|---|---|"]
            lines += [f"| `{f['flag']}` | {code(f['old'])} | {code(f['new'])} |" for f in new["flags_changed"]]
        else:
            lines.append("Flags changed: none (the previous configuration is still the best; its numbers are updated).")
        lines += ["", "Files updated: " + ", ".join(f"`{Path(p).relative_to(ctx.directory)}`" for p in result["files"])]
    lines += ["", (f"Re-tune: study `{tuned['study']}` warm-started from `{tuned['from']}` ({tuned['enqueued']} "
                   f"previous top configurations enqueued, {tuned['remembered_failures']} failed configurations "
                   f"remembered); trials measured: {tuned['measured']}.")]
    if tuned.get("report"):
        lines.append(f"Report: `{tuned['report']}`.")
    if tuned.get("problem"):
        lines.append(f"Problem: {tuned['problem']}.")
    path = ctx.directory / "ci-summary.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def describe(result: dict) -> list[str]:
    """Lines for the terminal."""
    out = []
    if result["status"] == "unchanged":
        out.append(f"{result['study']}: environment unchanged since the study was tuned; nothing to re-check")
        if result["unrecorded"]:
            out.append(f"  (not recorded by the study, so not compared: {', '.join(result['unrecorded'])})")
        return out
    for c in result["changes"]:
        out.append(f"changed: {c['key']}: {c['recorded']} -> {c['now']}")
    re_ = result["recheck"]
    for note in re_.get("translated") or []:
        out.append(f"translated: {note}")
    ref = result["recorded"]
    if re_.get("reason"):
        out.append(f"re-check: {re_['verdict']}: {re_['reason']}")
    else:
        out.append(f"re-check: {re_['verdict']}: {ref['metric']} {re_['median']:.4g}, recorded {ref['median']:.4g}")
    if result["status"] == "within_tolerance":
        out.append("within tolerance: provenance.json refreshed")
    elif result.get("new"):
        n = result["new"]
        out.append(f"re-tuned: study {n['study']} trial {n['trial']}, {result['recorded']['metric']} {n['median']:.4g}; "
                   f"{len(n['flags_changed'])} flags changed; summary in {result['summary']}")
    else:
        out.append(f"no replacement: {result['retune'].get('problem')}; summary in {result['summary']}")
    return out
