"""Validation: relaunch a study's best configurations fresh, benchmark each several times, and pick
the winner that is fast, steady, within every SLO and faithful to the baseline's greedy output.

A study measures each configuration once, on a server that may have been reused; the best of many
noisy measurements is biased upwards (the winner's curse). So the top K distinct configurations
(and the baseline: the study's engine-defaults trial, else the engine's own defaults) each get a
fresh launch, a warm-up (compiling and graph capture are launch cost) and N benchmarks of the study's
load; configurations that differ only in runtime settings (the draft length) share a launch and are
measured in alternation, as the study's trials share a server (on a GPU a launch compiles for a minute); a
repeat added to one of them is a launch of all of them (`next_round`), so they stay paired. Per metric: median, MAD and a bootstrap 95% interval of the median. A configuration is demoted, with the reason written down, when it fails to
launch, has errors, misses an SLO in any repeat, or is noisy (MAD above `max_noise` of the median).
Its greedy outputs are compared with the baseline's token by token (identical prompts, identical-token
share, first divergence per prompt) and reported, not judged: with the baseline's numerics, greedy
verification reproduces plain decoding exactly in float32 on a CPU, while on a GPU a wider verify
batch runs other kernels, whose rounding can change a near-tie (bf16 most of all).
The winner is the best configuration that passes everything but noise. Noise does not demote: it widens
the interval a winner's gain must clear, so a noisy configuration 5x faster than a steady one still wins
(on the H200 a bf16 + CUDA-graph engine at 13% MAD lost to the float32 defaults at a fifth of its speed when
noise ranked it below every steady one), and one inside the noise of a rival ties with it (below).

Speculation makes runs vary, so the number of repeats follows the measured spread: while the winner
does not beat the runner-up and the baseline beyond the noise (the 90% interval of its gain, Welch t
on log values, excludes 1.0), each of them gets one more repeat on one more fresh launch, up to a
cap. A race still open at the cap is a tie: both are in validation.json and the one with fewer
settings changed from the engine defaults is exported. A race the budget ends before the cap is a tie too,
but the evidence is not in: the fastest by median is exported (on the H200 the simpler of such a pair ran
5% slower, benchmarks/results/h200-2026-12-03c).

`validate(study)` writes studies/<name>/best/validation.json and the per-request tables of every
repeat to studies/<name>/validation/<label>-repeat-<r>.parquet.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import httpx
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from autotune.bench import load_workload, parse_slo
from autotune.bench.client import ENDPOINTS
from autotune.bench.runner import measure_server, served_model, sized_load, warm_up
from autotune.engines.launcher import LaunchError, launch
from autotune.study.budget import FLOOR, Finish, Prices
from autotune.study.record import effective_key
from autotune.study.storage import StudyContext, load_study

DEFAULT_TOP = 3
DEFAULT_REPEATS = 3
MAX_REPEATS = 6  # per configuration: where adding repeats to a close race stops
CONFIDENCE = 0.90  # a winner's gain over a rival must clear 1.0 at this confidence, else they tie
MAX_NOISE = 0.10  # relative MAD of the objective above which a configuration is "noisy"
TRACKED = ("output_tok_s", "e2e_ms_p95", "ttft_ms_p95", "itl_ms_p95", "tpot_ms_p50", "decode_tok_s_p50",
           "accept_length", "error_rate")


def baseline_config(ctx: StudyContext) -> tuple[dict, int | None]:
    """The engine defaults with the user's pins: the study's defaults seed (narrowed by --set; where the
    narrowing left it out, the first seed run) with speculation off, so its greedy output is plain greedy
    decoding. Also the trial that measured exactly it, if any."""
    seeds = [t for t in ctx.study.get_trials(deepcopy=False) if t.user_attrs.get("seed_config") is not None]
    seeds = sorted(seeds, key=lambda t: not t.user_attrs.get("defaults_seed"))  # stable: else the first seed
    seed = ctx.study.user_attrs.get("defaults_seed_config") or (seeds[0].user_attrs["seed_config"] if seeds else {})
    config = {**seed, **ctx.adapter.speculation_off}
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


def agreement(reference: list[dict], outputs: list[dict], encode=None) -> dict:
    """How far each greedy output agrees with the baseline's, token by token: per prompt whether it is
    identical, the first position where they part (None: identical) and how many of the baseline's tokens
    came before it; the identical-token share is those over all the baseline's tokens. Tokens are the texts
    re-encoded with the model's tokenizer (`encode`), else characters."""
    split = encode or list
    per_prompt = []
    for i, (a, b) in enumerate(zip(reference, outputs)):
        ta, tb = split(a["text"]), split(b["text"])
        part = next((n for n, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        identical = output_divergence(a, b) is None
        per_prompt.append({"prompt": i, "identical": identical, "first_divergence": None if identical else part,
                           "baseline_tokens": len(ta), "agreeing_tokens": len(ta) if identical else min(part, len(ta))})
    total = sum(p["baseline_tokens"] for p in per_prompt)
    return {"unit": "token" if encode else "character",
            "identical_share": sum(p["agreeing_tokens"] for p in per_prompt) / total if total else 1.0,
            "per_prompt": per_prompt}


def quality(ctx: StudyContext, config: dict, base: dict, outputs: list[dict], reference: list[dict] | None,
            encode=None) -> dict:
    """The candidate's greedy outputs against the baseline's: identical prompts, token agreement, the first
    divergence. `mode` exact: its numerics (dtype, quantization, ...) are the baseline's, so only speculation
    differs; lossy: they differ, and so may the outputs."""
    knobs = ctx.adapter.numerics
    changed = {k: config.get(k) for k in knobs if config.get(k) != base.get(k)}
    mode = "lossy" if changed else "exact"
    if reference is None:
        return {"mode": mode, "checked": False, "note": "baseline outputs unavailable"}
    diverged = [(i, d) for i, (a, b) in enumerate(zip(reference, outputs)) if (d := output_divergence(a, b))]
    out = {"mode": mode, "checked": True, "prompts": len(reference), "identical": len(reference) - len(diverged),
           **agreement(reference, outputs, encode)}
    if changed:
        out["note"] = f"numerics differ from the baseline ({', '.join(f'{k}={v}' for k, v in changed.items())}): " \
                      "outputs are compared but need not be identical"
    if diverged:
        out["first_divergence"] = {"prompt": diverged[0][0], **diverged[0][1]}
    return out


# -- one configuration: fresh launch, warm-up, greedy outputs, N benchmarks -------------------------
def new_record(label: str, config: dict) -> dict:
    return {"label": label, "config": config, "runs": [], "request_files": [], "launches": []}


def launch_groups(ctx: StudyContext, recs: list[dict]) -> list[list[dict]]:
    """`recs` grouped by what a running server cannot change: configurations that differ only in runtime
    settings (the draft length, say) share one launch, as the study's trials share a server."""
    runtime = set(ctx.adapter.runtime_params)
    groups: dict = {}
    for rec in recs:
        key = effective_key(ctx.adapter, {k: v for k, v in rec["config"].items() if k not in runtime})
        groups.setdefault(key, []).append(rec)
    return list(groups.values())


def measure(ctx: StudyContext, recs: list[dict], *, repeats: int, prompts: list[dict], quality_tokens: int,
            workload, launch_timeout_s: float, tick=lambda: None) -> None:
    """One fresh launch shared by `recs` (one launch group), its warm-up, each record's greedy outputs (on
    its first launch) and `repeats` benchmarks of each, in alternation (the order flips every repeat), added
    to the records: a later call is one more launch of them."""
    runtime_names = set(ctx.adapter.runtime_params)

    def use(server, rec):  # the record's runtime settings on the shared server
        runtime = {k: v for k, v in rec["config"].items() if k in runtime_names}
        if len(recs) > 1 and runtime:
            ctx.adapter.apply_runtime(server.base_url, runtime)

    n = len(recs[0]["launches"])
    label = "+".join(rec["label"] for rec in recs)
    log = ctx.directory / "validation" / "logs" / (f"{label}.log" if n == 0 else f"{label}-launch-{n}.log")
    t0 = time.monotonic()
    try:
        server = launch(ctx.adapter, recs[0]["config"], model=ctx.model, draft_model=ctx.draft_model, log_path=log,
                        timeout_s=launch_timeout_s)
    except LaunchError as e:
        for rec in recs:
            first = not rec["launches"]
            rec.update(failure=f"launch {e.kind}: {e.message}", **({"argv": e.argv, "env": {}, "log": str(log)} if first else {}))
        return
    launched = {"log": str(log), "launch_s": round(time.monotonic() - t0, 3)}
    firsts = [rec for rec in recs if not rec["launches"]]
    port = int(server.base_url.rsplit(":", 1)[1])
    for rec in firsts:  # each its own command line (the runtime settings as flags) at this address
        argv = ctx.adapter.command(rec["config"], model=ctx.model, draft_model=ctx.draft_model, host="127.0.0.1",
                                   port=port)[0] if rec is not recs[0] else server.argv
        rec.update(argv=argv, env=server.env, log=str(log), launch_s=launched["launch_s"])
    try:
        use(server, recs[0])
        # compiling and graph capture at the first requests are launch cost, not the first repeat's speed
        warm = warm_up(server, workload, concurrency=ctx.load["concurrency"], max_tokens=ctx.load["max_tokens"],
                       seed=ctx.load["seed"], request_timeout=launch_timeout_s)
        launched["warmup_s"] = warm["warmup_s"]
        for rec in firsts:
            rec["warmup_s"] = warm["warmup_s"]
            try:
                use(server, rec)
                rec["greedy"] = greedy_outputs(server.base_url, prompts, quality_tokens) if prompts else []
            except (httpx.HTTPError, KeyError, ValueError) as e:
                rec["greedy_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        # as long as a trial's benchmark: the requests that fill the load's least length at the warm pace
        # (sized at a record's first launch, kept for its later ones: repeats measure one load)
        concurrency = ctx.load["concurrency"] or 1
        n = recs[0].get("bench_requests") or sized_load(ctx.load["num_requests"], warm["waves"][-1], concurrency,
                                                         concurrency, ctx.load["min_measure_s"])
        for rec in recs:
            rec["bench_requests"] = n
        alive = True
        for repeat in range(repeats):
            for rec in (recs if repeat % 2 == 0 else recs[::-1]):
                use(server, rec)
                r = len(rec["runs"])
                summary, requests = measure_server(server, workload, concurrency=ctx.load["concurrency"],
                                                   num_requests=n,
                                                   max_tokens=ctx.load["max_tokens"], seed=ctx.load["seed"])
                path = ctx.directory / "validation" / f"{rec['label']}-repeat-{r}.parquet"
                requests.assign(repeat=r).to_parquet(path, index=False)
                rec["request_files"].append(str(path))
                rec["runs"].append(summary)
                tick()
                alive = server.alive()
                if not alive:
                    for failed in recs:
                        failed["failure"] = f"server exited during repeat {r} (see {log})"
                    break
            if not alive:
                break
    finally:
        server.stop()
    for rec in recs:
        rec["launches"].append(launched)
        rec["stats"] = {m: spread([run.get(m) for run in rec["runs"]]) for m in TRACKED}


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
    if rec.get("greedy_error"):
        reasons.append(f"quality: greedy requests failed ({rec['greedy_error']})")
    return reasons


# -- the whole validation --------------------------------------------------------------------------
def validate(study: str | Path | StudyContext, *, storage: str | None = None, top: int = DEFAULT_TOP,
             repeats: int = DEFAULT_REPEATS, slo: str | None = None, max_noise: float = MAX_NOISE,
             quality_prompts: int = 4, quality_tokens: int = 32, load: dict | None = None,
             launch_timeout_s: float = 300.0, max_repeats: int | None = None, confidence: float = CONFIDENCE,
             console=None, progress: bool = True, deadline: float | None = None) -> dict:
    """Validate the top configurations of a study; writes best/validation.json and returns its content.
    Repeats are added (one more launch each) to the winner and every rival it does not yet beat beyond the
    noise, up to `max_repeats` each (default: MAX_REPEATS, at least `repeats`). `deadline` (time.time(), a
    run's --budget): the first round shrinks to fit it (fewer configurations, then fewer repeats, never below
    the best one and the baseline twice each) at the prices the study's trials paid, and a round is added only
    while it fits."""
    max_repeats = max(repeats, MAX_REPEATS if max_repeats is None else max_repeats)
    if top < 1 or repeats < 1:
        raise ValueError("--top and --repeats must be at least 1")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be between 0 and 1, got {confidence}")
    ctx = study if isinstance(study, StudyContext) else load_study(study, storage)
    ctx.load.update({k: v for k, v in (load or {}).items() if v is not None})
    slo_text = slo or ctx.slo
    slo_parsed = parse_slo(slo_text) if slo_text else None
    workload = load_workload(ctx.workload, ctx.load["seed"])
    candidates = ctx.ranked()[:top]
    if not candidates:
        raise ValueError(f"study {ctx.name!r} has no measured trial that met its requirements: nothing to validate")
    prices = Prices.of(ctx.study.get_trials(deepcopy=False), ctx.load["concurrency"] or 1) if deadline else None
    asked = {"top": top, "repeats": repeats}
    if prices:
        top, repeats = fitting_round(prices, deadline - time.time(), min(top, len(candidates)), repeats)
        candidates = candidates[:top]
    base_config, base_trial = baseline_config(ctx)
    prompts = workload.requests[:quality_prompts]
    (ctx.directory / "validation").mkdir(parents=True, exist_ok=True)
    console = console or Console(stderr=True)
    metric, direction = ctx.primary()
    base_key = effective_key(ctx.adapter, base_config)
    steps = repeats * (len(candidates) + 1)
    looks = max_repeats - repeats + 1  # times the intervals are looked at: once per added repeat, and first
    with Progress(TextColumn("[bold]validate[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, disable=not progress) as bar:
        task = bar.add_task("", total=steps)

        def run(recs, n=repeats):
            for group in launch_groups(ctx, recs):
                bar.update(task, description=" + ".join(rec["label"] for rec in group))
                measure(ctx, group, repeats=n, prompts=prompts, quality_tokens=quality_tokens, workload=workload,
                        launch_timeout_s=launch_timeout_s, tick=lambda: bar.advance(task))

        def judged(rec):
            rec["reasons"] = judge(ctx, rec, slo_parsed, max_noise)
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
                        "slo": slo_text, "max_noise": max_noise, "workload": ctx.workload,
                        "quality_prompts": len(prompts), "quality_tokens": quality_tokens,
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
            gain = win_median / base_median if direction == "maximize" else base_median / win_median
        doc["winner"] = {"trial": chosen["trial"], "label": chosen["label"], "config": chosen["config"],
                         "argv": chosen["argv"], "env": chosen["env"], "median": win_median,
                         "gain_over_baseline": gain, "repeats": len(chosen["runs"]), "stats": chosen["stats"],
                         "tie": tie is not None, "warning": warning}
    ctx.study.set_user_attr("validated_best_trial", chosen["trial"] if chosen else None)
    ctx.best_dir.mkdir(parents=True, exist_ok=True)
    (ctx.best_dir / "validation.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return doc


def fitting_round(prices: Prices, seconds: float, top: int, repeats: int) -> tuple[int, int]:
    """(top, repeats) of the largest first round that fits in `seconds`: configurations dropped first (the
    best ones stay), then repeats; at least the best configuration and the baseline, twice each."""
    finish = Finish(top, repeats, estimator_passes=False)
    least = min(repeats, FLOOR["repeats"])
    for n in range(repeats, least - 1, -1):
        for k in range(top, FLOOR["top"] - 1, -1):
            if finish.validation_s(prices, k + 1, n) <= seconds:
                return k, n
    return FLOOR["top"], least


def round_seconds(ctx: StudyContext, recs: list[dict], prices: Prices) -> float:
    """One more round of `recs`: a launch per launch group, a benchmark per record."""
    return len(launch_groups(ctx, recs)) * prices.launch_s + len(recs) * prices.bench_s


def next_round(ctx: StudyContext, results: list[dict], baseline: dict, *, confidence: float, looks: int,
               max_repeats: int) -> list[dict]:
    """Who gets one more fresh launch: the winner and each rival it does not yet beat beyond the noise (below
    `max_repeats`), with every runtime variant that shares a launch with one of them, so variants stay paired
    launch for launch. Empty once the race is settled or capped."""
    metric, direction = ctx.primary()
    winner, _ = pick_winner(results, metric, direction)
    if winner is None:
        return []
    close = [r for r in rivals(ctx, winner, results, baseline, metric, direction)
             if not beats(winner, r, metric, direction, confidence, looks)]
    more = [r for r in (winner, *close) if len(r["runs"]) < max_repeats and not r.get("failure")]
    if not close or not more:
        return []
    chosen = {id(r) for r in more}
    for group in launch_groups(ctx, results):
        if any(id(r) in chosen for r in group):
            more += [r for r in group if id(r) not in chosen and not r.get("failure")]
    return more


# -- beyond the noise --------------------------------------------------------------------------------
def gain_interval(a: list[float], b: list[float], direction: str, confidence: float, looks: int = 1) -> dict | None:
    """How much better the runs `a` are than `b` (> 1: better): the ratio of their geometric means, with a
    Welch t interval of the difference of mean logs at `confidence`, Bonferroni-split over `looks` (each
    time repeats are added and the interval is read again is one more chance of a false win). None while
    either side has fewer than 2 values."""
    la = np.log([v for v in a if v is not None and v > 0])
    lb = np.log([v for v in b if v is not None and v > 0])
    if la.size < 2 or lb.size < 2:
        return None
    sign = 1.0 if direction == "maximize" else -1.0
    diff = sign * float(la.mean() - lb.mean())
    va, vb = la.var(ddof=1) / la.size, lb.var(ddof=1) / lb.size
    half = 0.0
    if va + vb > 0:
        df = (va + vb) ** 2 / (va ** 2 / (la.size - 1) + vb ** 2 / (lb.size - 1))
        half = t_quantile(1 - (1 - confidence) / looks / 2, df) * float(np.sqrt(va + vb))
    return {"gain": float(np.exp(diff)), "interval": [float(np.exp(diff - half)), float(np.exp(diff + half))],
            "confidence": confidence, "looks": looks, "repeats": [int(la.size), int(lb.size)]}


def t_quantile(p: float, df: float) -> float:
    """Student's t quantile for p >= 0.5 (scipy.stats.t.ppf), by bisection on its CDF: scipy is a dev-only
    package and validation runs on a plain install."""
    if not 0.5 <= p < 1 or df <= 0:
        raise ValueError(f"t_quantile needs 0.5 <= p < 1 and df > 0, got p={p}, df={df}")
    lo, hi = 0.0, 1.0
    while _t_cdf(hi, df) < p:
        lo, hi = hi, 2 * hi
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_cdf(mid, df) < p else (lo, mid)
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return (lo + hi) / 2


def _t_cdf(t: float, df: float) -> float:
    """P(T <= t) for t >= 0: 1 - I_x(df/2, 1/2) / 2 with x = df / (df + t^2)."""
    return 1.0 - 0.5 * _beta_regularized(df / 2, 0.5, df / (df + t * t))


def _beta_regularized(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta I_x(a, b), by its continued fraction (Lentz's method)."""
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    if x > (a + 1) / (a + b + 2):  # the fraction converges fast only below this point: use the symmetry
        return 1.0 - _beta_regularized(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return front * h / a


def compare(a: dict, b: dict, metric: str, direction: str, confidence: float, looks: int) -> dict:
    """Record `a` against record `b`: gain interval and whether it clears 1.0."""
    g = gain_interval([r.get(metric) for r in a["runs"]], [r.get(metric) for r in b["runs"]], direction, confidence, looks)
    return {"a": a, "b": b, "winner": a["label"], "rival": b["label"], "rival_trial": b.get("trial"),
            **(g or {"gain": None, "interval": None, "repeats": [len(a["runs"]), len(b["runs"])]}),
            "beyond_noise": bool(g) and g["interval"][0] > 1.0}


def beats(a: dict, b: dict, metric: str, direction: str, confidence: float, looks: int) -> bool:
    return compare(a, b, metric, direction, confidence, looks)["beyond_noise"]


def rivals(ctx: StudyContext, winner: dict, results: list[dict], baseline: dict, metric: str, direction: str) -> list[dict]:
    """What the winner must beat beyond the noise: the runner-up (noisy ones included: the interval weighs
    their noise), and the baseline (the engine defaults)."""
    pool = [r for r in contenders(results, metric) if r is not winner]
    pick = max if direction == "maximize" else min
    out = [pick(pool, key=lambda r: r["stats"][metric]["median"])] if pool else []
    base_key = effective_key(ctx.adapter, baseline["config"])
    measured = (baseline.get("stats") or {}).get(metric, {}).get("median") is not None
    if measured and all(effective_key(ctx.adapter, r["config"]) != base_key for r in (winner, *out)):
        out.append(baseline)  # unless the winner or the runner-up is the baseline's configuration
    return out


def settle(ctx: StudyContext, winner: dict | None, comparisons: list[dict], results: list[dict], baseline: dict,
           race_cut: bool = False):
    """(the configuration to export, the tie or None). A winner that does not beat a rival beyond the noise
    ties with it; of the tied ones, the one closest to the engine defaults (fewest settings changed: the
    simpler launch) is exported, the faster one on equal counts. `race_cut`: the budget ended the race
    before its repeats were in, so the fastest by median is exported."""
    if winner is None:
        return None, None
    exportable = all(x.startswith("noisy:") for x in baseline.get("reasons", []))  # not flaky, SLOs met
    tied = [c["b"] for c in comparisons if not c["beyond_noise"] and (c["b"] is not baseline or exportable)]
    if not tied:
        return winner, None
    group = [winner, *tied]
    metric, direction = ctx.primary()
    sign = -1 if direction == "maximize" else 1
    changed = {r["label"]: sorted(ctx.adapter.effective(r["config"])) for r in group}
    others = ", ".join(r["label"] for r in tied)
    if race_cut:
        chosen = winner
        why = (f"{winner['label']} is fastest by median; the budget ended the race before it beat {others} beyond "
               f"the noise; exported {winner['label']}, the fastest on the evidence in")
    else:
        chosen = min(group, key=lambda r: (len(ctx.adapter.effective(r["config"])), sign * r["stats"][metric]["median"]))
        why = (f"{winner['label']} is fastest by median but does not beat {others} beyond the noise; exported "
               f"{chosen['label']}, the one with fewest settings changed from the engine defaults")
    return chosen, {"between": [r["label"] for r in group], "trials": [r.get("trial") for r in group],
                    "fastest": winner["label"], "exported": chosen["label"], "changed": changed,
                    "race_cut": race_cut, "why": why}


def contenders(results: list[dict], metric: str) -> list[dict]:
    """Measured configurations that may win: those whose only fault, if any, is noise (the interval weighs it)."""
    measured = [r for r in results if r.get("stats") and r["stats"][metric]["median"] is not None]
    return [r for r in measured if all(x.startswith("noisy:") for x in r["reasons"])]


def pick_winner(results: list[dict], metric: str, direction: str) -> tuple[dict | None, str | None]:
    """The best configuration whose only fault, if any, is noise, with a warning when it is noisy. Whether it
    beats the others beyond that noise is for `settle` (a tie exports the simpler configuration)."""
    pool = contenders(results, metric)
    if not pool:
        return None, None
    pick = max if direction == "maximize" else min
    best = pick(pool, key=lambda r: r["stats"][metric]["median"])
    steady = not best["reasons"]
    return best, None if steady else f"trial {best['trial']} wins by median with {best['reasons'][0]}"


def _public(rec: dict) -> dict:
    """The record as written to validation.json (the greedy texts are long: only the quality verdict stays)."""
    keep = ("label", "trial", "config", "argv", "env", "log", "launch_s", "warmup_s", "bench_requests", "failure",
            "greedy_error", "study_value",
            "stats", "quality", "status", "reasons", "request_files")
    out = {k: rec[k] for k in keep if k in rec}
    out["runs"] = [{k: run.get(k) for k in (*TRACKED, "completed", "failed", "duration_s", "errors_by_kind")}
                   for run in rec.get("runs", [])]
    return out
