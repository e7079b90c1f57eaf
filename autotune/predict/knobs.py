"""One engine-neutral reading of a configuration: what the memory and speed model read.

Each engine adapter reads its own option names into `Knobs` (`adapter.knobs(config, on_gpu)`, in
autotune/engines/); `Engine` lists everything this package asks of an adapter, so predict never
imports the engines (nor branches on their names)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from autotune.predict import gguf_types

# Bytes per weight of the decoder's linear layers. AWQ and GPTQ at group size 128 pack 4-bit weights
# (0.5 B) with, per group of 128 weights of one output column, an fp16 scale (2 B) and a 4-bit zero
# packed eight to an int32 (0.5 B): 0.5 + 2.5/128 bytes (the qweight/qzeros/scales tensors of an AWQ or
# GPTQ checkpoint; Marlin repacks the same bytes). FP8/int8 per-channel scales are negligible.
INT4_G128_BYTES = 0.5 + 2.5 / 128
WEIGHT_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2, "auto": 2,
                "fp8": 1, "w8a16_fp8": 1, "int8": 1, "w8a8_int8": 1, "awq": INT4_G128_BYTES, "gptq": INT4_G128_BYTES,
                "int4": INT4_G128_BYTES, "awq_marlin": INT4_G128_BYTES, "gptq_marlin": INT4_G128_BYTES,
                # OCP Microscaling (MX) v1.0: 4-bit E2M1 elements with one 8-bit E8M0 scale per block of 32
                "mxfp4": 0.5 + 1 / 32,
                # the embedded engine running the bundled Q4_1 GGUF's blocks (20 bytes per 32 weights)
                "gguf": gguf_types.bytes_per_weight()["Q4_1"],
                # a GGUF file's weight format by llama-quantize's name, lower-cased (q4_k_m, bf16: the same 2 B)
                **{name.lower(): b for name, b in gguf_types.bytes_per_weight().items()}}
# 4-bit formats are a property of the checkpoint, never converted at load time (autotune/space/constraints.py).
# Drafters by family (each engine's facts map its own drafter names onto them: drafter_families):
# eagle / eagle3 = a one-layer head on the target's features; mtp = the target's own extra layer; draft = a
# separate small checkpoint; lookup = n-gram matching in the prompt (no model); early_exit / quantized_self = the
# embedded engine's self-drafters; dflash = a DFlash block drafter (one parallel pass drafts a block of tokens from
# the target's features).
DRAFTER_FAMILIES = ("eagle", "eagle3", "mtp", "draft", "lookup", "dflash", "early_exit", "quantized_self")
DEFAULT_EARLY_EXIT_LAYERS = 8


@dataclass(frozen=True)
class Knobs:
    engine: str  # the adapter's name, for display: the model reads the fields below, never this
    tp: int
    dtype: str  # activations / unquantized weights
    weight_bytes: float  # per linear-layer weight
    quantization: str | None  # as configured (fp8 = W8A8 on FP8 units; w8a16_fp8 = weight-only)
    kv_bytes: float  # per cached element
    drafter: str | None  # family (FAMILIES values) or None
    draft_steps: int  # sequential draft forward passes per step
    topk: int  # draft-tree branching (1 = a chain)
    verify_tokens: int  # tokens the target verifies per sequence per step (1 without speculation)
    cuda_graphs: bool
    graph_max_bs: int | None  # largest batch replayed from a CUDA graph (the engine's default when unset)
    mem_fraction: float | None  # the configured share of the GPU (SGLang mem_fraction_static, vLLM gpu_memory_utilization)
    max_running: int | None  # concurrent sequences the engine admits
    max_batch_tokens: int | None  # prefill chunk / batched-token budget
    early_exit_layers: int | None
    cuda_context: bool = True  # the process holds a CUDA context (counted in the workspace)
    quantized_head: bool = False  # weight quantization also keeps an int8 copy of a tied embedding as the head
    threads: int | None = None  # CPU threads the config asks for (None: one per core of this machine)
    block_size: int | None = None  # tokens per KV page (vLLM block_size, SGLang page_size; None: the engine's)
    # kernels a forward pass launches per decoder layer where the engine runs the layer op by op, each op a kernel
    # (the embedded engine without inductor, with int8's casts and scaling around each linear layer); None: a
    # fused path's count (autotune/predict/speed.py: KERNELS_PER_LAYER)
    layer_kernels: int | None = None
    # the weights are a GGUF file of this llama-quantize type (Q4_K_M): its output head and token embedding are
    # priced at the ggml types the file stores them at (its header, else llama-quantize's rules: gguf_types.py),
    # not at the activation dtype
    gguf_type: str | None = None
    # the token embedding stays in host memory when the layers run on a GPU (llama.cpp's input layer), and a
    # pass reads one row of it per token, not the table: off the GPU's memory and off the bytes per token
    embedding_on_host: bool = False
    # GPUs a MoE layer's experts are spread over, whole experts each (SGLang --ep-size; vLLM
    # --enable-expert-parallel: every GPU of the TP group); 1: every expert sliced over the TP GPUs
    ep: int = 1
    # a KV cache of this many bytes the config sets outright (vLLM kv_cache_memory_bytes; its CPU backend's
    # VLLM_CPU_KVCACHE_SPACE GiB), in place of what the memory fraction leaves
    kv_cache_bytes: float | None = None
    # tokens of KV each slot is allocated ("slots" engines; None: the context it must hold; 0: the model's
    # training context, llama-server's without --ctx-size)
    slot_tokens: int | None = None


class EngineFacts(Protocol):
    """What predict reads of an engine's facts (autotune/engines/facts.py: EngineFacts)."""

    memory_pool: str  # "static_fraction" | "utilization" | "slots": see autotune/predict/memory.py
    default_context_len: int  # tokens one sequence must hold when the caller says nothing
    modelled: tuple[str, ...]  # config keys the model reads: what rank_configs enumerates
    default_port: int  # where its launch commands listen
    spec_step_host_s: float | None  # host time a speculative step costs on a GPU (None: the speed model's prior)


class Engine(Protocol):
    """What predict reads from an engine adapter (autotune/engines/base.py: EngineAdapter)."""

    name: str
    facts: EngineFacts

    def knobs(self, config: dict, on_gpu: bool = True) -> Knobs: ...

    def for_target(self, on_gpu: bool, this_machine: bool = True) -> Engine: ...

    def default_memory_fraction(self, tp: int, gpu_mib: float | None = None, config: dict | None = None) -> float: ...

    def default_batch_tokens(self, gpu_mib: float, tp: int) -> int | None: ...

    def preset_model(self, preset: str, hub_repo: str | None, given: str) -> str | None: ...

    def check(self, config: dict, hardware=None, *, has_draft_model: bool | None = None) -> list[str]: ...

    def effective(self, config: dict) -> dict: ...

    def command(self, config: dict, *, model: str | None, draft_model: str | None, host: str,
                port: int) -> tuple[list[str], dict[str, str]]: ...


def settings(config: dict) -> dict:
    """The settings a config makes: None and "none" mean "left to the engine" and are dropped."""
    return {k: v for k, v in config.items() if v is not None and v != "none"}


def make_knobs(engine: str, c: dict, on_gpu: bool, *, tp: int, drafter: str | None, draft_steps: int = 0,
               topk: int = 1, verify_tokens: int = 1, cuda_graphs: bool, graph_max_bs: int | None,
               mem_fraction: float | None, max_running: int | None, max_batch_tokens: int | None,
               cuda_context: bool = True, quantized_head: bool = False, block_size: int | None = None,
               layer_kernels: int | None = None, gguf_type: str | None = None, embedding_on_host: bool = False,
               ep: int = 1) -> Knobs:
    """Knobs from what an adapter read of its own option names (`c`: settings(config)), plus what every
    engine spells alike: dtype, quantization, kv_cache_dtype, early_exit_layers, threads."""
    dtype = str(c.get("dtype", "bfloat16" if on_gpu else "float32"))
    quant = c.get("quantization")
    weight_bytes = WEIGHT_BYTES.get(str(quant).lower(), 1) if quant else WEIGHT_BYTES.get(dtype, 2)
    kv = str(c.get("kv_cache_dtype", "auto"))
    kv_bytes = 1 if "fp8" in kv else WEIGHT_BYTES.get(dtype if kv == "auto" else kv, 2)
    return Knobs(engine, tp, dtype, weight_bytes, quant, kv_bytes, drafter, draft_steps if drafter else 0, topk,
                 verify_tokens if drafter else 1, cuda_graphs, graph_max_bs, mem_fraction, max_running,
                 max_batch_tokens if max_batch_tokens and max_batch_tokens > 0 else None,
                 c.get("early_exit_layers", DEFAULT_EARLY_EXIT_LAYERS) if drafter == "early_exit" else None,
                 cuda_context, quantized_head, c.get("threads"), block_size, layer_kernels, gguf_type,
                 embedding_on_host, ep)
