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
repeat to studies/<name>/validation/<label>-repeat-<r>.parquet. `finish_study` is what
`autotune run` calls at the end: validate -> export -> report.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import optuna
from optuna.trial import TrialState

DEFAULT_TOP = 3
DEFAULT_REPEATS = 3
MAX_NOISE = 0.10  # relative MAD of the objective above which a configuration is "noisy"
TRACKED = ("output_tok_s", "e2e_ms_p95", "ttft_ms_p95", "itl_ms_p95", "tpot_ms_p50", "decode_tok_s_p50",
           "accept_length", "error_rate")
# Settings that change what the model computes: with the baseline's values, greedy output must match exactly.
NUMERICS = {"embedded": ("dtype", "quantization", "compile"),
            "sglang": ("dtype", "quantization", "kv_cache_dtype", "enable_torch_compile"),
            "vllm": ("dtype", "quantization", "kv_cache_dtype")}
SPECULATION_OFF = {"embedded": {"drafter": "none"}, "sglang": {"speculative_algorithm": None},
                   "vllm": {"speculative_method": None}}
LOAD_DEFAULTS = {"concurrency": 4, "num_requests": 8, "max_tokens": 48}  # when the study recorded none


# -- the study and what it ran ---------------------------------------------------------------------
@dataclass
class StudyContext:
    name: str
    storage: str
    directory: Path
    study: optuna.Study
    engine: str
    objective: str
    workload: str
    model: str | None
    draft_model: str | None
    provenance: dict
    slo: str | None = None
    load: dict = field(default_factory=dict)  # concurrency, num_requests, max_tokens, seed

    @property
    def best_dir(self) -> Path:
        return self.directory / "best"

    def primary(self) -> tuple[str, str]:
        from autotune.study import objectives

        return objectives.metrics(self.objective)[0]


def open_study(study: str | Path, storage: str | None = None) -> StudyContext:
    """A study by name (under studies/) or by its directory; ValueError (one line) when there is none."""
    from autotune.study import storage as store
    from autotune.study.parallel import open_storage

    path = Path(study)
    directory = path if (path / "study.db").exists() or (path / "provenance.json").exists() else store.study_dir(str(study))
    url = storage or f"sqlite:///{directory / 'study.db'}"
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).exists():
        raise ValueError(f"no study {str(study)!r}: {url.removeprefix('sqlite:///')} does not exist")
    try:
        backend = open_storage(url)  # database URLs and journal files alike
        names = optuna.get_all_study_names(backend)
    except Exception as e:  # noqa: BLE001 - SQLAlchemy reports a bad URL in many ways
        raise ValueError(f"cannot open storage {url}: {str(e).splitlines()[0]}") from None
    name = directory.name if directory.name in names else (names[0] if len(names) == 1 else None)
    if name is None:
        raise ValueError(f"no study {directory.name!r} in {url} (it holds: {', '.join(names) or 'none'})")
    s = optuna.load_study(study_name=name, storage=backend)
    prov_path = directory / "provenance.json"
    provenance = json.loads(prov_path.read_text()) if prov_path.exists() else {}
    attrs = s.user_attrs
    engine = attrs.get("engine") or provenance.get("engine") or "embedded"
    model = attrs.get("model", provenance.get("model"))
    if engine == "embedded" and model and _is_bundled(model):
        model = None  # `autotune serve` finds the bundled model itself: the exported script stays portable
    first = next((t.user_attrs["metrics"] for t in s.get_trials(deepcopy=False) if t.user_attrs.get("metrics")), {})
    # What load the trials ran: recorded by the tuner where it does, else read off a trial's benchmark.
    load = {"concurrency": attrs.get("concurrency") or first.get("concurrency") or LOAD_DEFAULTS["concurrency"],
            "num_requests": attrs.get("num_requests") or first.get("sent") or LOAD_DEFAULTS["num_requests"],
            "max_tokens": attrs.get("max_tokens") or _max_tokens_of(first) or LOAD_DEFAULTS["max_tokens"],
            "seed": attrs.get("seed", first.get("seed", 0))}
    return StudyContext(name, url, directory, s, engine, attrs.get("objective", "throughput"),
                        attrs.get("workload") or provenance.get("workload") or "code", model,
                        attrs.get("draft_model", provenance.get("draft_model")), provenance,
                        attrs.get("slo") or first.get("slo"), load)


def _is_bundled(model: str) -> bool:
    from autotune.embedded.weights import bundled_gguf_path

    try:
        return Path(model).resolve() == bundled_gguf_path().resolve()
    except Exception:  # noqa: BLE001 - no bundled model installed: keep the path as given
        return False


def _max_tokens_of(summary: dict) -> int | None:
    mean = summary.get("output_tokens_mean")
    return round(mean) if mean else None


def is_ok(trial: optuna.trial.FrozenTrial) -> bool:
    a = trial.user_attrs
    return trial.state == TrialState.COMPLETE and (
        a.get("status") == "ok" or (a.get("status") == "duplicate" and a.get("original_status") == "ok"))


def ranked(ctx: StudyContext) -> list[optuna.trial.FrozenTrial]:
    """Measured trials that met every requirement, best first, one per distinct effective configuration."""
    _, direction = ctx.primary()
    trials = sorted((t for t in ctx.study.get_trials(deepcopy=False) if is_ok(t) and t.values),
                    key=lambda t: t.values[0], reverse=direction == "maximize")
    seen, out = set(), []
    for t in trials:
        key = t.user_attrs.get("effective_key") or json.dumps(t.user_attrs.get("config"), sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def baseline_config(ctx: StudyContext) -> tuple[dict, int | None]:
    """The engine defaults with the user's pins: the study's first seed (the defaults seed, narrowed by
    --set) with speculation off, so its greedy output is plain greedy decoding. Also the trial that
    measured exactly it, if any."""
    seeds = [t for t in ctx.study.get_trials(deepcopy=False) if t.user_attrs.get("seed_config") is not None]
    config = {**(seeds[0].user_attrs["seed_config"] if seeds else {}), **SPECULATION_OFF.get(ctx.engine, {})}
    key = json.dumps(_effective(ctx, config), sort_keys=True, default=str)
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
    from autotune.bench.client import ENDPOINTS
    from autotune.bench.runner import served_model

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
    knobs = NUMERICS.get(ctx.engine, ())
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
    from autotune.bench import run_benchmark
    from autotune.engines import get_adapter
    from autotune.engines.launcher import Launcher, LaunchError, free_port
    from autotune.study.driver import _json_ready

    adapter, port = get_adapter(ctx.engine), free_port()
    argv, env = adapter.command(config, model=ctx.model, draft_model=ctx.draft_model, host="127.0.0.1", port=port)
    base = f"http://127.0.0.1:{port}"
    log = ctx.directory / "validation" / "logs" / f"{label}.log"
    rec = {"label": label, "config": config, "argv": argv, "env": env, "log": str(log), "runs": [], "request_files": []}
    server = Launcher(argv, env=env, log_path=log, health_url=adapter.health_url(base), base_url=base)
    t0 = time.monotonic()
    try:
        server.start(timeout=launch_timeout_s)
    except LaunchError as e:
        rec["failure"] = f"launch {e.kind}: {e.message}"
        return rec
    rec["launch_s"] = round(time.monotonic() - t0, 3)
    try:
        try:
            rec["greedy"] = greedy_outputs(base, prompts, quality_tokens) if prompts else []
        except (httpx.HTTPError, KeyError, ValueError) as e:
            rec["greedy_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        for r in range(repeats):
            result = run_benchmark(base, workload, concurrency=ctx.load["concurrency"], seed=ctx.load["seed"],
                                   num_requests=ctx.load["num_requests"], max_tokens=ctx.load["max_tokens"],
                                   server_pid=server.proc.pid, progress=False)
            path = ctx.directory / "validation" / f"{label}-repeat-{r}.parquet"
            result.requests.assign(repeat=r).to_parquet(path, index=False)
            rec["request_files"].append(str(path))
            rec["runs"].append(_json_ready(result.summary))
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
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from autotune.bench import load_workload, parse_slo

    if top < 1 or repeats < 1:
        raise ValueError("--top and --repeats must be at least 1")
    ctx = study if isinstance(study, StudyContext) else open_study(study, storage)
    ctx.load.update({k: v for k, v in (load or {}).items() if v is not None})
    slo_text = slo or ctx.slo
    slo_parsed = parse_slo(slo_text) if slo_text else None
    workload = load_workload(ctx.workload, ctx.load["seed"])
    candidates = ranked(ctx)[:top]
    if not candidates:
        raise ValueError(f"study {ctx.name!r} has no measured trial that met its requirements: nothing to validate")
    base_config, base_trial = baseline_config(ctx)
    prompts = workload.requests[:quality_prompts]
    (ctx.directory / "validation").mkdir(parents=True, exist_ok=True)
    console = console or Console(stderr=True)
    metric, direction = ctx.primary()
    base_key = json.dumps(_effective(ctx, base_config), sort_keys=True, default=str)
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
            same = json.dumps(_effective(ctx, config), sort_keys=True, default=str) == base_key
            rec = dict(baseline, label=f"trial-{t.number}") if same else run(f"trial-{t.number}", config)
            if same:
                bar.advance(task, repeats)
            rec.update(trial=t.number, config=config, study_value=t.values[0],
                       quality=quality(ctx, config, base_config, rec.get("greedy") or [], reference))
            rec["reasons"] = judge(ctx, rec, slo_parsed, max_noise)
            rec["status"] = "demoted" if rec["reasons"] else "passed"
            results.append(rec)
    winner, warning = _pick(results, metric, direction)
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


def _effective(ctx: StudyContext, config: dict) -> dict:
    from autotune.engines import get_adapter

    return get_adapter(ctx.engine).effective(config)


def _pick(results: list[dict], metric: str, direction: str) -> tuple[dict | None, str | None]:
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


# -- the end of `autotune run` ---------------------------------------------------------------------
def finish_study(study: str | Path, storage: str | None = None, *, run_options=None, top: int = DEFAULT_TOP,
                 repeats: int = DEFAULT_REPEATS, slo: str | None = None, load: dict | None = None,
                 console=None, **validate_options) -> dict:
    """validate -> export -> report; each step's failure is reported and the next still runs.
    `run_options` (the tuner's RunOptions) supplies the study's SLO and load.
    Returns {"validation": doc | None, "exported": [paths], "report": path | None, "problems": [lines]}."""
    from rich.console import Console

    from autotune import export, report

    console = console or Console(stderr=True)
    out = {"validation": None, "exported": [], "report": None, "problems": []}
    if run_options is not None:
        slo = slo or run_options.slo
        load = {**{k: getattr(run_options, k) for k in ("concurrency", "num_requests", "max_tokens", "seed")},
                **(load or {})}
    ctx = open_study(study, storage)
    steps = (("validate", lambda: validate(ctx, top=top, repeats=repeats, slo=slo, load=load, console=console,
                                           **validate_options)),
             ("export", lambda: export.export(ctx)),
             ("report", lambda: report.write_report(ctx)))
    for name, step in steps:
        try:
            out[{"validate": "validation", "export": "exported", "report": "report"}[name]] = step()
        except (ValueError, OSError) as e:
            out["problems"].append(f"{name}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
            console.print(f"[yellow]{name}:[/] {out['problems'][-1].split(': ', 1)[1]}")
    return out
