"""What the predictor needs to know about a model: its shapes, from a preset, an HF config.json or GGUF metadata
(what a draft checkpoint is: autotune/predict/drafts.py)."""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import yaml

PRESETS_FILE = Path(__file__).resolve().parent.parent / "data" / "model_presets.yaml"


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
        """Parameters of one decoder layer (the linear layers; norms are negligible)."""
        return (self.params - self.embedding_params) / self.layers

    def computed_params(self) -> float:
        """Parameters implied by the shapes (attention q/k/v/o + gated MLP + embeddings + norms)."""
        attn = 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp + 2 * self.hidden) + self.embedding_params + self.hidden


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
                return _from_gguf(file.resolve(), file.stat().st_mtime_ns)
            except ValueError:  # a vision projector or a later part of a split model
                continue
    if path.suffix == ".gguf" and path.is_file():
        return _from_gguf(path.resolve(), path.stat().st_mtime_ns)
    config = path / "config.json" if path.is_dir() else path
    if config.name.endswith(".json") and config.is_file():
        return _from_hf_config(config)
    raise ValueError(f"unknown model {str(name_or_path)!r}: not a preset ({', '.join(presets())}), "
                     "an HF checkpoint directory, a .gguf file or a directory of them")


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
                "mtp_layers": int(c.get("num_nextn_predict_layers") or c.get("mtp_num_hidden_layers") or 0),
                "linear_k_heads": int(c.get("linear_num_key_heads") or 0),
                "linear_v_heads": int(c.get("linear_num_value_heads") or 0),
                "linear_k_dim": int(c.get("linear_key_head_dim") or 0),
                "linear_v_dim": int(c.get("linear_value_head_dim") or 0),
                "linear_conv_kernel": int(c.get("linear_conv_kernel_dim") or 4),
                "state_bytes": 2 if c.get("mamba_ssm_dtype") in ("bfloat16", "float16") else 4,
                "checkpoint_quant": _quant_method(top), "architecture": (top.get("architectures") or [""])[0]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{file}: not a usable model config ({type(e).__name__}: {e})") from None
    model = ModelSpec(**spec)
    total = _safetensors_params(file.parent)
    return ModelSpec(**{**spec, "params": total or model.computed_params()})


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


@functools.lru_cache(maxsize=8)
def _from_gguf(file: Path, mtime_ns: int) -> ModelSpec:
    """Cached per file version: parsing a GGUF header takes seconds."""
    import gguf

    try:
        reader = gguf.GGUFReader(file)
        meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
        arch = meta["general.architecture"]
        heads, hidden = int(meta[f"{arch}.attention.head_count"]), int(meta[f"{arch}.embedding_length"])
        names = {t.name for t in reader.tensors}
        vocab = meta.get(f"{arch}.vocab_size") or next(int(t.shape[1]) for t in reader.tensors if t.name == "token_embd.weight")
        return ModelSpec(
            name=file.stem, layers=int(meta[f"{arch}.block_count"]), hidden=hidden, heads=heads,
            kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
            head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
            intermediate=int(meta[f"{arch}.feed_forward_length"]), vocab=int(vocab),
            params=float(sum(int(t.n_elements) for t in reader.tensors)),
            tied_embeddings="output.weight" not in names, source=str(file))
    except Exception as e:  # noqa: BLE001 - the gguf package raises bare ValueErrors/struct errors on junk
        raise ValueError(f"{file}: not a usable GGUF file ({type(e).__name__}: {e})") from None
