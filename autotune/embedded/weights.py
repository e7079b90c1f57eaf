"""Load a llama/qwen2 checkpoint (GGUF file or HF safetensors directory) into model.Transformer.

GGUF tensors are dequantised with the `gguf` package; llama.cpp's names are mapped to ours and its
Q/K row permutation (llama architecture only) is undone, as transformers' GGUF loader does.

A distilled draft (scripts/distill_draft_model.py) is a GGUF without token embedding or tokenizer: it
borrows both from its target, and its head has rows for a subset of the vocabulary only (FR-Spec,
arXiv 2502.14856), whose full-vocabulary ids it lists in its metadata (DRAFT_SUBSET_KEY).
"""
import hashlib
import json
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from autotune.embedded.bundled import GET_A_MODEL, bundled_gguf_path
from autotune.embedded.gguf_header import Header, read_header
from autotune.embedded.model import Linear, ModelArgs, Transformer, rope_tables
from autotune.embedded.quantize import GGML_BLOCKS
from autotune.embedded.tokenizer import Tokenizer, tokenizer_from_gguf, tokenizer_from_hf_dir

BUNDLED_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
ARCHITECTURES = ("llama", "qwen2")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DRAFT_SUBSET_KEY = "autotune.draft.vocab_subset"  # a distilled draft's head rows, as full-vocabulary token ids
DRAFT_VOCAB_KEY = "autotune.draft.target_vocab_fingerprint"  # Tokenizer.vocab_fingerprint() of the target it borrows from

GGUF_NAMES = {
    "token_embd.weight": "tok_embeddings.weight", "output_norm.weight": "norm.weight",
    "output.weight": "output.weight",
}
GGUF_LAYER_NAMES = {
    "attn_norm": "attention_norm", "ffn_norm": "ffn_norm", "attn_q": "attention.wq", "attn_k": "attention.wk",
    "attn_v": "attention.wv", "attn_output": "attention.wo", "ffn_gate": "feed_forward.w1",
    "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2",
}
HF_NAMES = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
            "lm_head.weight": "output.weight"}
HF_LAYER_NAMES = {
    "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3", "mlp.down_proj": "feed_forward.w2",
}


@dataclass
class LoadedModel:
    model: Transformer  # eval mode, on its device, in its dtype
    args: ModelArgs
    tokenizer: Tokenizer
    path: str
    name: str  # what /v1/models lists
    sha256: str | None  # of the GGUF file; None for a safetensors directory
    gguf_blocks: dict | None = None  # name -> (ggml type, uint8 rows) of a GGUF's natively runnable tensors
    vocab_subset: torch.Tensor | None = None  # a reduced-vocabulary draft: the full token id of each head row


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def load_model(path: str | None = None, dtype: str = "float32", device: str = "cpu",
               max_seq_len: int | None = None) -> LoadedModel:
    """path: a .gguf file, an HF directory (config.json + *.safetensors), or None for the bundled model.

    max_seq_len caps the RoPE table (the longest sequence the model serves); None or anything
    longer than the checkpoint's context length gives the context length.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    file = bundled_gguf_path() if path is None else Path(path).expanduser()
    if not file.exists():
        raise FileNotFoundError(f"model path {file} does not exist: {GET_A_MODEL}")
    blocks = None
    if file.is_dir():
        args, state, tokenizer = read_hf_dir(file, max_seq_len)
        sha256 = None
    elif file.suffix == ".gguf":
        sha256 = file_sha256(file)
        if path is None and sha256 != BUNDLED_SHA256:
            raise ValueError(f"the bundled model {file} is corrupt: sha256 {sha256}, expected {BUNDLED_SHA256}")
        args, state, tokenizer, blocks = read_gguf(file, max_seq_len)
    else:
        raise ValueError(f"{file} is neither a .gguf file nor a directory with config.json and *.safetensors")
    model = build_model(args, state, DTYPES[dtype], torch.device(device))
    name = file.name if file.is_dir() else file.stem
    return LoadedModel(model, args, tokenizer, str(file), name, sha256, blocks)


def load_draft_model(path: str, target: LoadedModel, dtype: str = "float32", device: str = "cpu",
                     max_seq_len: int | None = None) -> LoadedModel:
    """The draft checkpoint for target: a distilled reduced-vocabulary draft borrows the target's input embedding
    (the same tensor, not a copy) and tokenizer; any other checkpoint must number tokens as the target does."""
    file = Path(path).expanduser()
    header = read_header(file) if file.is_file() and file.suffix == ".gguf" else None
    if header is None or DRAFT_SUBSET_KEY not in header.meta:
        draft = load_model(path, dtype, device, max_seq_len)
        check_draft_compatible(target, draft)
        return draft
    meta = header.meta
    if meta.get(DRAFT_VOCAB_KEY) != target.tokenizer.vocab_fingerprint():
        raise ValueError(f"draft model {file.name} was distilled from a model with another vocabulary than {target.name}")
    args, state, blocks = read_gguf_tensors(file, header, max_seq_len)
    subset = torch.tensor(meta[DRAFT_SUBSET_KEY], dtype=torch.long)
    if (args.vocab_size != target.args.vocab_size or len(subset) != state["output.weight"].shape[0]
            or len(subset.unique()) != len(subset) or not 0 <= int(subset.min()) <= int(subset.max()) < args.vocab_size):
        raise ValueError(f"{file}: its vocabulary subset does not name one distinct token id per head row")
    state["tok_embeddings.weight"] = target.model.tok_embeddings.weight
    model = build_model(args, state, DTYPES[dtype], torch.device(device))
    return LoadedModel(model, args, target.tokenizer, str(file), file.stem, file_sha256(file), blocks,
                       subset.to(device))


def check_draft_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft model must number tokens exactly as the target does, or its proposals mean nothing."""
    t, d = target.tokenizer, draft.tokenizer
    if t.vocab_size != d.vocab_size or t.vocab_fingerprint() != d.vocab_fingerprint():
        raise ValueError(f"draft model {draft.name} has a different vocabulary from target {target.name} "
                         f"({d.vocab_size} vs {t.vocab_size} tokens, fingerprints differ): use a draft of the same family")


def build_model(args: ModelArgs, state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device):
    with _skip_init():
        model = Transformer(args)
        head_rows = state["output.weight"].shape[0] if "output.weight" in state else args.vocab_size
        if head_rows != args.vocab_size:  # a reduced-vocabulary draft head
            model.output = Linear(args.dim, head_rows, bias=False)
    if args.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    # Non-strict so both problems are reported in one line; the model fuses q/k/v and gate/up on load.
    result = model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()},
                                   strict=False, assign=True)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(f"checkpoint tensors do not fit the model: missing {sorted(result.missing_keys)[:4]}, "
                         f"unexpected {sorted(result.unexpected_keys)[:4]}")
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.rope_cos, model.rope_sin = rope_tables(args, device)  # float32 whatever the weights' dtype
    return model.eval().requires_grad_(False)


@contextmanager
def _skip_init():
    """Leave new layers' weights uninitialised: they are replaced at once. Random init costs ~1.4 s
    for SmolLM2, and building on the meta device instead costs as much (it imports torch._dynamo)."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


# -- GGUF -------------------------------------------------------------------------------------------------
def read_gguf(file: Path, max_seq_len: int | None) -> tuple[ModelArgs, dict, Tokenizer, dict]:
    """The model's args, float32 state, tokenizer, and the raw block rows (numpy uint8 [out, bytes], views
    of the mapped file) of each 2-D tensor in a block format quantize.GGUFLinear runs natively."""
    header = read_header(file)
    meta = header.meta
    if DRAFT_SUBSET_KEY in meta:
        raise ValueError(f"{file} is a distilled draft model (it borrows its target's embedding and tokenizer): "
                         "serve it with --drafter draft_model --draft-model")
    args, state, blocks = read_gguf_tensors(file, header, max_seq_len)
    return args, state, tokenizer_from_gguf(meta), blocks


def read_gguf_tensors(file: Path, header: Header, max_seq_len: int | None) -> tuple[ModelArgs, dict, dict]:
    """args, float32 state and native block rows of a GGUF's header (see read_gguf)."""
    from gguf.quants import dequantize

    meta = header.meta
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{file}: architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    if meta.get(f"{arch}.rope.scaling.type", "none") not in ("none", "linear") or any(
            t.name == "rope_freqs.weight" for t in header.tensors):
        raise ValueError(f"{file}: RoPE scaling is not supported")
    names = {t.name for t in header.tensors}
    heads = meta[f"{arch}.attention.head_count"]
    dim = meta[f"{arch}.embedding_length"]
    args = ModelArgs(
        dim=dim, n_layers=meta[f"{arch}.block_count"], n_heads=heads,
        n_kv_heads=meta.get(f"{arch}.attention.head_count_kv", heads),
        intermediate_size=meta[f"{arch}.feed_forward_length"],
        vocab_size=meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"]),
        head_dim=meta.get(f"{arch}.attention.key_length", dim // heads),
        norm_eps=meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        rope_base=meta.get(f"{arch}.rope.freq_base", 10000.0),
        max_seq_len=_cap(max_seq_len, meta.get(f"{arch}.context_length", 2048)),
        tie_embeddings="output.weight" not in names, qkv_bias="blk.0.attn_q.bias" in names,
    )
    state, blocks = {}, {}
    for t in header.tensors:
        try:
            values = dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(t.shape)])
        except NotImplementedError:
            raise ValueError(f"{file}: tensor {t.name} is {t.tensor_type.name}, which gguf cannot dequantise") from None
        tensor = torch.from_numpy(np.array(values, dtype=np.float32))
        raw = t.data.reshape(tensor.shape[0], -1) if (
            tensor.dim() == 2 and int(t.tensor_type) in GGML_BLOCKS) else None
        if arch == "llama" and re.search(r"\.attn_[qk]\.", t.name):
            heads = args.n_heads if ".attn_q." in t.name else args.n_kv_heads
            tensor = _unpermute(tensor, heads)
            if raw is not None:  # the same permutation of rows; blocks run along a row
                raw = raw.reshape(heads, -1, 2, raw.shape[1]).swapaxes(1, 2).reshape(raw.shape)
        state[_gguf_name(file, t.name)] = tensor
        if raw is not None:
            blocks[_gguf_name(file, t.name)] = (int(t.tensor_type), raw)
    return args, state, blocks


def _gguf_name(file: Path, name: str) -> str:
    if name in GGUF_NAMES:
        return GGUF_NAMES[name]
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if not match or match[2] not in GGUF_LAYER_NAMES:
        raise ValueError(f"{file}: unexpected tensor {name!r} (not a plain llama/qwen2 checkpoint)")
    return f"layers.{match[1]}.{GGUF_LAYER_NAMES[match[2]]}.{match[3]}"


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp stores each head's rows interleaved (pairs); HF's rotate-half layout wants halves."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _cap(max_seq_len: int | None, context_length: int) -> int:
    return min(max_seq_len, context_length) if max_seq_len else context_length


# -- HF safetensors directory ------------------------------------------------------------------------------
def read_hf_dir(directory: Path, max_seq_len: int | None) -> tuple[ModelArgs, dict, Tokenizer]:
    from safetensors.torch import load_file

    config_file, files = directory / "config.json", sorted(directory.glob("*.safetensors"))
    if not config_file.is_file() or not files:
        raise FileNotFoundError(f"{directory}: expected config.json and *.safetensors (an HF checkpoint directory)")
    config = json.loads(config_file.read_text())
    arch = config.get("model_type")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{directory}: model_type {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    if arch == "llama" and (config.get("attention_bias") or config.get("mlp_bias")):
        raise ValueError(f"{directory}: llama with attention_bias/mlp_bias is not supported")
    if config.get("use_sliding_window") and config.get("sliding_window"):
        raise ValueError(f"{directory}: sliding-window attention is not supported")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"{directory}: RoPE scaling {rope.get('rope_type', rope.get('type'))!r} is not supported")
    heads, dim = config["num_attention_heads"], config["hidden_size"]
    args = ModelArgs(
        dim=dim, n_layers=config["num_hidden_layers"], n_heads=heads,
        n_kv_heads=config.get("num_key_value_heads") or heads, intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"], head_dim=config.get("head_dim") or dim // heads,
        norm_eps=config.get("rms_norm_eps", 1e-6), rope_base=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
        max_seq_len=_cap(max_seq_len, config.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)), qkv_bias=arch == "qwen2",
    )
    state = {}
    for f in files:
        for name, tensor in load_file(f).items():
            state[_hf_name(directory, name)] = tensor.float()
    if args.tie_embeddings:
        state.pop("output.weight", None)
    return args, state, tokenizer_from_hf_dir(directory, config)


def _hf_name(directory: Path, name: str) -> str:
    if name in HF_NAMES:
        return HF_NAMES[name]
    match = re.fullmatch(r"model\.layers\.(\d+)\.(\w+(?:\.\w+)?)\.(weight|bias)", name)
    if not match or match[2] not in HF_LAYER_NAMES:
        raise ValueError(f"{directory}: unexpected tensor {name!r} (not a plain llama/qwen2 checkpoint)")
    return f"layers.{match[1]}.{HF_LAYER_NAMES[match[2]]}.{match[3]}"
