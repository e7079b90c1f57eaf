"""Validation: relaunch a study's best configurations fresh, benchmark each several times, and pick
the winner that is fast, steady, within every SLO and faithful to the baseline's greedy output.

A study measures each configuration once, on a server that may have been reused; the best of many
noisy measurements is biased upwards (the winner's curse). So the top K distinct configurations
(and the baseline: the study's engine-defaults trial, else the engine's own defaults) each get a
fresh launch and N benchmarks of the study's load. Per metric: median, MAD and a bootstrap 95%
interval of the median. A configuration is demoted, with the reason written down, when it fails to
launch, has errors, misses an SLO in any repeat, is noisy (MAD above `max_noise` of the median), or
changes the greedy output of the baseline where its numerics (dtype, quantization, ...) are the
baseline's: speculative decoding with greedy verification must reproduce plain greedy decoding.
The winner is the best configuration that passes everything; noise alone only ranks a configuration
below the steady ones (if all are noisy, the best still wins, with the warning written down).

`validate(study)` writes studies/<name>/best/validation.json and the per-request tables of every
repeat to studies/<name>/validation/<label>-repeat-<r>.parquet.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from autotune.bench import load_workload, parse_slo
from autotune.bench.client import ENDPOINTS
from autotune.bench.runner import measure_server, served_model
from autotune.engines.launcher import LaunchError, launch
from autotune.study.record import effective_key
from autotune.study.storage import StudyContext, load_study

DEFAULT_TOP = 3
DEFAULT_REPEATS = 3
MAX_NOISE = 0.10  # relative MAD of the objective above which a configuration is "noisy"
TRACKED = ("output_tok_s", "e2e_ms_p95", "ttft_ms_p95", "itl_ms_p95", "tpot_ms_p50", "decode_tok_s_p50",
           "accept_length", "error_rate")


def baseline_config(ctx: StudyContext) -> tuple[dict, int | None]:
    """The engine defaults with the user's pins: the study's first seed (the defaults seed, narrowed by
    --set) with speculation off, so its greedy output is plain greedy decoding. Also the trial that
    measured exactly it, if any."""
    seeds = [t for t in ctx.study.get_trials(deepcopy=False) if t.user_attrs.get("seed_config") is not None]
    config = {**(seeds[0].user_attrs["seed_config"] if seeds else {}), **ctx.adapter.speculation_off}
    key = effective_key(ctx.adapter, config)
    same = [t for t in ctx.study.get_trials(deepcopy=False) if t.user_attrs.get("effective_key") == key]
    return config, (same[0].number if same else None)


# -- statistics ------------------------------------------------------------------------------------
def spread(values: list[float], resamples: int = 2000, seed: int = 0) -> dict:
    """Median, MAD, MAD relative to the median, and a bootstrap 95% interval of the median."""
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=float)
    if v.size == 0:
        return {"median": None, "mad": None, "rel_mad": None, "ci95": None, "values": []}
    median = float(np.median(v))
    mad = float(np.median(np.abs(v - median)))
    boot = np.median(np.random.default_rng(seed).choice(v, size=(resamples, v.size)), axis=1)
    return {"median": median, "mad": mad, "rel_mad": mad / abs(median) if median else 0.0,
            "ci95": [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))], "values": v.tolist()}


# -- greedy outputs --------------------------------------------------------------------------------
def greedy_outputs(base_url: str, prompts: list[dict], max_tokens: int) -> list[dict]:
    """The greedy completion of each prompt, one at a time (no batching effects): {text, tokens}.
    The OpenAI API returns text; with the token count beside it, equal text and equal count is the
    token-for-token check the API allows."""
    model, out = served_model(base_url), []
    with httpx.Client(timeout=300) as client:
        for request in prompts:
            body = {k: v for k, v in request.items() if k not in ("api", "stream", "stream_options", "top_p", "top_k")}
            body.update(model=model, temperature=0.0, max_tokens=max_tokens, stream=False, seed=0)
            r = client.post(base_url + ENDPOINTS[request["api"]], json=body)
            r.raise_for_status()
            reply = r.json()
            choice = reply["choices"][0]
            text = choice["message"]["content"] if request["api"] == "chat" else choice["text"]
            out.append({"text": text, "tokens": (reply.get("usage") or {}).get("completion_tokens")})
    return out


def output_divergence(baseline: dict, candidate: dict) -> dict | None:
    d = first_divergence(baseline["text"], candidate["text"])
    if d is None and baseline["tokens"] != candidate["tokens"]:
        n = len(baseline["text"])
        d = {"char": n, "word": len(baseline["text"].split()), "baseline": f"{baseline['tokens']} tokens",
             "candidate": f"{candidate['tokens']} tokens (same text)"}
    return d


def first_divergence(baseline: str, candidate: str, context: int = 40) -> dict | None:
    """Where two outputs part: character offset, word number and the text around it on each side."""
    if baseline == candidate:
        return None
    i = next((n for n, (a, b) in enumerate(zip(baseline, candidate)) if a != b), min(len(baseline), len(candidate)))
    return {"char": i, "word": len(baseline[:i].split()),
            "baseline": baseline[max(0, i - context):i + context], "candidate": candidate[max(0, i - context):i + context]}


def quality(ctx: StudyContext, config: dict, base: dict, outputs: list[dict], reference: list[dict] | None) -> dict:
    knobs = ctx.adapter.numerics
    changed = {k: config.get(k) for k in knobs if config.get(k) != base.get(k)}
    mode = "lossy" if changed else "exact"
    if reference is None:
        return {"mode": mode, "checked": False, "note": "baseline outputs unavailable"}
    diverged = [(i, d) for i, (a, b) in enumerate(zip(reference, outputs)) if (d := output_divergence(a, b))]
    out = {"mode": mode, "checked": True, "prompts": len(reference), "identical": len(reference) - len(diverged)}
    if changed:
        out["note"] = f"numerics differ from the baseline ({', '.join(f'{k}={v}' for k, v in changed.items())}): " \
                      "outputs are compared but need not be identical"
    if diverged:
        out["first_divergence"] = {"prompt": diverged[0][0], **diverged[0][1]}
    return out


# -- one configuration: fresh launch, greedy outputs, N benchmarks ---------------------------------
def measure(ctx: StudyContext, label: str, config: dict, *, repeats: int, prompts: list[dict], quality_tokens: int,
            workload, launch_timeout_s: float, tick=lambda: None) -> dict:
    log = ctx.directory / "validation" / "logs" / f"{label}.log"
    rec = {"label": label, "config": config, "log": str(log), "runs": [], "request_files": []}
    t0 = time.monotonic()
    try:
        server = launch(ctx.adapter, config, model=ctx.model, draft_model=ctx.draft_model, log_path=log,
                        timeout_s=launch_timeout_s)
    except LaunchError as e:
        rec.update(argv=e.argv, env={}, failure=f"launch {e.kind}: {e.message}")
        return rec
    rec.update(argv=server.argv, env=server.env, launch_s=round(time.monotonic() - t0, 3))
    base = server.base_url
    try:
        try:
            rec["greedy"] = greedy_outputs(base, prompts, quality_tokens) if prompts else []
        except (httpx.HTTPError, KeyError, ValueError) as e:
            rec["greedy_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        for r in range(repeats):
            summary, requests = measure_server(server, workload, concurrency=ctx.load["concurrency"],
                                               num_requests=ctx.load["num_requests"], max_tokens=ctx.load["max_tokens"],
                                               seed=ctx.load["seed"])
            path = ctx.directory / "validation" / f"{label}-repeat-{r}.parquet"
            requests.assign(repeat=r).to_parquet(path, index=False)
            rec["request_files"].append(str(path))
            rec["runs"].append(summary)
            tick()
            if not server.alive():
                rec["failure"] = f"server exited during repeat {r} (see {log})"
                break
    finally:
        server.stop()
    rec["stats"] = {m: spread([run.get(m) for run in rec["runs"]]) for m in TRACKED}
    return rec


def judge(ctx: StudyContext, rec: dict, slo, max_noise: float) -> list[str]:
    """Why this configuration cannot be the winner (empty: it passes)."""
    if rec.get("failure"):
        return [f"flaky: {rec['failure']}"]
    reasons = []
    metric, _ = ctx.primary()
    for r, run in enumerate(rec["runs"]):
        if run.get("error_rate"):
            reasons.append(f"flaky: repeat {r} had errors {run.get('errors_by_kind')}")
        for miss in (slo.check(run) if slo else []):
            reasons.append(f"slo: repeat {r} {miss}")
    noise = rec["stats"][metric]["rel_mad"]
    if noise is not None and noise > max_noise:
        reasons.append(f"noisy: {metric} MAD {noise:.0%} of the median > {max_noise:.0%}")
    q = rec.get("quality", {})
    if rec.get("greedy_error"):
        reasons.append(f"quality: greedy requests failed ({rec['greedy_error']})")
    elif q.get("mode") == "exact" and q.get("checked") and q["identical"] < q["prompts"]:
        d = q["first_divergence"]
        reasons.append(f"quality: greedy output differs from the baseline on {q['prompts'] - q['identical']} of "
                       f"{q['prompts']} prompts; first at prompt {d['prompt']} char {d['char']}: "
                       f"baseline {d['baseline']!r} vs {d['candidate']!r}")
    return reasons


# -- the whole validation --------------------------------------------------------------------------
def validate(study: str | Path | StudyContext, *, storage: str | None = None, top: int = DEFAULT_TOP,
             repeats: int = DEFAULT_REPEATS, slo: str | None = None, max_noise: float = MAX_NOISE,
             quality_prompts: int = 4, quality_tokens: int = 32, load: dict | None = None,
             launch_timeout_s: float = 300.0, console=None, progress: bool = True) -> dict:
    """Validate the top configurations of a study; writes best/validation.json and returns its content."""
    if top < 1 or repeats < 1:
        raise ValueError("--top and --repeats must be at least 1")
    ctx = study if isinstance(study, StudyContext) else load_study(study, storage)
    ctx.load.update({k: v for k, v in (load or {}).items() if v is not None})
    slo_text = slo or ctx.slo
    slo_parsed = parse_slo(slo_text) if slo_text else None
    workload = load_workload(ctx.workload, ctx.load["seed"])
    candidates = ctx.ranked()[:top]
    if not candidates:
        raise ValueError(f"study {ctx.name!r} has no measured trial that met its requirements: nothing to validate")
    base_config, base_trial = baseline_config(ctx)
    prompts = workload.requests[:quality_prompts]
    (ctx.directory / "validation").mkdir(parents=True, exist_ok=True)
    console = console or Console(stderr=True)
    metric, direction = ctx.primary()
    base_key = effective_key(ctx.adapter, base_config)
    steps = repeats * (len(candidates) + 1)
    with Progress(TextColumn("[bold]validate[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, disable=not progress) as bar:
        task = bar.add_task("", total=steps)

        def run(label, config):
            bar.update(task, description=label)
            return measure(ctx, label, config, repeats=repeats, prompts=prompts, quality_tokens=quality_tokens,
                           workload=workload, launch_timeout_s=launch_timeout_s, tick=lambda: bar.advance(task))

        baseline = run("baseline", base_config)
        reference = baseline.get("greedy")
        results = []
        for t in candidates:
            config = t.user_attrs.get("config") or {}
            same = effective_key(ctx.adapter, config) == base_key
            rec = dict(baseline, label=f"trial-{t.number}") if same else run(f"trial-{t.number}", config)
            if same:
                bar.advance(task, repeats)
            rec.update(trial=t.number, config=config, study_value=t.values[0],
                       quality=quality(ctx, config, base_config, rec.get("greedy") or [], reference))
            rec["reasons"] = judge(ctx, rec, slo_parsed, max_noise)
            rec["status"] = "demoted" if rec["reasons"] else "passed"
            results.append(rec)
    winner, warning = pick_winner(results, metric, direction)
    doc = {"study": ctx.name, "storage": ctx.storage, "engine": ctx.engine, "objective": ctx.objective,
           "metric": metric, "direction": direction, "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "settings": {"top": top, "repeats": repeats, "slo": slo_text, "max_noise": max_noise,
                        "workload": ctx.workload, "quality_prompts": len(prompts), "quality_tokens": quality_tokens,
                        "model": ctx.model, "draft_model": ctx.draft_model, **ctx.load},
           "baseline": {**_public(baseline), "trial": base_trial},
           "candidates": [_public(r) for r in results],
           "demoted": [{"trial": r["trial"], "reasons": r["reasons"]} for r in results if r["reasons"]],
           "winner": None}
    if winner is not None:
        base_median = (baseline.get("stats") or {}).get(metric, {}).get("median")
        win_median = winner["stats"][metric]["median"]
        gain = None
        if base_median and win_median:
            gain = win_median / base_median if direction == "maximize" else base_median / win_median
        doc["winner"] = {"trial": winner["trial"], "config": winner["config"], "argv": winner["argv"],
                         "env": winner["env"], "median": win_median, "gain_over_baseline": gain,
                         "stats": winner["stats"], "warning": warning}
    ctx.study.set_user_attr("validated_best_trial", winner["trial"] if winner else None)
    ctx.best_dir.mkdir(parents=True, exist_ok=True)
    (ctx.best_dir / "validation.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return doc


def pick_winner(results: list[dict], metric: str, direction: str) -> tuple[dict | None, str | None]:
    """The best configuration that passed everything. Noise only demotes: when every survivor is
    noisy, the best of them still wins, with a warning (a launch.sh beats none; the spread is written)."""
    measured = [r for r in results if r.get("stats") and r["stats"][metric]["median"] is not None]
    passed = [r for r in measured if not r["reasons"]]
    noisy = [r for r in measured if r["reasons"] and all(x.startswith("noisy:") for x in r["reasons"])]
    pool = passed or noisy
    if not pool:
        return None, None
    pick = max if direction == "maximize" else min
    best = pick(pool, key=lambda r: r["stats"][metric]["median"])
    return best, None if passed else f"no configuration was steady: trial {best['trial']} wins with {best['reasons'][0]}"


def _public(rec: dict) -> dict:
    """The record as written to validation.json (the greedy texts are long: only the quality verdict stays)."""
    keep = ("label", "trial", "config", "argv", "env", "log", "launch_s", "failure", "greedy_error", "study_value",
            "stats", "quality", "status", "reasons", "request_files")
    out = {k: rec[k] for k in keep if k in rec}
    out["runs"] = [{k: run.get(k) for k in (*TRACKED, "completed", "failed", "duration_s", "errors_by_kind")}
                   for run in rec.get("runs", [])]
    return out
