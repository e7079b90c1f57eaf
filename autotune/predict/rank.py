"""Enumerate an engine's search space over the knobs the model reads, drop what cannot run or fit, and
rank the rest by predicted decode tok/s: what `autotune estimate` prints and the tuner enqueues first."""
from __future__ import annotations

import dataclasses
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from autotune.predict.memory import MemoryEstimate, predict_memory
from autotune.predict.models import ModelSpec
from autotune.predict.speed import SpeedEstimate, predict_speed

# The knobs the memory and speed model read, per engine; every other parameter keeps its default.
MODELLED = {
    "sglang": ("tp_size", "quantization", "kv_cache_dtype", "speculative_algorithm", "speculative_num_steps",
               "speculative_eagle_topk", "speculative_num_draft_tokens"),
    "vllm": ("tensor_parallel_size", "quantization", "kv_cache_dtype", "speculative_method", "num_speculative_tokens"),
    "embedded": ("drafter", "draft_length", "early_exit_layers", "verify_slots", "dtype", "quantization"),
}
# Drafters that read extra layers from the target checkpoint (DeepSeek-style MTP): the presets do not
# say which checkpoints carry them, so they are not offered.
NEEDS_MTP_WEIGHTS = ("NEXTN", "mtp")


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
    if param.type == "float":
        return [param.default]
    if high - low <= 8:
        return list(range(low, high + 1, int(param.step or 1)))
    powers = [2**i for i in range(high.bit_length()) if low <= 2**i <= high]
    return sorted({low, high, *powers} | ({param.default} if param.default is not None else set()))


def candidate_configs(space) -> list[dict]:
    """Every combination of the modelled knobs (inactive ones skipped), the rest at their defaults."""
    names = [n for n in MODELLED.get(space.engine, ()) if n in space.params]
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
    from autotune.hardware import planned

    hw = planned(profile) if profile.is_gpu else None
    return dataclasses.replace(hw, gpus=hw.gpus * num_gpus) if hw is not None else None


def rank_configs(space, model: ModelSpec, profile, num_gpus: int = 1, top: int = 10, *, concurrency: int = 1,
                 context_len: int | None = None, alpha: float | None = None, draft: ModelSpec | None = None,
                 has_draft_model: bool = False, calibration=None) -> list[tuple[dict, Prediction]]:
    """The `top` configurations of `space` by predicted decode tok/s (at `concurrency` when > 1, else one
    stream), each with its memory and speed prediction. Skipped: configs the engine's rules or the
    hardware refuse, speculative algorithms needing a draft model when `has_draft_model` is False, and
    configs that do not fit memory. Speed is predicted at half of `context_len` cached tokens (a
    sequence's average while it grows to the length memory must hold)."""
    from autotune.engines import get_adapter
    from autotune.space.constraints import ModelShape, hardware_violations

    adapter = get_adapter(space.engine)
    hw = _hardware(profile, num_gpus)
    shape = ModelShape.of(model)
    seen, ranked = set(), []
    for config in candidate_configs(space):
        algo = config.get("speculative_algorithm") or config.get("speculative_method")
        if algo in NEEDS_MTP_WEIGHTS or adapter.check(config, hw, has_draft_model=has_draft_model):
            continue
        if hw is not None and hardware_violations(config, hw, shape):
            continue
        key = repr(sorted(adapter.effective(config).items()))
        if key in seen:
            continue
        seen.add(key)
        memory = predict_memory(model, config, profile, num_gpus, engine=space.engine, draft=draft,
                                context_len=context_len)
        if not memory.fits:
            continue
        speed = predict_speed(model, config, profile, num_gpus, engine=space.engine, concurrency=concurrency,
                              context_len=memory.context_len // 2, alpha=alpha, draft=draft,
                              calibration=calibration, max_sequences=memory.max_sequences())
        ranked.append((config, Prediction(memory, speed)))
    ranked.sort(key=lambda cp: -(cp[1].speed.concurrent_tok_s if concurrency > 1 else cp[1].speed.single_tok_s))
    return ranked[:top]


def launch_command(engine: str, config: dict, model: str | None, draft_model: str | None = None,
                   host: str = "127.0.0.1", port: int = 30000) -> str:
    """The engine's launch command for `config` as one shell line (environment first, quoted)."""
    from autotune.engines import get_adapter

    argv, env = get_adapter(engine).command(config, model=model, draft_model=draft_model, host=host, port=port)
    argv = ["python3" if a == sys.executable else a for a in argv]
    return " ".join([f"{k}={shlex.quote(v)}" for k, v in env.items()] + [shlex.join(argv)])


def model_argument(model: ModelSpec, given: str, engine: str) -> str | None:
    """What the engine is told to load: a path as given; for a preset, its Hugging Face repo (the embedded
    engine loads local files only: its bundled SmolLM2 for that preset, None = its default)."""
    marker = "huggingface.co/"
    if Path(given).exists():
        return given
    if engine == "embedded":
        return None if model.name == "smollm2-135m" else given
    if model.source.startswith("https://") and marker in model.source:
        return "/".join(model.source.split(marker, 1)[1].split("/")[:2])
    return given


def changed(config: dict, space) -> dict:
    """The knobs that differ from the space's defaults (what a table row shows)."""
    defaults = space.defaults()
    return {k: v for k, v in config.items() if defaults.get(k, object()) != v}

