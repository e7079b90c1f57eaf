"""Memory per GPU: weights, draft, KV cache per token, workspace, against the engine's memory fraction.

All sizes are decimal GB (1e9 bytes), like the model cards and GPU spec sheets they are compared to.

How an engine splits a GPU (what `budget` means below) is its facts' `memory_pool`, with the
fraction the config sets (Knobs.mem_fraction) or the adapter's `default_memory_fraction(tp, gpu_mib, config)`:
- "static_fraction" (SGLang 0.5.23): the KV pool is what the weights leave of mem_fraction_static x the
  memory free before the weights load (sglang/srt/mem_cache/kv_cache_configurator.py,
  _profile_available_bytes: rest = free after loading - free before loading x (1 - mem_fraction_static));
  activations, CUDA graphs and the CUDA context live in the rest. A hybrid model's recurrent states
  take mamba_full_memory_ratio / (1 + ratio) of that pool first (_handle_max_mamba_cache).
- "utilization" (vLLM 0.33.0): gpu_memory_utilization x total memory is everything the instance may use;
  the KV cache gets what the weights, the profiled activation peak and the CUDA-graph estimate leave
  (vllm/v1/worker/gpu_worker.py, determine_available_memory), in whole blocks of block_size tokens;
  a hybrid model's states share the pool, one page per sequence and group of layers.
- "slots" (the embedded engine, llama.cpp): a KV cache of max_running x context tokens is allocated up
  front; everything must fit the fraction of a GPU, or the available host RAM on a CPU machine.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

from autotune.predict import gguf_types
from autotune.predict.knobs import WEIGHT_BYTES, Engine, Knobs
from autotune.predict.models import ModelSpec, load_model

GB = 1e9
# CUDA context, cuBLAS and NCCL workspaces outside torch's allocator, per GPU (what nvidia-smi shows
# beyond torch.cuda.memory_reserved on Hopper/Ampere: about 0.5 GB).
CUDA_CONTEXT_GB = 0.5
# CUDA graphs of the decode batch sizes: vLLM logs "Graph capturing finished ... took 0.3-0.6 GiB" for
# its default ~67 sizes on 7-8B models; SGLang's are of the same order.
CUDA_GRAPH_GB = 0.5
# Tokens in one forward pass when the config leaves it to the engine: SGLang's chunked_prefill_size
# and vLLM V1's max_num_batched_tokens for the API server on large GPUs are both 8192.
DEFAULT_BATCH_TOKENS = 8192
DEFAULT_MAX_RUNNING = 256  # sequences whose logits the sampler holds at once
MIB = 2**20
# SGLang: the state pool's share of the memory left for KV (mamba_full_memory_ratio, fallback 0.9, in
# sglang/srt/arg_groups/fields/schedule.py); with speculation each state slot also keeps one state per
# draft token for a third of the slots (MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO = 3).
SGLANG_STATE_RATIO = 0.9
SGLANG_STATE_SLOTS_PER_REQUEST = 3
# vLLM: hybrid attention blocks are a multiple of the kernel's block alignment (16 for FlashAttention:
# vllm/platforms/interface.py, update_block_size_for_backend).
VLLM_BLOCK_ALIGNMENT = 16
EAGLE3_DRAFT_VOCAB = 32000  # EAGLE-3 heads predict over a reduced vocabulary (their config: draft_vocab_size)
UNKNOWN_DRAFT_FRACTION = 1 / 16  # a separate draft checkpoint not given: assume 1/16 of the target
# A DFlash drafter's layers when the draft checkpoint is not given (its config says; a guess).
DFLASH_ASSUMED_LAYERS = 5


@dataclass
class MemoryEstimate:
    fits: bool
    weights_gb: float  # target weights per GPU
    kv_gb_per_1k_tokens: float  # target + draft cache per GPU for 1000 tokens
    workspace_gb: float  # activations + CUDA graphs + CUDA context per GPU
    kv_tokens: int  # tokens the KV pool holds once everything else is placed
    reason: str  # one line with the numbers, whether it fits or not
    draft_gb: float = 0.0
    total_gb: float = 0.0  # memory of one GPU (or available RAM)
    budget_gb: float = 0.0  # what the engine lets itself use of it
    context_len: int = 0
    detail: dict = field(default_factory=dict)
    state_sequences: int | None = None  # sequences the recurrent-state pool holds (hybrid models)

    def max_sequences(self, context_len: int | None = None) -> int:
        """Sequences of `context_len` tokens the KV pool (and a hybrid model's state pool) holds at once."""
        by_kv = self.kv_tokens // max(1, context_len or self.context_len)
        return by_kv if self.state_sequences is None else min(by_kv, self.state_sequences)

    def record(self) -> dict:
        """The numbers a pruned or launched trial keeps (rounded, JSON-ready)."""
        return {"fits": self.fits, "weights_gb": round(self.weights_gb, 3), "draft_gb": round(self.draft_gb, 3),
                "kv_gb_per_1k_tokens": round(self.kv_gb_per_1k_tokens, 4), "workspace_gb": round(self.workspace_gb, 3),
                "kv_tokens": self.kv_tokens, "budget_gb": round(self.budget_gb, 3), "total_gb": round(self.total_gb, 3),
                "reason": self.reason}


# -- pieces -----------------------------------------------------------------------------------------
def weights_bytes(model: ModelSpec, k: Knobs, on_gpu: bool = True, tokens: int | None = None) -> float:
    """Per GPU (`on_gpu` False: in a CPU machine's RAM); `tokens`: of a MoE model's routed experts only those
    a pass over that many tokens reads (None: all of them, what the GPU holds). Linear layers are sharded by
    TP (experts too: sliced by TP, or whole experts spread over EP, the same bytes per GPU) at the quantized
    width; the embedding and the output head are sharded by vocabulary (VocabParallelEmbedding /
    ParallelLMHead). An embedding the engine keeps on the host (Knobs.embedding_on_host) takes none of a
    GPU's memory, but the head it needs there does: output.weight, or a tied embedding loaded a second time
    as the output layer's tensor (llama.cpp build 11434 src/models/llama.cpp:41-46, qwen35.cpp:44-53: no
    output.weight -> token_embd with TENSOR_DUPLICATED; src/llama-model-loader.cpp:1166-1167 places it as
    LLM_TENSOR_OUTPUT, and 1371-1375 makes it a tensor of its own in the output layer's GPU buffer, or finds
    the embedding's own in the CPU buffer of a CPU run)."""
    linear, embedding, head = _weight_parts(model, k, tokens)
    if k.embedding_on_host and on_gpu:
        return (linear + (head or embedding)) / k.tp
    return (linear + embedding + head) / k.tp


def weights_read_bytes(model: ModelSpec, k: Knobs, tokens: int = 1) -> float:
    """Weight bytes one forward pass over `tokens` tokens reads per GPU: what a GPU holds (weights_bytes), on
    any device, since of an embedding on the host a pass reads one row per token (llama.cpp's GET_ROWS on the
    CPU), nothing beside the head's table (which it reads whole, tied or not); of a MoE model's routed
    experts only those the tokens are routed to (ModelSpec.routed_read_params; the slowest GPU's under EP)."""
    return weights_bytes(model, k, on_gpu=True, tokens=tokens)


def _weight_parts(model: ModelSpec, k: Knobs, tokens: int | None = None) -> tuple[float, float, float]:
    """Bytes of the linear layers (of the routed experts those `tokens` touch; None: all), the token
    embedding and the output head where it is a tensor of its own
    (untied, or the int8 copy of a tied one Knobs.quantized_head keeps; 0 where the head is the embedding).
    Embedding and head stay 16-bit under FP8/int4 (engines leave lm_head unquantized), except in a GGUF file
    (Knobs.gguf_type): there they are at the ggml types the file stores them at (Q6_K heads, ...)."""
    dense = WEIGHT_BYTES.get(k.dtype, 2)
    expert_width = linear_weight_bytes(model, k)
    other_width = dense if k.quantization is None and model.checkpoint_quant in EXPERT_ONLY_FORMATS else expert_width
    routed = model.routed_params if tokens is None else model.routed_read_params(tokens, k.ep)
    linear = (model.layers * model.layer_params - model.routed_params) * other_width + routed * expert_width
    table = model.vocab * model.hidden
    if k.gguf_type:
        embedding, head = gguf_types.stored_bytes(model.source, k.gguf_type, model.hidden, model.tied_embeddings)
    else:
        embedding = head = dense
    own_head = 0.0 if model.tied_embeddings else table * head
    if k.quantized_head and k.weight_bytes < dense and model.tied_embeddings:
        own_head = table * k.weight_bytes  # an int8 copy of the tied head
    return linear, table * embedding, own_head


def routed_read_bytes(model: ModelSpec, k: Knobs, tokens: int = 1) -> float:
    """Of weights_read_bytes, the routed experts' share per GPU (0 for a dense model): the bytes a batch-1
    fused-MoE kernel reads, priced apart by the speed model."""
    return model.routed_read_params(tokens, k.ep) * linear_weight_bytes(model, k) / k.tp


def linear_read_bytes(model: ModelSpec, k: Knobs, tokens: int = 1) -> float:
    """Of weights_read_bytes, the decoder's linear layers per GPU outside the routed experts: what a
    weight-only quantized GEMV reads."""
    linear, _, _ = _weight_parts(model, k, tokens)
    return linear / k.tp - routed_read_bytes(model, k, tokens)


# Checkpoint formats that quantize only the routed experts: gpt-oss's MXFP4 keeps attention and router in
# BF16 (its config.json quantization_config.modules_to_not_convert).
EXPERT_ONLY_FORMATS = ("mxfp4",)


def linear_weight_bytes(model: ModelSpec, k: Knobs) -> float:
    """Bytes per linear-layer weight: the config's quantization, else the checkpoint's own format (an AWQ
    checkpoint served without --quantization is read as AWQ: both engines detect it from its config)."""
    if k.quantization is None and model.checkpoint_quant in WEIGHT_BYTES:
        return WEIGHT_BYTES[model.checkpoint_quant]
    return k.weight_bytes


def kv_bytes_per_token(model: ModelSpec, k: Knobs, layers: int | None = None) -> float:
    """2 (K and V) x layers x KV heads on this GPU x head dim x bytes. KV heads shard over TP; with fewer
    KV heads than GPUs each GPU keeps one (replicated). MLA caches one latent and rope key per token and
    layer (kv_lora_rank + qk_rope_dim), whole on every GPU: SGLang's MLATokenToKVPool and vLLM's MLA
    backends keep it as a single KV head of that width (sglang/srt/mem_cache/memory_pool.py)."""
    if model.kv_lora_rank:
        return (layers or model.cache_layers) * model.kv_width * k.kv_bytes
    heads_per_gpu = math.ceil(model.kv_heads / k.tp)
    return 2 * (layers or model.cache_layers) * heads_per_gpu * model.head_dim * k.kv_bytes


def dense_layer_params(model: ModelSpec) -> float:
    """One decoder layer of a dense target; of a MoE target, a dense layer of its width (its dense
    `intermediate_size`): what an EAGLE or DFlash drafter layer is, never the average over every expert."""
    if not model.experts:
        return model.layer_params
    return model.attention_params() + model.mlp_params(False) + 2 * model.hidden


def draft_layer_params(model: ModelSpec, drafter: str, tokens: int) -> tuple[float, float]:
    """(parameters read, parameters computed per token) of an EAGLE head's or MTP module's one layer: a dense
    layer (dense_layer_params), except a MoE target's MTP module, a MoE layer (DeepSeek-V3's "11.5B unique
    parameters" are mostly experts) that reads only the experts its `tokens` touch."""
    if not model.experts or drafter != "mtp" or not model.mtp_layers:
        dense = dense_layer_params(model)
        return dense, dense
    module = model.mtp_params / model.mtp_layers
    touched = model.routed_read_params(tokens) / model.moe_layers
    return (module - model.experts * model.expert_params + touched,
            module - (model.experts - model.experts_per_token) * model.expert_params)


def draft_bytes(model: ModelSpec, k: Knobs, draft: ModelSpec | None, on_gpu: bool = True) -> tuple[float, float, str]:
    """(weights per GPU, KV bytes per token per GPU, what was assumed) of the drafter."""
    dense = WEIGHT_BYTES.get(k.dtype, 2)
    layer = dense_layer_params(model) * dense / k.tp
    one_layer_kv = kv_bytes_per_token(model, k, layers=1)
    if k.drafter == "dflash":  # its own layers over the target's features; embedding and head shared with the target
        layers = draft.layers if draft is not None else DFLASH_ASSUMED_LAYERS
        return (layer * layers, one_layer_kv * layers,
                f"DFlash drafter: {layers} layers" + ("" if draft is not None else " (assumed)"))
    if k.drafter == "eagle":  # one decoder layer + fc(2h -> h); embedding and head shared with the target
        return layer + 2 * model.hidden**2 * dense / k.tp, one_layer_kv, "EAGLE head: 1 layer"
    if k.drafter == "eagle3":  # + fc(3h -> h) and its own reduced-vocab head
        extra = (3 * model.hidden**2 + EAGLE3_DRAFT_VOCAB * model.hidden) * dense / k.tp
        return layer + extra, one_layer_kv, "EAGLE-3 head: 1 layer + 32k-vocab head"
    if k.drafter == "mtp":  # the checkpoint's MTP module, held whole (a MoE model's: every expert)
        module = model.mtp_params / model.mtp_layers if model.mtp_layers else model.layer_params + 2 * model.hidden**2
        return module * dense / k.tp, one_layer_kv, "MTP: 1 layer"
    if k.drafter == "quantized_self":  # an int8 copy of every linear layer and the head
        return (model.layers * model.layer_params + model.vocab * model.hidden) / k.tp, 0.0, "int8 copy of the target"
    if k.drafter == "draft":
        if draft is None:
            guess = model.params * UNKNOWN_DRAFT_FRACTION * dense / k.tp
            return guess, kv_bytes_per_token(model, k) * UNKNOWN_DRAFT_FRACTION, "draft checkpoint unknown: 1/16 of the target"
        dk = replace(k, weight_bytes=dense, gguf_type=None)  # the draft file's types are not known here
        return weights_bytes(draft, dk, on_gpu), kv_bytes_per_token(draft, dk), f"draft {draft.name}"
    return 0.0, 0.0, ""  # none, n-gram lookup, early exit (the target's own layers)


def workspace_bytes(model: ModelSpec, k: Knobs) -> float:
    """Per GPU: the activations of the largest forward pass (hidden states, q/k/v, the MLP's gate+up
    at the engine's batched-token budget), fp32 logits of the running sequences, CUDA graphs, context."""
    tokens = k.max_batch_tokens or DEFAULT_BATCH_TOKENS
    act = WEIGHT_BYTES.get(k.dtype, 2)
    per_token = 4 * model.hidden + (2 * model.intermediate + (model.heads + 2 * model.kv_heads) * model.head_dim) / k.tp
    logits = (k.max_running or DEFAULT_MAX_RUNNING) * k.verify_tokens * model.vocab * 4
    graphs = CUDA_GRAPH_GB * GB if k.cuda_graphs else 0.0
    context = CUDA_CONTEXT_GB * GB if k.cuda_context else 0.0
    return tokens * per_token * act + logits + graphs + context


def slot_tokens(model: ModelSpec, k: Knobs, context_len: int) -> int:
    """Tokens of KV one slot of a "slots" engine is allocated: what the config sets (Knobs.slot_tokens), the
    model's training context where the engine takes that (slot_tokens 0) and the model says, else `context_len`."""
    if k.slot_tokens == 0:
        return model.max_context or context_len
    return k.slot_tokens or context_len


def gpu_memory_gb(profile) -> float:
    """A profile's memory in GB. Spec sheets say "80GB" for 80 GiB (the driver reports 81559 MiB on an
    H100, 143771 MiB on an H200; profiles match on memory_gib), so the number is read as GiB."""
    return float(profile.memory_gb) * 2**30 / GB


def _available_ram_gb() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / GB
    except OSError:
        pass
    return float("inf")


# -- the estimate -----------------------------------------------------------------------------------
def predict_memory(model: ModelSpec, config: dict, profile, num_gpus: int = 1, *, engine: Engine,
                   draft: ModelSpec | None = None, context_len: int | None = None) -> MemoryEstimate:
    """Does `config` (of the engine adapter `engine`) fit on `num_gpus` GPUs of `profile` (a hardware
    Profile; a CPU profile = host RAM), and how many KV tokens are left? `context_len`: the longest
    sequence it must hold (default: the engine facts' default_context_len)."""
    on_gpu = bool(profile is not None and profile.is_gpu)
    k = engine.knobs(config, on_gpu)
    context_len = context_len or engine.facts.default_context_len
    total = gpu_memory_gb(profile) if on_gpu else _available_ram_gb()
    fraction = k.mem_fraction or engine.default_memory_fraction(k.tp, total * GB / MIB if on_gpu else None, config)
    if on_gpu and k.max_batch_tokens is None:  # the chunk the engine picks for this GPU
        k = replace(k, max_batch_tokens=engine.default_batch_tokens(total * GB / MIB, k.tp))
    w = weights_bytes(model, k, on_gpu)
    dw, dkv, draft_note = draft_bytes(model, k, draft, on_gpu)
    kv_tok = kv_bytes_per_token(model, k) + dkv
    state = model.state_bytes_per_sequence(k.tp)
    ws = workspace_bytes(model, k)
    detail = {"weights": w / GB, "draft": dw / GB, "workspace": ws / GB}
    problems = []
    sequences = None  # what the state pool caps (hybrid models), else the KV pool alone
    if k.tp > max(1, num_gpus):
        problems.append(f"tp {k.tp} needs {k.tp} GPUs, {num_gpus} given")
    if engine.facts.memory_pool == "slots":
        budget = total * (fraction if on_gpu else 1.0)
        slots, per_slot = k.max_running or 4, slot_tokens(model, k, context_len)
        detail["kv cache"] = slots * (per_slot * kv_tok + state) / GB
        kv_tokens = slots * per_slot if sum(detail.values()) <= budget else 0
    else:
        if engine.facts.memory_pool == "static_fraction":
            before_load = (total - (CUDA_CONTEXT_GB if k.cuda_context else 0.0)) * GB
            pool = fraction * before_load - w - dw
            if ws > (1 - fraction) * total * GB:
                problems.append(f"workspace {ws / GB:.2f} GB exceeds the {(1 - fraction) * total:.2f} GB that "
                                f"mem_fraction_static {fraction:.2f} leaves outside the static pool")
            kv_tokens, sequences, state_gb = _static_fraction_pool(pool, kv_tok, state, k)
        elif engine.facts.memory_pool == "utilization":
            pool = fraction * total * GB - w - dw - ws
            if k.kv_cache_bytes:  # set outright: the fraction no longer applies; it all must fit the memory
                pool, fraction = k.kv_cache_bytes, 1.0
                if w + dw + ws + pool > total * GB:
                    problems.append(f"weights, workspace and the {pool / GB:.2f} GB KV cache it sets need "
                                    f"{(w + dw + ws + pool) / GB:.2f} GB")
            kv_tokens, sequences, state_gb = _utilization_pool(pool, kv_tok, state, k, model, context_len)
        else:
            raise ValueError(f"the {engine.name} adapter's memory_pool {engine.facts.memory_pool!r} is not one of "
                             "static_fraction, utilization, slots")
        budget = fraction * total
        detail["kv cache"] = kv_tokens * kv_tok / GB
        if state_gb:
            detail["recurrent state"] = state_gb
        if pool <= 0:
            problems.insert(0, f"weights alone take {(w + dw) / GB:.2f} GB of the {budget:.2f} GB usable per GPU")
        elif kv_tokens < context_len or sequences == 0:
            problems.append(f"KV cache holds {kv_tokens} tokens, below one {context_len}-token sequence")
    if engine.facts.memory_pool == "slots" and sum(detail.values()) > budget:
        problems.append(f"needs {sum(detail.values()):.2f} GB with a {slots} x {per_slot}-token slot cache "
                        f"of {detail['kv cache']:.2f} GB")
    parts = f"weights {w / GB:.2f} GB" + (f" + draft {dw / GB:.2f} GB ({draft_note})" if dw else "")
    if k.embedding_on_host and on_gpu:
        parts += f" (token embedding {_weight_parts(model, k)[1] / GB:.2f} GB in host memory)"
    parts += f", workspace {ws / GB:.2f} GB, KV {kv_tok * 1000 / GB:.3f} GB per 1k tokens"
    parts += f", state {state / GB:.3f} GB per sequence" if state else ""
    where = f"{budget:.2f} GB usable of {total:.2f} GB" + (" per GPU" if on_gpu else " RAM")
    if problems:
        reason = f"does not fit: {'; '.join(problems)} ({parts}; {where}, tp {k.tp})"
    else:
        seqs = kv_tokens // context_len if sequences is None else min(kv_tokens // context_len, sequences)
        reason = f"fits: {kv_tokens} KV tokens = {seqs} sequences of {context_len} ({parts}; {where})"
    return MemoryEstimate(fits=not problems, weights_gb=w / GB, kv_gb_per_1k_tokens=kv_tok * 1000 / GB,
                          workspace_gb=ws / GB, kv_tokens=kv_tokens, reason=reason, draft_gb=dw / GB, total_gb=total,
                          budget_gb=budget, context_len=context_len, detail=detail, state_sequences=sequences)


def _static_fraction_pool(pool: float, kv_tok: float, state: float, k: Knobs) -> tuple[int, int | None, float]:
    """(KV tokens, state slots, state GB) of a "static_fraction" pool of `pool` bytes, as SGLang splits it.
    Hybrid models: the state pool gets ratio / (1 + ratio) of it; K = slots solved as in _handle_max_mamba_cache
    (one padding slot; with speculation each slot also holds D draft states for 1/3 of the slots, and
    D x (running + 1) intermediate states are reserved)."""
    if pool <= 0:
        return 0, None, 0.0
    if not state:
        return int(pool // kv_tok), None, 0.0
    budget = pool * SGLANG_STATE_RATIO / (1 + SGLANG_STATE_RATIO)
    if k.drafter:
        d = k.verify_tokens
        slots = int((budget - state * (1 + d)) // (state * (1 + d / SGLANG_STATE_SLOTS_PER_REQUEST)))
        running = min(k.max_running or DEFAULT_MAX_RUNNING, slots // SGLANG_STATE_SLOTS_PER_REQUEST)
        used = state * (running + 1) * d + (slots + 1) * state
    else:
        slots = int((budget - state) // state)
        used = (slots + 1) * state
    return max(0, int((pool - used) // kv_tok)), max(0, slots), used / GB


def _utilization_pool(pool: float, kv_tok: float, state: float, k: Knobs, model: ModelSpec,
                      context_len: int) -> tuple[int, int | None, float]:
    """(KV tokens, sequences, state GB) of a "utilization" pool of `pool` bytes, as vLLM splits it: whole
    blocks of block_size tokens (vllm/v1/core/kv_cache_utils.py: num_blocks = available // page size of all
    layers). A hybrid model: attention blocks grow to a multiple of 16 tokens whose page holds one layer's state
    (update_block_size_for_backend), layers form groups of equal size, and a sequence takes
    ceil(context / block) blocks of each attention group plus one block of each state group."""
    block = k.block_size or 16
    if pool <= 0:
        return 0, None, 0.0
    if not state:
        blocks = int(pool // (block * kv_tok))
        return blocks * block, None, 0.0
    attn_layers, state_layers = model.cache_layers, model.linear_layers
    per_layer_token, per_layer_state = kv_tok / attn_layers, state / state_layers
    align = max(VLLM_BLOCK_ALIGNMENT, block)
    block = align * math.ceil(per_layer_state / (align * per_layer_token))
    group = math.gcd(attn_layers, state_layers)
    page = block * per_layer_token * group  # bytes of one block of one group
    per_sequence = (attn_layers // group) * math.ceil(context_len / block) + state_layers // group
    sequences = int(pool // page) // per_sequence
    return sequences * context_len, sequences, sequences * (state_layers // group) * page / GB


# -- on a probed machine, the way the tuner holds the model -------------------------------------------
def as_model(model) -> ModelSpec | None:
    """A ModelSpec from a ModelSpec, a preset name, a path, or constraints.ModelShape (its shapes only:
    hidden = heads x head_dim, vocabulary unknown, so every parameter counts as a layer weight)."""
    if model is None or isinstance(model, ModelSpec):
        return model
    if isinstance(model, (str, Path)):
        return load_model(model)
    hidden = model.n_heads * model.head_dim
    return ModelSpec(name="model", layers=model.n_layers, hidden=hidden, heads=model.n_heads, kv_heads=model.n_kv_heads,
                     head_dim=model.head_dim, intermediate=4 * hidden, vocab=0, params=float(model.n_params),
                     tied_embeddings=True)


def estimate_memory(config: dict, hw, model, draft_model=None, max_seq_len: int | None = None, *,
                    engine: Engine) -> MemoryEstimate | None:
    """predict_memory on a probed Hardware (`hw`; None = a CPU machine) with the model as a ModelSpec,
    preset, path or constraints.ModelShape; None when the model is unknown."""
    spec = as_model(model)
    if spec is None:
        return None
    gpus = int(getattr(hw, "gpu_count", 0) or 0)
    profile = getattr(hw, "profile", None) if gpus else None
    if gpus and profile is None:  # a GPU no profile matched: its measured memory is all we need here
        profile = SimpleNamespace(is_gpu=True, memory_gb=hw.gpus[0].memory_gb or 0)
    return predict_memory(spec, config, profile, gpus, engine=engine, draft=as_model(draft_model),
                          context_len=max_seq_len)
