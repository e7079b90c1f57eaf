"""Hardware and model conditions, checked before any launch (memory fit: autotune/predict/memory.py).

Cross-flag rules of one engine live in its adapter (`autotune/engines/<engine>.py: check`); what
depends on the machine and the model lives here: FP8 only where the GPU has it (natively on
cc >= 8.9, weight-only through Marlin W8A16 on Ampere), tensor parallelism dividing the GPU count
and the model's attention heads, CUDA graphs only on CUDA; drafters the checkpoints can run (MTP
only for a model with MTP layers; with a draft checkpoint, only what the engine's own code runs it as:
`adapter.draft_problem`); AWQ/GPTQ only for a checkpoint in that format. The engine adapter (`adapter`)
says which config key is its tensor-parallel size (`tp_key`), which names the drafter (`draft_keys[0]`)
and what family a drafter value is (`adapter.knobs(config).drafter`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

from autotune.space.space import Space

# Quantization values that read a checkpoint already in that format (never converted at load time).
CHECKPOINT_FORMATS = {"awq": "awq", "awq_marlin": "awq", "gptq": "gptq", "gptq_marlin": "gptq"}


@dataclass
class ModelShape:
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_params: int
    mtp_layers: int = 0  # next-token layers in the target checkpoint (NEXTN / mtp draft with them)
    checkpoint_quant: str | None = None  # the checkpoint's quant_method; None: 16-bit or a preset
    preset: bool = False  # a preset stands for every published variant (AWQ, GPTQ ...) of the model
    draft: object = None  # the --draft-model as read (predict.drafts.DraftCheckpoint), if one is given

    @classmethod
    def of(cls, model, draft=None) -> ModelShape:
        """The shape of a predict.ModelSpec (and the draft checkpoint, a predict.drafts.DraftCheckpoint)."""
        return cls(model.layers, model.heads, model.kv_heads, model.head_dim, int(model.params),
                   getattr(model, "mtp_layers", 0), getattr(model, "checkpoint_quant", None),
                   str(getattr(model, "source", "")).startswith("https://"), draft)


def drafter_problem(config: dict, shape: ModelShape | None, *, adapter, on_gpu: bool = True) -> str | None:
    """Why the drafter `config` names cannot run with this target and draft checkpoint (None: it can)."""
    key = adapter.facts.draft_keys[0]
    if shape is None or not key or config.get(key) in (None, "none"):
        return None
    if adapter.knobs(config, on_gpu).drafter == "mtp" and not shape.mtp_layers:
        return "mtp drafts with the target's own MTP layers; this model has none"
    return adapter.draft_problem(config, shape.draft) if shape.draft is not None else None


def quantization_problem(value, shape: ModelShape | None) -> str | None:
    """Why a quantization value does not match the checkpoint's weights (None: it does)."""
    if shape is None or shape.preset or value in (None, "none"):
        return None
    wanted = CHECKPOINT_FORMATS.get(str(value).lower())
    have = shape.checkpoint_quant
    if wanted and wanted != have:
        return f"quantization {value} reads {wanted.upper()} weights; the checkpoint is {have or '16-bit'}"
    if have in CHECKPOINT_FORMATS.values() and not wanted:
        return f"the checkpoint holds {have.upper()} weights; quantization {value} would re-quantize them"
    return None


# -- the machine -------------------------------------------------------------------------------------
def _gpu_count(hw) -> int:
    return int(getattr(hw, "gpu_count", 0) or 0)


def _fp8_mode(hw) -> str:
    profile = getattr(hw, "profile", None)
    return getattr(profile, "fp8_mode", "none") if profile is not None and _gpu_count(hw) else "none"


def cpu_cores(hw) -> int:
    """The probed machine's CPU cores (this process's view when the probe has none)."""
    cpu = getattr(hw, "cpu", None)
    return int(getattr(cpu, "cores", 0) or os.cpu_count() or 1)


def _fp8_allowed(value: str, mode: str) -> bool:
    """Native FP8 needs FP8 units (cc >= 8.9); weight-only FP8 (W8A16) also runs through Marlin on Ampere."""
    if "fp8" not in str(value).lower():
        return True
    weight_only = "w8a16" in str(value).lower() or "marlin" in str(value).lower()
    return mode == "native" or (weight_only and mode == "marlin_w8a16")


def hardware_violations(config: dict, hw, shape: ModelShape | None, *, adapter) -> list[str]:
    """Why this configuration of the engine `adapter` cannot run on this machine with this model (empty
    if it can)."""
    out = []
    gpus, mode = _gpu_count(hw), _fp8_mode(hw)
    for key in ("quantization", "kv_cache_dtype"):
        value = config.get(key)
        if value is not None and not _fp8_allowed(value, mode):
            out.append(f"{key}={value} needs FP8 support; this machine's FP8 mode is {mode!r}")
    key = adapter.facts.tp_key
    tp = config.get(key) if key else None
    if tp is not None and tp != 1:
        if tp > gpus or gpus % tp:
            out.append(f"{key}={tp} does not divide the GPU count {gpus}")
        if shape and shape.n_heads % tp:
            out.append(f"{key}={tp} does not divide the model's {shape.n_heads} attention heads")
    problem = quantization_problem(config.get("quantization"), shape)
    if problem:
        out.append(problem)
    problem = drafter_problem(config, shape, adapter=adapter, on_gpu=bool(gpus))
    if problem:
        out.append(problem)
    if config.get("quantization") == "gguf" and gpus:
        out.append("quantization gguf (the embedded engine's GGUF block kernels) runs on the CPU; this machine's engine runs on its GPU")
    if config.get("cuda_graph_batch_sizes") and not gpus:
        out.append("cuda_graph_batch_sizes need a CUDA GPU; this machine has none")
    threads, cores = config.get("threads"), cpu_cores(hw)
    if threads and threads > cores:
        out.append(f"threads={threads} exceeds the {cores} CPU cores")
    layers = config.get("early_exit_layers")
    if layers and shape and layers >= shape.n_layers:
        out.append(f"early_exit_layers={layers} must be below the model's {shape.n_layers} layers")
    return out


def restrict_space(space: Space, hw, shape: ModelShape | None, draft_model: str | None, *, adapter) -> Space:
    """Drop choices of the engine `adapter`'s space that can never run here, so the sampler does not
    spend trials on them.

    Parameters the user pinned are left alone: a pin that cannot run is pruned (with its reason)
    when the trial is checked, which tells the user why.
    """
    params = dict(space.params)

    def narrow(name, **changes):
        if name in params and not params[name].pinned:
            params[name] = replace(params[name], **changes)

    for key, values in adapter.facts.needs_draft_model.items():  # e.g. drafter=draft_model without --draft-model
        if key in params and not draft_model:
            narrow(key, choices=[c for c in params[key].choices if c not in values])
    if "quantization" in params:
        narrow("quantization", choices=[c for c in params["quantization"].choices
                                        if _fp8_allowed(c, _fp8_mode(hw)) and not (c == "gguf" and _gpu_count(hw))
                                        and not quantization_problem(c, shape)])
    key = adapter.facts.draft_keys[0]
    if key in params and params[key].type == "categorical":
        narrow(key, choices=[c for c in params[key].choices if not drafter_problem(
            {key: c}, shape, adapter=adapter, on_gpu=bool(_gpu_count(hw)))])
    if "cuda_graph_batch_sizes" in params and not _gpu_count(hw):
        narrow("cuda_graph_batch_sizes", choices=[[]], fixed=[])
    if "compile" in params and not _gpu_count(hw):
        # On a CPU torch.compile runs at the first request and takes longer than a trial may
        # (every compile trial of a default run timed out): offered only where it can pay off.
        narrow("compile", choices=["none"], fixed="none")
    if "threads" in params:
        narrow("threads", high=min(params["threads"].high, cpu_cores(hw)))
    tp = adapter.facts.tp_key
    if tp in params and params[tp].type == "int":
        narrow(tp, high=max(1, min(params[tp].high, _gpu_count(hw))))
    elif tp in params and params[tp].type == "categorical" and _gpu_count(hw):
        narrow(tp, choices=[c for c in params[tp].choices if c in (None, 1) or not hardware_violations(
            {tp: c}, hw, shape, adapter=adapter)])  # TP dividing the GPUs and the model's heads
    if "early_exit_layers" in params and shape:
        narrow("early_exit_layers", high=min(params["early_exit_layers"].high, shape.n_layers - 1))
    return replace(space, params=params)
