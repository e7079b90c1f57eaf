"""A GGUF written out as a Hugging Face checkpoint directory (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json): what vLLM and SGLang load, made from the file llama.cpp and the
embedded engine read.

The inverse of weights.read_hf_dir: the GGUF is read with read_gguf (dequantised, the llama Q/K permutation
undone) and its tensors renamed to HF's. transformers cannot do this itself (it refuses to `save_pretrained` a
model loaded from a GGUF). Weights are stored in float32: every dequantised GGUF value is exact there, so
an engine serving the directory in float32 computes with the GGUF's own weights.
"""
import json
from pathlib import Path

from autotune.embedded.weights import GGUF_LAYER_NAMES, HF_LAYER_NAMES, HF_NAMES, read_gguf

ARCHITECTURE_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def hf_state(state: dict, n_layers: int) -> dict:
    """Our tensor names -> HF's (model.layers.N.self_attn.q_proj.weight, ...)."""
    ours_to_hf = {ours: hf for hf, ours in HF_NAMES.items()}
    for layer in range(n_layers):
        for hf, ours in HF_LAYER_NAMES.items():
            for kind in ("weight", "bias"):
                ours_to_hf[f"layers.{layer}.{ours}.{kind}"] = f"model.layers.{layer}.{hf}.{kind}"
    return {ours_to_hf[name]: tensor.contiguous() for name, tensor in state.items()}


def write_hf_dir(gguf_file: Path, out: Path) -> Path:
    """Write `gguf_file` as an HF checkpoint directory `out` (created; files replaced)."""
    from safetensors.torch import save_file

    args, state, tokenizer, _ = read_gguf(Path(gguf_file), None)
    arch = "qwen2" if args.qkv_bias else "llama"
    assert set(GGUF_LAYER_NAMES.values()) == set(HF_LAYER_NAMES.values())  # every GGUF tensor has an HF name
    if args.tie_embeddings:
        state.pop("output.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    save_file(hf_state(state, args.n_layers), str(out / "model.safetensors"), metadata={"format": "pt"})
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    config = {
        "architectures": [ARCHITECTURE_CLASSES[arch]], "model_type": arch, "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim, "intermediate_size": args.intermediate_size,
        "vocab_size": args.vocab_size, "rms_norm_eps": _f32(args.norm_eps), "rope_theta": _f32(args.rope_base),
        "max_position_embeddings": args.max_seq_len, "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu", "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": "float32",
        **({"attention_bias": False, "mlp_bias": False} if arch == "llama" else {}),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    stops = sorted(tokenizer.stop_token_ids)
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos, "eos_token_id": stops if len(stops) > 1 else eos}, indent=2) + "\n")
    tokenizer.backend.save(str(out / "tokenizer.json"))
    token = tokenizer.token
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": args.max_seq_len,
        "bos_token": token(bos) if bos is not None else None, "eos_token": token(eos) if eos is not None else None,
        "chat_template": tokenizer.chat_template, "clean_up_tokenization_spaces": False}, indent=2) + "\n")
    return out


def _f32(value: float) -> float:
    """A GGUF float32 field as the decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(f"{value:.7g}")
