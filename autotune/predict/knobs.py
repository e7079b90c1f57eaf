"""One engine-neutral reading of a configuration (SGLang, vLLM or embedded option names) for the model."""
from __future__ import annotations

from dataclasses import dataclass

# Bytes per weight of the decoder's linear layers. 4-bit formats carry an fp16 scale (and zero) per
# group of 128 weights: 0.5 + 4/128 bytes. FP8/int8 per-channel scales are negligible.
WEIGHT_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2, "auto": 2,
                "fp8": 1, "w8a16_fp8": 1, "int8": 1, "w8a8_int8": 1, "awq": 0.53125, "gptq": 0.53125,
                "int4": 0.53125, "awq_marlin": 0.53125, "gptq_marlin": 0.53125,
                "gguf": 0.625}  # the embedded engine running a Q4_1 GGUF's blocks: 20 bytes per 32 weights
# Drafters by family: eagle = a one-layer head on the target's features; mtp = the target's own extra
# layer; draft = a separate small checkpoint; lookup = n-gram matching in the prompt (no model);
# early_exit / quantized_self = the embedded engine's self-drafters.
FAMILIES = {"EAGLE": "eagle", "EAGLE3": "eagle3", "NEXTN": "mtp", "STANDALONE": "draft", "NGRAM": "lookup",
            "DFLASH": "draft", "eagle": "eagle", "eagle3": "eagle3", "mtp": "mtp", "draft_model": "draft",
            "ngram": "lookup", "early_exit": "early_exit", "quantized_self": "quantized_self"}


@dataclass(frozen=True)
class Knobs:
    engine: str
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
    graph_max_bs: int | None  # largest batch replayed from a CUDA graph
    mem_fraction: float | None  # SGLang mem_fraction_static / vLLM gpu_memory_utilization
    max_running: int | None  # concurrent sequences the engine admits
    max_batch_tokens: int | None  # prefill chunk / batched-token budget
    early_exit_layers: int | None


def read_knobs(config: dict, engine: str, on_gpu: bool = True) -> Knobs:
    c = {k: v for k, v in config.items() if v is not None and v != "none"}
    tp = int(c.get("tp_size") or c.get("tensor_parallel_size") or 1)
    dtype = str(c.get("dtype", "bfloat16" if on_gpu else "float32"))
    quant = c.get("quantization")
    weight_bytes = WEIGHT_BYTES.get(str(quant).lower(), 1) if quant else WEIGHT_BYTES.get(dtype, 2)
    kv = str(c.get("kv_cache_dtype", "auto"))
    kv_bytes = 1 if "fp8" in kv else WEIGHT_BYTES.get(dtype if kv == "auto" else kv, 2)
    algo = c.get("speculative_algorithm") or c.get("speculative_method") or c.get("drafter")
    drafter = FAMILIES.get(algo)
    steps, topk, verify = 0, 1, 1
    if engine == "sglang" and drafter:
        steps = int(c.get("speculative_num_steps", 3))
        topk = int(c.get("speculative_eagle_topk", 1))
        tokens = c.get("speculative_num_draft_tokens", 12 if drafter == "lookup" else steps + 1)
        verify = steps + 1 if topk == 1 and drafter != "lookup" else int(tokens)  # SGLang's own rewrite
        if drafter == "lookup":
            steps = verify - 1
    elif engine == "vllm" and drafter:
        steps = int(c.get("num_speculative_tokens", 3))
        verify = steps + 1
    elif drafter:  # embedded
        steps = int(c.get("draft_length", 4))
        verify = steps + 1
    if engine == "sglang":
        graphs = True  # on unless --disable-cuda-graph, which the space does not offer
        bs = c.get("cuda_graph_bs_decode")
        graph_max = max(bs) if bs else c.get("cuda_graph_max_bs_decode")
        fraction, running, chunk = c.get("mem_fraction_static"), c.get("max_running_requests"), c.get("chunked_prefill_size")
    elif engine == "vllm":
        graphs = not c.get("enforce_eager", False)
        sizes = c.get("cudagraph_capture_sizes")
        graph_max = max(sizes) if sizes else c.get("max_cudagraph_capture_size")
        fraction, running, chunk = c.get("gpu_memory_utilization"), c.get("max_num_seqs"), c.get("max_num_batched_tokens")
    else:
        sizes = c.get("cuda_graph_batch_sizes") or []
        graphs, graph_max = bool(sizes) and on_gpu, (max(sizes) if sizes else None)
        fraction, running, chunk = None, c.get("verify_slots", 4), c.get("prefill_ubatch", 256)
    return Knobs(engine, tp, dtype, weight_bytes, quant, kv_bytes, drafter, steps if drafter else 0, topk,
                 verify if drafter else 1, graphs, graph_max, fraction, running,
                 chunk if chunk and chunk > 0 else None, c.get("early_exit_layers", 8) if drafter == "early_exit" else None)
