"""What a run is asked to do, checked before anything is touched: `RunOptions` (the command line's
values) -> `build(opts)` -> `Plan` (engine adapter, space, hardware, workload, SLO, model, storage).
Bad input stops here with a one-line ValueError, leaving an existing study.db as it was."""
from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from autotune import predict
from autotune.bench import load_workload, parse_slo
from autotune.bench.load_profile import LoadProfile, parse_load_profile
from autotune.bench.runner import MEASURE_S
from autotune.embedded.bundled import GET_A_MODEL
from autotune.engines import get_adapter
from autotune.engines.base import EngineAdapter
from autotune.hardware import probe
from autotune.space import constraints
from autotune.space.fit import fit_space
from autotune.space.space import Space, load_overrides, load_space, parse_set_options, parse_space
from autotune.study import objectives, storage
from autotune.study.parallel import arrange

DEFAULT_TRIALS = 25
RUN_OPTIONS = ("workload", "slo", "concurrency", "num_requests", "max_tokens", "min_measure_s", "seed", "model",
               "draft_model", "load_profile")


@dataclass
class RunOptions:
    engine: str = "embedded"
    model: str | None = None
    draft_model: str | None = None
    workload: str = "code"
    slo: str | None = None
    objective: str = "throughput"
    trials: int | None = DEFAULT_TRIALS  # measured trials at most; None: as many as the budget holds
    budget_s: float | None = None
    study: str | None = None
    storage: str | None = None
    resume: bool = False
    sets: list[str] = field(default_factory=list)  # --set name=value
    space: str | None = None  # a full space YAML (has `parameters`) or a narrowing file
    concurrency: int | None = None
    num_requests: int | None = None
    quick_requests: int | None = None
    max_tokens: int | None = None
    min_measure_s: float = MEASURE_S  # a benchmark's least length: its requests multiplied to fill it (bench.runner)
    gpu: str = "auto"
    studies_root: str | None = None
    launch_timeout_s: float = 300.0
    seed: int = 0
    live: bool = True
    parallel: int | str = 1  # trials side by side: a number or "auto" (autotune/study/parallel.py)
    engine_binary: str | None = None  # a user's own build of a binary engine (llama-server)
    fit_schedule: bool = False  # fit a draft-length schedule for the winner (also when the load profile varies)
    load_profile: str | None = None  # every trial's benchmark runs these phases (bench/load_profile.py)


@dataclass
class Plan:
    """Everything checked before storage is touched: bad input stops here, leaving study.db as it was."""
    opts: RunOptions
    name: str
    storage: str
    directory: Path
    space: Space
    adapter: EngineAdapter
    hardware: object
    workload: object
    slo: object | None
    shape: constraints.ModelShape | None
    model: predict.ModelSpec  # what the memory and speed predictions read
    draft: predict.ModelSpec | None
    load_profile: LoadProfile | None = None  # opts.load_profile parsed; None: one load, sized to min_measure_s


def parse_duration(text: str) -> float:
    """"90s", "30m", "1h30m", "2h" or plain seconds -> seconds."""
    parts = re.fullmatch(r"\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s?)?\s*", text)
    if not text.strip() or not parts or not any(parts.groups()):
        raise ValueError(f"--budget {text!r}: expected a duration such as 90s, 30m, 1h30m")
    h, m, sec = (float(g) if g else 0.0 for g in parts.groups())
    return h * 3600 + m * 60 + sec


MIN_DEFAULT_REQUESTS = 8  # a benchmark's least requests where none are asked for: percentiles of a few at least


def default_requests(load, concurrency: int) -> int:
    """Requests a benchmark asks for at a concurrency the user chose: the engine's default load per stream (SGLang's
    128 requests at concurrency 32: 4), at least MIN_DEFAULT_REQUESTS. A floor the benchmark's sizing raises to
    --min-measure seconds; the engine's whole default at concurrency 1 kept one H200 trial measuring 41 s."""
    per_stream = load["num_requests"] / load["concurrency"]
    return max(MIN_DEFAULT_REQUESTS, math.ceil(per_stream * concurrency))


def options_from_cli(*, engine, budget, trials, resume, study, **rest) -> RunOptions:
    """RunOptions from the command line's values, with the defaults that depend on other flags."""
    if resume and not study:
        raise ValueError("--resume needs --study NAME (the study to continue)")
    if rest.get("min_measure_s", 0) < 0:
        raise ValueError(f"--min-measure {rest['min_measure_s']:g}: expected seconds >= 0")
    adapter = get_adapter(engine)  # raises for an unknown engine
    budget_s = parse_duration(budget) if budget else adapter.facts.default_budget_s
    load = adapter.facts.default_load
    if rest.get("num_requests") is None and rest.get("concurrency") is not None:
        rest["num_requests"] = default_requests(load, rest["concurrency"])
    for name, value in load.items():
        if rest.get(name) is None:
            rest[name] = value
    # A budget the user gave is the limit: a count of 25 ended a 10-minute llama.cpp run (launches of 2 s) at 5.
    trials = trials if trials is not None else (None if budget else DEFAULT_TRIALS)
    return RunOptions(engine=engine, budget_s=budget_s, trials=trials,
                      resume=resume, study=study, **rest)


def user_space(adapter: EngineAdapter, space_file: str | None, sets: list[str], model: str | None = None) -> Space:
    """The engine's space as the user narrowed it: `--space FILE` (a full space YAML, or a narrowing file
    {name: value | [values] | {low, high}}) and then `--set name=value` pins, then to what `model`'s files
    offer (adapter.model_space); ValueError (one line) for a name the engine does not have or a value its
    parameter cannot take (`run` and `estimate` alike)."""
    space = load_space(adapter.name)
    overrides: dict = {}
    if space_file:
        data = load_overrides(space_file)
        if "parameters" in data:
            space = parse_space(data, source=space_file)
        else:
            overrides.update(data)
    unknown = sorted(set(space.params) - adapter.config_keys())
    if unknown:
        raise ValueError(f"{space.source}: {', '.join(unknown)} {'is not an option' if len(unknown) == 1 else 'are not options'} "
                         f"of {adapter.name} {adapter.version}".rstrip())
    overrides.update(parse_set_options(sets))
    return adapter.model_space(space.narrowed(overrides), model)


def build(opts: RunOptions) -> Plan:
    """Resolve and validate every input; raises ValueError (one line) on anything unusable."""
    objectives.metrics(opts.objective)
    profile = parse_load_profile(opts.load_profile) if opts.load_profile else None
    if opts.trials is not None and opts.trials < 1:
        raise ValueError("--trials must be at least 1")
    for flag, path in (("--model", opts.model), ("--draft-model", opts.draft_model)):
        if path and not Path(path).exists():
            raise ValueError(f"{flag} {path}: no such file or directory; {GET_A_MODEL}")
    adapter = get_adapter(opts.engine)  # raises for an unknown engine
    if opts.engine_binary:
        adapter.use_binary(opts.engine_binary)
    if not adapter.installed():
        raise ValueError(adapter.missing())
    space = user_space(adapter, opts.space, opts.sets, opts.model)
    hardware = probe(opts.gpu)
    model = predict.load_model(opts.model)  # None: the bundled SmolLM2
    shape = constraints.ModelShape.of(model, predict.read_draft(opts.draft_model) if opts.draft_model else None)
    draft = predict.load_model(opts.draft_model) if opts.draft_model else None
    space = constraints.restrict_space(space, hardware, shape, opts.draft_model, adapter=adapter)
    space = fit_space(space, hardware, opts.concurrency)  # device knobs, native units, load-matched sizes
    space, parallel = arrange(space, hardware, opts.parallel, adapter)  # "auto" resolved; CPU threads shared
    opts = replace(opts, parallel=parallel)  # the plan's own options: the caller's stay as given
    workload = load_workload(opts.workload)
    slo = parse_slo(opts.slo) if opts.slo else None
    name = opts.study or f"{opts.engine}-{Path(opts.workload).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    directory = storage.study_dir(name, opts.studies_root)
    url = opts.storage or storage.default_storage(name, opts.studies_root)
    return Plan(opts, name, url, directory, space, adapter, hardware, workload, slo, shape, model, draft, profile)


def describe(p: Plan, queue: list[tuple[str, dict]]) -> list[str]:
    """`autotune run --plan`: the machine and load the space was fitted to, each parameter's values
    after the hardware's restrictions and the user's narrowing, and the trials queued first, in order."""
    o = p.opts
    profile = getattr(p.hardware, "profile", None)
    lines = [f"plan: {o.engine} on {p.hardware.gpu_count} GPU(s), profile {profile.name if profile else 'none'} "
             f"({p.hardware.source}); workload {o.workload} at concurrency {o.concurrency}, {o.num_requests} requests "
             f"of {o.max_tokens} tokens; " + (f"load profile {p.load_profile}; " if p.load_profile else "")
             + (f"budget {o.budget_s:g} s, " if o.budget_s else "")
             + (f"{o.trials} trials" if o.trials is not None else "trials until the budget"),
             "", "space:"]
    width = max(map(len, p.space.params))
    for param in p.space.params.values():
        if param.pinned:
            values = f"= {param.fixed!r}"
        elif param.type in ("categorical", "batch_sizes"):
            values = " | ".join(map(str, param.choices))
        else:
            values = f"{param.low:g}..{param.high:g}" + (" (log)" if param.log else "")
        when = "  when " + ", ".join(f"{k} in {v}" for k, v in param.when.items()) if param.when else ""
        lines.append(f"  {param.name:<{width}}  {values}{when}")
    lines += ["", "queued first (changed from the defaults):"]
    defaults = p.space.defaults()
    for i, (kind, config) in enumerate(queue):
        changed = ", ".join(f"{k}={v}" for k, v in config.items() if v != defaults.get(k)) or "(the defaults)"
        lines.append(f"  {i:>2} {kind:<9} {changed}")
    return lines
