"""Enumerate an engine's search space over the knobs the model reads, drop what cannot run or fit, and
rank the rest by predicted decode tok/s: what `autotune estimate` prints and the tuner enqueues first."""
from __future__ import annotations

import dataclasses
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from autotune.hardware import planned
from autotune.predict.drafts import DraftCheckpoint
from autotune.predict.knobs import Engine
from autotune.predict.memory import MemoryEstimate, predict_memory
from autotune.predict.models import ModelSpec
from autotune.predict.speed import SpeedEstimate, predict_speed
from autotune.space.constraints import ModelShape, drafter_problem, hardware_violations, quantization_problem


@dataclass
class Prediction:
    memory: MemoryEstimate
    speed: SpeedEstimate

    def to_dict(self) -> dict:
        return {"predicted": True, "memory": self.memory.record(), "speed": dataclasses.asdict(self.speed)}


def _values(param) -> list:
    if param.pinned:
        return [param.fixed]
    if param.type in ("categorical", "batch_sizes"):
        return list(param.choices)
    low, high = int(param.low), int(param.high)
    if param.type == "float":  # a memory fraction: the engine's default, and the most the space allows
        return list(dict.fromkeys([param.default, param.high]))
    if high - low <= 8:
        return list(range(low, high + 1, int(param.step or 1)))
    powers = [2**i for i in range(high.bit_length()) if low <= 2**i <= high]
    return sorted({low, high, *powers} | ({param.default} if param.default is not None else set()))


def candidate_configs(space, engine: Engine) -> list[dict]:
    """Every combination of the knobs the model reads (the engine facts' `modelled`; inactive ones skipped),
    every other parameter at its default."""
    names = [n for n in engine.facts.modelled if n in space.params]
    configs = [{}]
    for name in names:
        grown = []
        for partial in configs:
            if not space.active(space.params[name], space.complete(partial)):
                grown.append(partial)
                continue
            grown += [{**partial, name: v} for v in _values(space.params[name])]
        configs = grown
    return [space.complete(c) for c in configs]


def _hardware(profile, num_gpus: int):
    hw = planned(profile) if profile.is_gpu else None
    return dataclasses.replace(hw, gpus=hw.gpus * num_gpus) if hw is not None else None


def rank_configs(space, model: ModelSpec, profile, num_gpus: int = 1, top: int = 10, *, engine: Engine,
                 concurrency: int = 1, context_len: int | None = None, alpha: float | None = None,
                 draft: ModelSpec | None = None, has_draft_model: bool = False,
                 draft_checkpoint: DraftCheckpoint | None = None, calibration=None,
                 keep=None) -> list[tuple[dict, Prediction]]:
    """The `top` configurations of `space` (of the engine adapter `engine`) by predicted decode tok/s (at
    `concurrency` when > 1, else one stream), each with its memory and speed prediction, one per launch
    command (the best of those a command stands for: two configurations the engine runs alike print alike).
    Skipped: configs the engine's rules, the hardware or the checkpoints refuse (MTP without MTP layers, a
    drafter the engine would not run `draft_checkpoint` with, AWQ for 16-bit weights), speculative
    algorithms needing a draft model when `has_draft_model` is False, and configs that do not fit memory.
    Speed is predicted at half of `context_len` cached tokens (a sequence's average while it grows to the
    length memory must hold). `keep`: a list that receives (config, reasons) for every configuration
    refused, in enumeration order."""
    if space.engine != engine.name:
        raise ValueError(f"a {space.engine} search space ranked as {engine.name} configurations")
    hw = _hardware(profile, num_gpus)
    shape = ModelShape.of(model, draft_checkpoint)
    on_gpu = bool(profile.is_gpu)
    refused = keep if keep is not None else []
    seen, ranked = set(), []
    for config in candidate_configs(space, engine):
        problems = engine.check(config, hw, has_draft_model=has_draft_model)
        if hw is not None:
            problems += hardware_violations(config, hw, shape, adapter=engine)
        else:  # no GPU: only what the checkpoints decide
            problems += [p for p in (quantization_problem(config.get("quantization"), shape),
                                     drafter_problem(config, shape, adapter=engine, on_gpu=on_gpu)) if p]
        if problems:
            refused.append((config, problems))
            continue
        key = repr(sorted(engine.effective(config).items()))
        if key in seen:
            continue
        seen.add(key)
        memory = predict_memory(model, config, profile, num_gpus, engine=engine, draft=draft,
                                context_len=context_len)
        if not memory.fits:
            refused.append((config, [memory.reason]))
            continue
        speed = predict_speed(model, config, profile, num_gpus, engine=engine, concurrency=concurrency,
                              context_len=memory.context_len // 2, alpha=alpha, draft=draft,
                              calibration=calibration, max_sequences=memory.max_sequences())
        ranked.append((config, Prediction(memory, speed)))
    ranked.sort(key=lambda cp: -(cp[1].speed.concurrent_tok_s if concurrency > 1 else cp[1].speed.single_tok_s))
    # what the user sees is the launch line: the same model and draft arguments stand in for every row
    lines, shown = set(), []
    for config, prediction in ranked:
        line = launch_command(engine, config, "MODEL", "DRAFT" if has_draft_model else None)
        if line not in lines:
            lines.add(line)
            shown.append((config, prediction))
    return shown[:top]


def launch_command(engine: Engine, config: dict, model: str | None, draft_model: str | None = None,
                   host: str = "127.0.0.1", port: int | None = None) -> str:
    """The engine adapter's launch command for `config` as one shell line (environment first, quoted), at
    the engine's own port unless told otherwise."""
    argv, env = engine.command(config, model=model, draft_model=draft_model, host=host,
                               port=port or engine.facts.default_port)
    argv = ["python3" if a == sys.executable else a for a in argv]
    return " ".join([f"{k}={shlex.quote(v)}" for k, v in env.items()] + [shlex.join(argv)])


def model_argument(model: ModelSpec, given: str, engine: Engine) -> str | None:
    """What the engine is told to load: a path as given; for a preset, what the adapter's preset_model
    makes of it and its Hugging Face repo (None: the engine's default model)."""
    marker = "huggingface.co/"
    if Path(given).exists():
        return given
    hub = None
    if model.source.startswith("https://") and marker in model.source:
        hub = "/".join(model.source.split(marker, 1)[1].split("/")[:2])
    return engine.preset_model(model.name, hub, given)


def changed(config: dict, space) -> dict:
    """The knobs that differ from the space's defaults (what a table row shows)."""
    defaults = space.defaults()
    return {k: v for k, v in config.items() if defaults.get(k, object()) != v}

