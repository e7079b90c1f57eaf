"""What the predictor needs to know about a model: its shapes, from a preset, an HF config.json or GGUF metadata
(what a draft checkpoint is: autotune/predict/drafts.py)."""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from autotune import package_path

PRESETS_FILE = package_path("data", "model_presets.yaml")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    params: float  # total parameters of the checkpoint
    tied_embeddings: bool
    kv_layers: int | None = None  # layers holding a per-token KV cache (None: all)
    source: str = ""
    # tokens the checkpoint was trained for (config.json max_position_embeddings, GGUF <arch>.context_length):
    # what llama-server allocates a slot without --ctx-size (None: not read; presets leave it)
    max_context: int | None = None
    # Extra next-token layers the checkpoint carries (DeepSeek-V3 `num_nextn_predict_layers`, Qwen3.5 /
    # Qwen3-Next `mtp_num_hidden_layers`): what SGLang's NEXTN and vLLM's `mtp` draft with.
    mtp_layers: int = 0
    # Hybrid linear-attention layers (Gated DeltaNet): a fixed state per sequence instead of a KV cache.
    # Shapes as in the config (linear_num_key_heads ...); the state is v_heads x k_dim x v_dim in
    # `state_bytes` (mamba_ssm_dtype, float32 by default) plus a conv window of (conv_kernel - 1) x
    # (2 x k_heads x k_dim + v_heads x v_dim) in 16 bit (sglang/srt/configs/mamba_utils.py).
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    linear_conv_kernel: int = 4
    state_bytes: int = 4
    # The checkpoint's own weight format (its quantization_config.quant_method: awq, gptq, fp8 ...;
    # None: 16-bit weights, or a preset that stands for every published variant).
    checkpoint_quant: str | None = None
    architecture: str = ""
    # Mixture of experts (0 experts: a dense model). A MoE layer holds `experts` routed experts and
    # `shared_experts` always-on ones, each a gated MLP (gate, up, down: 3 x hidden x width) of width
    # `moe_intermediate` (`shared_intermediate` for the shared ones; 0: the same), plus a router
    # (hidden x experts); a token runs `experts_per_token` routed experts. `dense_layers` of the `layers`
    # keep a dense MLP of width `intermediate` (DeepSeek-V3 first_k_dense_replace, Qwen3-MoE mlp_only_layers).
    experts: int = 0
    experts_per_token: int = 0
    shared_experts: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0
    dense_layers: int = 0
    # Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2; arXiv:2405.04434 section 2.1): K and V come from
    # one latent of kv_lora_rank per token, cached with the decoupled rope key (qk_rope_dim); q through a
    # q_lora_rank latent (0: a full projection). head_dim is qk_nope + qk_rope, v_head_dim the value's.
    kv_lora_rank: int = 0
    qk_rope_dim: int = 0
    q_lora_rank: int = 0
    v_head_dim: int = 0

    @property
    def cache_layers(self) -> int:
        return self.kv_layers or self.layers

    @property
    def linear_layers(self) -> int:
        """Layers that keep a recurrent state instead of a KV cache."""
        return self.layers - self.cache_layers if self.linear_v_heads else 0

    def state_bytes_per_sequence(self, tp: int = 1) -> float:
        """Recurrent state of one sequence on one GPU (heads shard over TP)."""
        if not self.linear_layers:
            return 0.0
        v_heads, k_heads = -(-self.linear_v_heads // tp), -(-self.linear_k_heads // tp)
        temporal = v_heads * self.linear_k_dim * self.linear_v_dim * self.state_bytes
        conv = (self.linear_conv_kernel - 1) * (2 * k_heads * self.linear_k_dim + v_heads * self.linear_v_dim) * 2
        return float(self.linear_layers * (temporal + conv))

    @property
    def embedding_params(self) -> float:
        """Token embedding plus, when untied, the output head (vocab x hidden each)."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def layer_params(self) -> float:
        """Parameters of one decoder layer, on average over dense and MoE layers (every expert counted;
        the linear layers; norms are negligible)."""
        return (self.params - self.embedding_params) / self.layers

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.experts else 0

    @property
    def expert_params(self) -> float:
        """One routed expert: a gated MLP (gate and up hidden -> width, down width -> hidden)."""
        return 3 * self.hidden * self.moe_intermediate

    @property
    def routed_params(self) -> float:
        """Every routed expert of every MoE layer: what a token reads only experts_per_token of."""
        return self.moe_layers * self.experts * self.expert_params

    @property
    def active_params(self) -> float:
        """Parameters one token runs through (the compute per token): the routed experts it is sent to."""
        return self.params - self.moe_layers * (self.experts - self.experts_per_token) * self.expert_params

    def routed_read_params(self, tokens: int, ep: int = 1) -> float:
        """Routed-expert parameters a pass over `tokens` tokens reads, times `ep`: the experts their
        routings touch, E (1 - (1 - k/E)^tokens) per MoE layer for uniform routing (each expert touched
        with that probability). With expert parallelism (ep > 1) each of ep GPU groups holds E/ep whole
        experts and the pass waits for the group that touched the most: the expected maximum of ep such
        counts, times ep so that dividing by the GPU count gives the slowest GPU's share (ep 1: the mean)."""
        if not self.experts:
            return 0.0
        touched = 1 - (1 - self.experts_per_token / self.experts) ** max(1, tokens)
        per_group = -(-self.experts // max(1, ep))  # a GPU group holds at most this many experts
        return self.moe_layers * ep * _expected_max_binomial(per_group, touched, ep) * self.expert_params

    def attention_params(self) -> float:
        """One layer's attention projections: q, k, v, o (GQA), or MLA's latent projections."""
        if not self.kv_lora_rank:
            return 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_heads * self.head_dim
        q_width = self.heads * self.head_dim
        q = self.hidden * self.q_lora_rank + self.q_lora_rank * q_width if self.q_lora_rank else self.hidden * q_width
        kv_down = self.hidden * (self.kv_lora_rank + self.qk_rope_dim)
        kv_up = self.kv_lora_rank * self.heads * (self.head_dim - self.qk_rope_dim + self.v_head_dim)
        return q + kv_down + kv_up + self.heads * self.v_head_dim * self.hidden

    def mlp_params(self, moe: bool) -> float:
        """One layer's MLP: a dense gated MLP, or the experts (routed and shared) and the router."""
        if not moe:
            return 3 * self.hidden * self.intermediate
        shared = self.shared_experts * 3 * self.hidden * (self.shared_intermediate or self.moe_intermediate)
        return self.experts * self.expert_params + shared + self.hidden * self.experts

    def computed_params(self) -> float:
        """Parameters implied by the shapes (attention + gated MLP or experts + embeddings + norms), the
        MTP layers left out (the engines load them only as the drafter: mtp_params)."""
        per_layer = self.attention_params() + 2 * self.hidden
        mlps = self.moe_layers * self.mlp_params(True) + (self.layers - self.moe_layers) * self.mlp_params(False)
        return self.layers * per_layer + mlps + self.embedding_params + self.hidden

    @property
    def mtp_params(self) -> float:
        """The MTP modules beside the decoder: each one decoder layer (a MoE layer in a MoE model) plus the
        projection of [embedding; hidden] (2h -> h) and its norms; embedding and head shared with the model
        (DeepSeek-V3 README_WEIGHTS.md: "11.5B unique parameters" for its one module)."""
        layer = self.attention_params() + self.mlp_params(bool(self.experts)) + 2 * self.hidden
        return self.mtp_layers * (layer + 2 * self.hidden**2 + 3 * self.hidden)

    @property
    def kv_width(self) -> int:
        """Cached elements per token and layer across all KV heads: K and V per head, or MLA's latent and
        rope key (one copy for every head: DeepSeek-V2 Table 1, (d_c + d_h^R) per layer)."""
        if self.kv_lora_rank:
            return self.kv_lora_rank + self.qk_rope_dim
        return 2 * self.kv_heads * self.head_dim

    @property
    def attention_width(self) -> float:
        """Per head summed over heads, half the multiply-adds per cached token of q.k plus p.v: heads x
        head_dim; with MLA's absorbed decode (scores over latent + rope, values in the latent) heads x
        (2 kv_lora_rank + qk_rope) / 2."""
        if self.kv_lora_rank:
            return self.heads * (2 * self.kv_lora_rank + self.qk_rope_dim) / 2
        return float(self.heads * self.head_dim)


@functools.cache
def _expected_max_binomial(n: int, p: float, groups: int) -> float:
    """E[max of `groups` independent Binomial(n, p)]: sum over m of P(max >= m) = 1 - F(m - 1)^groups."""
    if groups <= 1:
        return n * p
    cdf, total = 0.0, 0.0
    for m in range(1, n + 1):
        cdf += math.comb(n, m - 1) * p ** (m - 1) * (1 - p) ** (n - m + 1)
        total += 1 - min(1.0, cdf) ** groups
    return total


@functools.cache
def presets() -> dict[str, ModelSpec]:
    data = yaml.safe_load(PRESETS_FILE.read_text())
    return {name: ModelSpec(name=name, **{k: (float(v) if k == "params" else v) for k, v in spec.items()})
            for name, spec in data.items()}


def load_model(name_or_path: str | Path | None) -> ModelSpec:
    """A preset name (case-insensitive), an HF checkpoint directory, a config.json, a .gguf file or a
    directory of them; None is the bundled SmolLM2-135M GGUF. Raises ValueError (one line) for anything else."""
    if name_or_path is None:
        from autotune.embedded.bundled import bundled_gguf_path

        name_or_path = bundled_gguf_path()
    key = str(name_or_path).strip().lower()
    if key in presets():
        return presets()[key]
    path = Path(name_or_path)
    if path.is_dir() and not (path / "config.json").is_file():
        for file in sorted(path.glob("*.gguf")):  # one model's GGUF files (llama.cpp's gguf_type): shapes alike
            try:
                return _from_gguf(file)
            except ValueError:  # a vision projector or a later part of a split model
                continue
    if path.suffix == ".gguf" and path.is_file():
        return _from_gguf(path)
    config = path / "config.json" if path.is_dir() else path
    if config.name.endswith(".json") and config.is_file():
        return _from_hf_config(config)
    from autotune.embedded.bundled import DOWNLOAD_A_MODEL

    raise ValueError(f"unknown model {str(name_or_path)!r}: not a preset ({', '.join(presets())}), "
                     f"an HF checkpoint directory, a .gguf file or a directory of them; {DOWNLOAD_A_MODEL}")


def _from_hf_config(file: Path) -> ModelSpec:
    try:
        top = json.loads(file.read_text())
        c = top.get("text_config", top)  # multimodal checkpoints nest the language model's config
        heads, hidden = int(c["num_attention_heads"]), int(c["hidden_size"])
        layers = int(c["num_hidden_layers"])
        kv_layers = _attention_layers(c, layers)
        spec = {"name": file.parent.name, "layers": layers, "hidden": hidden, "heads": heads,
                "kv_heads": int(c.get("num_key_value_heads") or heads),
                "head_dim": int(c.get("head_dim") or hidden // heads), "intermediate": int(c["intermediate_size"]),
                "vocab": int(c["vocab_size"]), "params": 0.0, "tied_embeddings": bool(c.get("tie_word_embeddings", False)),
                "kv_layers": kv_layers or None, "source": str(file),
                "max_context": int(c["max_position_embeddings"]) if c.get("max_position_embeddings") else None,
                "mtp_layers": int(c.get("num_nextn_predict_layers") or c.get("mtp_num_hidden_layers") or 0),
                "linear_k_heads": int(c.get("linear_num_key_heads") or 0),
                "linear_v_heads": int(c.get("linear_num_value_heads") or 0),
                "linear_k_dim": int(c.get("linear_key_head_dim") or 0),
                "linear_v_dim": int(c.get("linear_value_head_dim") or 0),
                "linear_conv_kernel": int(c.get("linear_conv_kernel_dim") or 4),
                "state_bytes": 2 if c.get("mamba_ssm_dtype") in ("bfloat16", "float16") else 4,
                "checkpoint_quant": _quant_method(top), "architecture": (top.get("architectures") or [""])[0],
                **_moe_fields(c, layers), **_mla_fields(c)}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{file}: not a usable model config ({type(e).__name__}: {e})") from None
    model = ModelSpec(**spec)
    # the index counts bytes: parameters only for 16-bit weights (an FP8 or MXFP4 checkpoint is not)
    total = None if model.checkpoint_quant else _safetensors_params(file.parent)
    return ModelSpec(**{**spec, "params": total or model.computed_params()})


def _moe_fields(c: dict, layers: int) -> dict:
    """Experts and which layers are MoE, in each family's keys. A layer is dense when it is one of
    `mlp_only_layers` or not every `decoder_sparse_step`-th (transformers modeling_qwen3_moe.py,
    Qwen3MoeDecoderLayer), or below `first_k_dense_replace` or not every `moe_layer_freq`-th (DeepSeek-V3's
    modeling_deepseek.py, DeepseekV3DecoderLayer; GLM-4.5's Glm4MoeDecoderLayer)."""
    experts = int(c.get("num_experts") or c.get("n_routed_experts") or c.get("num_local_experts") or 0)
    if not experts:
        return {}
    step, freq = int(c.get("decoder_sparse_step") or 1), int(c.get("moe_layer_freq") or 1)
    first, dense_only = int(c.get("first_k_dense_replace") or 0), set(c.get("mlp_only_layers") or [])
    moe = sum(i not in dense_only and (i + 1) % step == 0 and i >= first and i % freq == 0 for i in range(layers))
    shared_width = int(c.get("shared_expert_intermediate_size") or 0)  # Qwen2-MoE / Qwen3-Next: one shared expert
    return {"experts": experts,
            "experts_per_token": int(c.get("num_experts_per_tok") or c.get("experts_per_token") or 0),  # gpt-oss: both
            "shared_experts": int(c.get("n_shared_experts") or (1 if shared_width else 0)),
            # Mixtral and gpt-oss have no moe_intermediate_size: their intermediate_size is the expert's
            "moe_intermediate": int(c.get("moe_intermediate_size") or c["intermediate_size"]),
            "shared_intermediate": shared_width, "dense_layers": layers - moe}


def _mla_fields(c: dict) -> dict:
    """Multi-head latent attention's shapes (DeepseekV3Config's keys; head_dim = qk_nope + qk_rope)."""
    if not c.get("kv_lora_rank"):
        return {}
    rope = int(c["qk_rope_head_dim"])
    return {"kv_lora_rank": int(c["kv_lora_rank"]), "qk_rope_dim": rope, "q_lora_rank": int(c.get("q_lora_rank") or 0),
            "v_head_dim": int(c["v_head_dim"]), "head_dim": int(c["qk_nope_head_dim"]) + rope}


def _attention_layers(c: dict, layers: int) -> int | None:
    """Full-attention layers of a hybrid model: its `layer_types`, or every `full_attention_interval`-th
    layer (Qwen3-Next); None when every layer is attention."""
    if "layer_types" in c:
        return sum(t == "full_attention" for t in c["layer_types"])
    if c.get("full_attention_interval") and c.get("linear_num_value_heads"):
        return layers // int(c["full_attention_interval"])
    return None


def _quant_method(config: dict) -> str | None:
    q = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    return (str(q.get("quant_method") or "").lower() or None) if isinstance(q, dict) else None


def _safetensors_params(directory: Path) -> float | None:
    """The checkpoint's own parameter count where its index says so (total_size is bytes: bf16 assumed)."""
    index = directory / "model.safetensors.index.json"
    try:
        return json.loads(index.read_text())["metadata"]["total_size"] / 2
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _from_gguf(file: Path) -> ModelSpec:
    """From the GGUF header (read_header keeps it per file version, in memory and on disk)."""
    from autotune.embedded.gguf_header import read_header

    header = read_header(file)  # ValueError naming the file for junk
    meta = header.meta
    try:
        arch = meta["general.architecture"]
        heads, hidden = int(meta[f"{arch}.attention.head_count"]), int(meta[f"{arch}.embedding_length"])
        names = {t.name for t in header.tensors}
        vocab = meta.get(f"{arch}.vocab_size") or next(int(t.shape[1]) for t in header.tensors if t.name == "token_embd.weight")
        layers = int(meta[f"{arch}.block_count"])
        # MoE and MLA keys as llama.cpp's convert_hf_to_gguf.py writes them (gguf-py constants.py, Keys.LLM)
        experts = int(meta.get(f"{arch}.expert_count") or 0)
        expert_width = int(meta.get(f"{arch}.expert_feed_forward_length") or 0)
        kv_lora = int(meta.get(f"{arch}.attention.kv_lora_rank") or 0)
        return ModelSpec(
            name=file.stem, layers=layers, hidden=hidden, heads=heads,
            kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
            head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
            intermediate=int(meta.get(f"{arch}.feed_forward_length") or expert_width), vocab=int(vocab),
            params=float(sum(int(t.n_elements) for t in header.tensors)),
            tied_embeddings="output.weight" not in names, source=str(file),
            max_context=int(meta[f"{arch}.context_length"]) if meta.get(f"{arch}.context_length") else None,
            experts=experts, experts_per_token=int(meta.get(f"{arch}.expert_used_count") or 0),
            shared_experts=int(meta.get(f"{arch}.expert_shared_count") or 0), moe_intermediate=expert_width,
            shared_intermediate=int(meta.get(f"{arch}.expert_shared_feed_forward_length") or 0),
            dense_layers=int(meta.get(f"{arch}.leading_dense_block_count") or 0) if experts else 0,
            kv_lora_rank=kv_lora, qk_rope_dim=int(meta.get(f"{arch}.rope.dimension_count") or 0) if kv_lora else 0,
            q_lora_rank=int(meta.get(f"{arch}.attention.q_lora_rank") or 0),
            v_head_dim=int(meta.get(f"{arch}.attention.value_length") or 0) if kv_lora else 0)
    except Exception as e:  # noqa: BLE001 - the gguf package raises bare ValueErrors/struct errors on junk
        raise ValueError(f"{file}: not a usable GGUF file ({type(e).__name__}: {e})") from None
