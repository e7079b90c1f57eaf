"""Decode speed from a roofline of the hardware profile, with kernel launches, speculative decoding
and concurrency.

A decode step is a list of forward passes (the target's verify pass, the drafter's passes). Each pass
takes   max(mem_scale * bytes / bandwidth, compute_scale * flops / peak, heavy kernels * kernel_s)
        + light kernels * kernel_s (under a CUDA graph) + all-reduce
        + step_overhead (once per step: scheduling, sampling) + kernels * launch_s (eager only)
        + spec_step_s (once per speculative step: proposing, acceptance, the host waiting on the GPU)
Bytes: the weights once per pass (memory.weights_read_bytes) plus every sequence's KV cache; FLOPs:
2 x parameters x tokens plus attention over the context. Kernels: KERNELS_PER_LAYER per decoder layer
(or the Knobs' layer_kernels where the engine runs a layer op by op) and HEAD_KERNELS per
pass. Even under a CUDA graph a kernel takes a few microseconds however little it does (kernel_s), so a
small model is bound by its kernel count, not its bytes, and the kernels that move next to no bytes (norms,
rope, activation, sampling: the light ones) add their floor after the GEMMs' bandwidth time; an eager pass (no
graphs, or a batch above the largest captured one) also pays each kernel's launch from the host (launch_s).
TP adds two all-reduces per layer of tokens x hidden activations (the custom all-reduce's published times on an
NVSwitch board; else a ring: 2(n-1)/n of the message over the link, plus a latency). A step yields E tokens
per sequence: its drafted tokens accepted with a per-position rate by drafter family
(autotune/predict/acceptance.py). The coefficients start at the priors below (kernel_s and launch_s from the hardware
profile's kernel_us) and are fitted per machine by Calibration (autotune/predict/calibration.py).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import numpy as np

from autotune.predict.acceptance import Acceptance, drafter_acceptance, expected_tokens
from autotune.predict.knobs import WEIGHT_BYTES, Engine, Knobs
from autotune.predict.memory import (
    DFLASH_ASSUMED_LAYERS,
    EAGLE3_DRAFT_VOCAB,
    UNKNOWN_DRAFT_FRACTION,
    dense_layer_params,
    draft_layer_params,
    kv_bytes_per_token,
    linear_read_bytes,
    routed_read_bytes,
    weights_read_bytes,
)
from autotune.predict.models import ModelSpec

# Kernels of one decoder layer on the plain bf16 path: 2 norms (residual add fused), the q/k/v and o
# projections (fused qkv in SGLang/vLLM; separate in the embedded engine, whose rope and cache write
# inductor fuses in), rope + cache write, attention, gate/up, activation, down: about 12 either way;
# the head: final norm, lm_head GEMM, sampling, and the step's small copies.
KERNELS_PER_LAYER = 12
HEAD_KERNELS = 4
# Of those, the ones that carry a layer's bytes: its four GEMMs (qkv, o, gate/up, down) and attention (the KV cache);
# the head's one is its GEMM. The others read and write a token's activations, next to nothing, so each takes a
# kernel's floor; kernels of one stream run one after another (a graph replays them in order), so those floors
# add to the GEMMs' bandwidth time instead of hiding under it (NVIDIA, "Getting Started with CUDA Graphs",
# https://developer.nvidia.com/blog/cuda-graphs/: a 2.9 us kernel takes 3.4 us of the stream's time in a graph).
HEAVY_LAYER_KERNELS = 5
# Per-kernel cost where the profile has no kernel_us (CPU): assumed, replaced by calibration.
CPU_KERNEL_S, CPU_LAUNCH_S = 1e-6, 200e-6 / KERNELS_PER_LAYER


@dataclass(frozen=True)
class Coefficients:
    mem_scale: float = 1 / 0.80  # decode GEMVs reach ~80% of the HBM bandwidth on the spec sheet
    compute_scale: float = 1 / 0.60  # large bf16 GEMMs reach ~60% of the dense Tensor Core peak
    step_overhead_s: float = 0.5e-3  # scheduling, sampling, graph launch per decode step
    kernel_s: float = 2.5e-6  # one kernel's floor inside a CUDA graph (hardware profile: kernel_us.graph)
    launch_s: float = 8e-6  # one kernel's launch from eager PyTorch (hardware profile: kernel_us.eager)
    # host work a speculative step adds (proposing drafts, reading back how many were accepted before the
    # next step can start): no public figure; the order of a step's own overhead, a guess that
    # calibration replaces from the study's first speculative trials (an engine's facts may give its own:
    # EngineFacts.spec_step_host_s)
    spec_step_s: float = 0.5e-3


# No profile numbers on a CPU machine: assumed here, replaced by calibration (benchmarks/bench_predict_accuracy.py).
CPU_BANDWIDTH_GBPS = 20.0  # a share of a server's DDR4/DDR5 channels
CPU_GFLOPS_PER_CORE = 25.0  # fp32 AVX2 FMA at ~2 GHz, half of the theoretical 64
CPU_COEFFICIENTS = Coefficients(mem_scale=1.0, compute_scale=1.0, step_overhead_s=1e-3, kernel_s=CPU_KERNEL_S,
                                launch_s=CPU_LAUNCH_S, spec_step_s=1e-3)
# All-reduce latency per call: SGLang/vLLM's one-shot custom all-reduce over NVLink; NCCL over PCIe. Where
# CUSTOM_ALL_REDUCE_US has the board, its published times replace this latency and the ring formula.
NVLINK_LATENCY_S, PCIE_LATENCY_S = 8e-6, 25e-6
# Time of one call of vLLM's custom all-reduce kernel (vLLM's default over NVLink) on an NVSwitch (SXM) board, by NVLink
# generation and TP size: (message bytes, us), from sgl-kernel's tests/test_trt_reduce.py (performance(), as stored:
# float32 tensors of 512 ... 2097152 elements, so 2 KB ... 8 MB; 5000 calls timed outside CUDA graphs, each copying
# its input into the registered buffer first: an upper bound for a graph-captured call by about that copy).
# A100 (NVLink 3): sgl-project/sglang PR #2688 ("performance result in a100", "vllm time"; its TP-8 lines end after
# 4096 elements in the stored text). H100 (NVLink 4): sgl-project/sglang PR #2904 ("unit test performance in H100
# (without cuda graph)", the "vllm" table). A decode token's 8-16 KB: 3-6 us above the 8 us prior on an A100; 1 MB
# (a 64-token tree of a 70B model): 2x the ring formula's time on 8 H100s. SGLang's own kernel measured faster in
# PR #2904 (3.7-5.9 us up to 128 KB on H100s); no engine fact says which kernel a version runs, so not modelled.
CUSTOM_ALL_REDUCE_US = {
    3: {2: ((2048, 13.0), (16384, 11.3), (131072, 12.1), (1048576, 17.6), (2097152, 22.3), (4194304, 32.5),
            (8388608, 55.3)),
        4: ((2048, 13.5), (16384, 12.1), (131072, 13.5), (1048576, 23.9), (2097152, 31.3), (4194304, 47.1)),
        8: ((2048, 14.0), (16384, 14.2))},
    4: {2: ((2048, 9.5), (16384, 8.8), (131072, 8.7), (1048576, 12.9), (2097152, 17.7), (4194304, 26.6)),
        4: ((2048, 9.1), (16384, 8.5), (131072, 9.2), (1048576, 20.6), (2097152, 26.9), (4194304, 40.2)),
        8: ((2048, 10.1), (16384, 9.3), (131072, 11.8), (1048576, 24.1), (2097152, 30.4), (4194304, 45.0))},
}


@dataclass(frozen=True)
class Pass:
    """One forward pass at 100% of the hardware: the coefficients turn it into seconds."""
    mem_s: float
    compute_s: float
    comm_s: float
    kernels: int  # kernels the pass launches
    eager: bool  # launched kernel by kernel (not replayed from a CUDA graph)
    steps: int = 1  # scheduler steps it closes (the verify pass 1; a draft pass 0: it runs inside the step)
    spec_steps: int = 0  # speculative steps it closes (the verify pass of a drafting config: 1)
    fixed_s: float = 0.0  # time that does not scale with the hardware's rates (the fused-MoE kernels' fixed part)
    light_kernels: int = 0  # of `kernels`, those that move next to no bytes: each adds its floor after the rest

    def seconds(self, c: Coefficients) -> float:
        return (max(c.mem_scale * self.mem_s, c.compute_scale * self.compute_s,
                    c.kernel_s * (self.kernels - self.light_kernels)) + c.kernel_s * self.light_kernels
                + self.comm_s + self.fixed_s + c.step_overhead_s * self.steps
                + (c.launch_s * self.kernels if self.eager else 0.0) + c.spec_step_s * self.spec_steps)


@dataclass
class SpeedEstimate:
    single_tok_s: float  # one stream
    concurrent_tok_s: float  # all streams together at `concurrency`
    per_stream_tok_s: float  # one stream's rate at `concurrency`
    concurrency: int
    batch: int  # sequences per step at that concurrency (capped by the engine and the KV pool)
    tokens_per_step: float  # E per sequence
    alpha: float | None
    step_ms: float  # at `batch`
    bound: str  # memory | compute | kernels (the per-kernel floor), of the target's pass at `batch`


# -- hardware numbers -------------------------------------------------------------------------------
def _hardware(profile, k: Knobs) -> tuple[float, float, float, float]:
    """(bandwidth B/s, peak FLOP/s, link B/s one direction, link latency s) for this config."""
    if profile is None or not profile.is_gpu:
        cores = k.threads or os.cpu_count() or 1  # the threads asked for compute; the rest idle
        return CPU_BANDWIDTH_GBPS * 1e9, CPU_GFLOPS_PER_CORE * 1e9 * cores, 0.0, 0.0
    peaks = profile.peak_tflops
    native_fp8 = k.quantization == "fp8" and profile.fp8_mode == "native"
    dtype = "fp8" if native_fp8 else {"float32": "fp32"}.get(k.dtype, "bf16")
    peak = (peaks.get(dtype) or peaks.get("bf16") or 1.0) * 1e12
    link = profile.interconnect.get("nvlink") or profile.interconnect.get("pcie") or {}
    latency = NVLINK_LATENCY_S if profile.interconnect.get("nvlink") else PCIE_LATENCY_S
    # Profiles give NVLink/PCIe bandwidth both directions together; a ring sends one way.
    return profile.memory_bandwidth_gbps * 1e9, peak, (link.get("bandwidth_gbps") or 32) * 1e9 / 2, latency


def default_coefficients(profile, engine: Engine | None = None) -> Coefficients:
    """The priors: a GPU profile's kernel_us (graph floor and eager launch per kernel) and the engine's host time
    per speculative step where its facts give one, else the CPU's."""
    if profile is None or not profile.is_gpu:
        return CPU_COEFFICIENTS
    per_kernel = getattr(profile, "kernel_us", None) or {}
    prior = Coefficients()
    host = engine.facts.spec_step_host_s if engine is not None else None
    return replace(prior, kernel_s=per_kernel.get("graph", prior.kernel_s * 1e6) * 1e-6,
                   launch_s=per_kernel.get("eager", prior.launch_s * 1e6) * 1e-6,
                   spec_step_s=prior.spec_step_s if host is None else host)


# -- passes -----------------------------------------------------------------------------------------
# A MoE layer's MLP launches the router GEMM, top-k, moe_align_block_size, the fused gate/up expert GEMM, the
# activation, the fused down GEMM and moe_sum_reduce (sglang/srt/layers/moe/fused_moe_triton/fused_moe.py,
# fused_experts_impl; vLLM's fused_moe.py alike): 7 kernels where a dense gated MLP launches 3.
MOE_EXTRA_KERNELS = 4
# A fused-MoE layer at small batch does not stream its experts like a dense GEMV: vLLM's benchmark_moe.py
# timings of the whole fused_experts call for Qwen3-30B-A3B's shape (E=128, top-8, hidden 2048, N=768, bf16:
# 75.5 MB of touched experts at batch 1), default configs, 109.21 us on an A100-PCIE-40GB (1555 GB/s,
# vllm-project/vllm PR #19049 / sgl-project/sglang PR #6825, "Before this PR", batch 1) and 39.61 us on a B200
# (8 TB/s, vllm-project/vllm PR #31448, "with default config", batch 1). Two GPUs, one line
# t = fixed + bytes / (share x bandwidth): share 0.56, fixed 22.8 us per MoE layer (routing/alignment/sum
# kernels and a grid too small to fill the GPU), used at every batch with the experts its tokens touch.
MOE_BANDWIDTH_SHARE = 0.56
MOE_FIXED_S = 22.8e-6
# Weight-only quantized GEMVs at batch 1 reach a smaller share of the bandwidth than 16-bit ones (dequantizing
# in the kernel): torchao's quantization README (pytorch/ao, torchao/quantization/README.md, Benchmarks, the
# tinygemm int4 and inductor int8 kernels gpt-fast and the embedded engine use), achieved GB/s against bf16's:
# A100-80GB Llama-2-7B int8wo 1131.18 / 1418.93 = 0.80, int4wo-64 751.42 / 1418.93 = 0.53; H100 Llama-3.1-8B
# int8wo 1495.41 / 1904.75 = 0.79, int4wo-64 1019.14 / 1904.75 = 0.54. Marlin's AWQ/GPTQ kernels stay near the
# ideal at batch 1 (MARLIN, arXiv:2408.11743: within ~5 % of the 3.87x ideal up to batch 16-32): not listed.
# Routed experts quantized the same way pay both shares, the fused-MoE kernel's times the dequantizing one's: their
# GEMVs dequantize as a dense one does (gpt-fast's mixtral-moe/quantize.py, ConditionalFeedForwardBit8:
# `self.w1.to(x.dtype)[expert_indices]`, then its scales; fused_moe's use_int8_w8a16 path in vLLM and SGLang).
WEIGHT_ONLY_BANDWIDTH_SHARE = {"int8": 0.79, "int4": 0.53}


def all_reduce_s(message: float, tp: int, profile, link: float, latency: float) -> float:
    """One all-reduce of `message` bytes over `tp` GPUs: the published custom all-reduce times where the board has
    them (interpolated; past the largest size, the ring's time for the rest), else a ring: latency plus 2(n-1)/n of
    the message over the link."""
    ring = 2 * (tp - 1) / tp / link
    nvlink = (profile.interconnect.get("nvlink") or {}) if profile is not None and profile.is_gpu else {}
    table = CUSTOM_ALL_REDUCE_US.get(nvlink.get("generation"), {}).get(tp) if nvlink.get("via") == "sxm" else None
    if table is None:
        return latency + message * ring
    sizes, times = zip(*table)
    return float(np.interp(message, sizes, times)) * 1e-6 + max(0.0, message - sizes[-1]) * ring


def make_pass(weight_bytes: float, params: float, layers: int, kv_per_token: float, attn_width: float,
              seqs: int, tokens: int, context: float, model: ModelSpec, k: Knobs, profile, eager: bool,
              moe_layers: int = 0, routed_bytes: float = 0.0, linear_bytes: float = 0.0) -> Pass:
    """`tokens` new tokens spread over `seqs` sequences of `context` cached tokens; weights/params per GPU;
    `moe_layers` of the `layers` run experts (MOE_EXTRA_KERNELS more each). On a GPU, of `weight_bytes` the
    routed experts' `routed_bytes` are read at the fused-MoE kernel's share of the bandwidth (plus its fixed
    time), and the linear layers' `linear_bytes` at a weight-only quantized GEMV's, relative to a dense
    GEMV's (Coefficients.mem_scale); weight-only quantized experts at the product of both shares."""
    bw, peak, link, latency = _hardware(profile, k)
    mem = weight_bytes + seqs * context * kv_per_token
    fixed, gpu = 0.0, profile is not None and profile.is_gpu
    if gpu:
        dense_share = 1 / Coefficients.mem_scale
        weight_only = WEIGHT_ONLY_BANDWIDTH_SHARE.get(k.quantization or "", 1.0)
        mem += linear_bytes * (1 / weight_only - 1)
        if routed_bytes:
            mem += routed_bytes * (dense_share / (MOE_BANDWIDTH_SHARE * weight_only) - 1)
            fixed = moe_layers * MOE_FIXED_S
    flops = 2 * params * tokens + 4 * layers * attn_width * context * tokens
    comm = 0.0
    if k.tp > 1:
        message = tokens * model.hidden * WEIGHT_BYTES.get(k.dtype, 2)
        comm = 2 * layers * all_reduce_s(message, k.tp, profile, link, latency)
    per_layer = k.layer_kernels or KERNELS_PER_LAYER
    kernels = layers * per_layer + moe_layers * MOE_EXTRA_KERNELS + HEAD_KERNELS
    # under a CUDA graph the light kernels' floors come after the bytes' time (the MoE layers' extra kernels are in
    # MOE_FIXED_S); eager, each kernel's launch (launch_s, longer than a floor) already runs one after another, and
    # a light kernel runs while the host launches the next; a CPU's per-op cost is calibration's
    light = layers * (per_layer - HEAVY_LAYER_KERNELS) + HEAD_KERNELS - 1 if gpu and not eager else 0
    return Pass(mem / bw, flops / peak, comm, kernels, eager, fixed_s=fixed, light_kernels=light)


def target_pass(model: ModelSpec, k: Knobs, profile, seqs: int, tokens: int, context: float, eager: bool) -> Pass:
    """A MoE model computes with its active parameters per token and reads the experts its tokens touch."""
    heads = model.attention_width * model.cache_layers / model.layers / k.tp
    weights = weights_read_bytes(model, k, tokens) + seqs * model.state_bytes_per_sequence(k.tp)  # states read once
    return make_pass(weights, model.active_params / k.tp, model.layers, kv_bytes_per_token(model, k),
                     heads, seqs, tokens, context, model, k, profile, eager, model.moe_layers,
                     routed_read_bytes(model, k, tokens), linear_read_bytes(model, k, tokens))


def draft_passes(model: ModelSpec, k: Knobs, profile, seqs: int, context: float, eager: bool,
                 draft: ModelSpec | None) -> list[Pass]:
    """The drafter's passes in one step: k sequential passes of seqs x topk tokens (EAGLE-family add one
    pass that extends the draft cache over the accepted tokens); a DFlash drafter one parallel pass over
    the block. n-gram lookup costs no GPU pass. Each pass has its own kernels (the draft's cost per step
    that a small target cannot hide behind its bytes)."""
    if k.drafter in (None, "lookup"):
        return []
    dense = WEIGHT_BYTES.get(k.dtype, 2)
    one_layer = model.layer_params / k.tp
    head = model.vocab * model.hidden / k.tp
    width = model.heads * model.head_dim / k.tp
    if k.drafter in ("eagle", "eagle3", "mtp"):
        head = EAGLE3_DRAFT_VOCAB * model.hidden / k.tp if k.drafter == "eagle3" else head
        read, computed = draft_layer_params(model, k.drafter, seqs * k.topk)
        params, layers, kv = computed / k.tp + head, 1, kv_bytes_per_token(model, k, layers=1)
        wbytes = (read / k.tp + head) * dense
    elif k.drafter == "early_exit":
        layers = k.early_exit_layers or 8
        params, kv = one_layer * layers + head, kv_bytes_per_token(model, k, layers=layers)
        wbytes = params * k.weight_bytes
    elif k.drafter == "quantized_self":
        params, layers, kv = model.params / k.tp, model.layers, kv_bytes_per_token(model, k)
        wbytes = (model.layers * model.layer_params + model.vocab * model.hidden) / k.tp
    elif k.drafter == "dflash":  # a few layers over the target's features, the target's head shared
        layers = draft.layers if draft is not None else DFLASH_ASSUMED_LAYERS
        params = dense_layer_params(model) * layers / k.tp + head
        kv = kv_bytes_per_token(model, k, layers=layers)
        wbytes = params * dense
        return [replace(make_pass(wbytes, params, layers, kv, width, seqs, seqs * k.verify_tokens, context, model,
                                  k, profile, eager), steps=0)]
    else:  # a separate draft checkpoint
        d = draft or replace(model, params=model.params * UNKNOWN_DRAFT_FRACTION,
                             layers=max(1, round(model.layers * UNKNOWN_DRAFT_FRACTION * 4)))
        params, layers, kv = d.params / k.tp, d.layers, kv_bytes_per_token(d, k)
        wbytes, width = params * dense, d.heads * d.head_dim / k.tp
    one = make_pass(wbytes, params, layers, kv, width, seqs, seqs * k.topk, context, model, k, profile, eager)
    extend = 1 if k.drafter in ("eagle", "eagle3", "mtp") else 0
    return [replace(one, steps=0)] * (k.draft_steps + extend)


def decode_step(model: ModelSpec, k: Knobs, profile, batch: int, context: float,
                draft: ModelSpec | None = None) -> list[Pass]:
    eager = not (k.cuda_graphs and batch <= (k.graph_max_bs or 0))
    verify = replace(target_pass(model, k, profile, batch, batch * k.verify_tokens, context, eager),
                     spec_steps=1 if k.drafter else 0)
    return [verify, *draft_passes(model, k, profile, batch, context, eager, draft)]


# -- the estimate -----------------------------------------------------------------------------------
def predict_speed(model: ModelSpec, config: dict, profile, num_gpus: int = 1, *, engine: Engine,
                  concurrency: int = 1, context_len: int = 1024, alpha: float | None = None,
                  draft: ModelSpec | None = None, calibration=None, max_sequences: int | None = None) -> SpeedEstimate:
    """Decode tok/s of `config` (of the engine adapter `engine`) for one stream and at `concurrency`
    streams of `context_len` cached tokens.
    `alpha` overrides the acceptance with a flat per-token rate (else the family's per-position prior, its
    first rate the calibration's where measured: acceptance.drafter_acceptance);
    `max_sequences` caps the batch (the KV pool's sequences, from predict_memory)."""
    k = engine.knobs(config, bool(profile is not None and profile.is_gpu))
    coef = calibration.coefficients if calibration is not None else default_coefficients(profile, engine)
    acc = None
    if k.drafter:
        measured = calibration.alphas.get(k.drafter) if calibration is not None else None
        acc = Acceptance.flat(alpha) if alpha is not None else drafter_acceptance(k.drafter, model.mtp_layers, measured)
    tokens = expected_tokens(acc, k) if acc is not None else 1.0
    batch = max(1, min(concurrency, k.max_running or concurrency, max_sequences or concurrency))

    def step(b: int) -> tuple[float, list[Pass]]:
        passes = decode_step(model, k, profile, b, context_len, draft)
        return sum(p.seconds(coef) for p in passes), passes

    single, _ = step(1)
    t, passes = step(batch)
    verify = passes[0]
    terms = {"memory": coef.mem_scale * verify.mem_s, "compute": coef.compute_scale * verify.compute_s,
             "kernels": coef.kernel_s * verify.kernels}
    bound = max(terms, key=terms.get)
    return SpeedEstimate(single_tok_s=tokens / single, concurrent_tok_s=batch * tokens / t, per_stream_tok_s=tokens / t,
                         concurrency=concurrency, batch=batch, tokens_per_step=tokens,
                         alpha=acc.alpha_1 if acc is not None else None, step_ms=t * 1e3, bound=bound)


def prefill_passes(model: ModelSpec, k: Knobs, profile, prompt_tokens: int) -> list[Pass]:
    """One prompt in chunks of the engine's batched-token budget (the embedded engine's prefill_ubatch)."""
    chunk = k.max_batch_tokens or prompt_tokens
    chunks = max(1, math.ceil(prompt_tokens / chunk))
    size = math.ceil(prompt_tokens / chunks)
    return [target_pass(model, k, profile, 1, size, prompt_tokens / 2, not k.cuda_graphs)] * chunks
