"""A llama/qwen2-style decoder in plain PyTorch (after gpt-fast's model.py).

RMSNorm, rotary embeddings (HF "rotate half" layout), grouped-query attention, SwiGLU, and a
fixed-size KV cache with one row per serving slot. Every row of a batch carries its own positions,
so sequences at different lengths decode and verify together in one forward pass.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


@dataclass
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int = 0
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    qkv_bias: bool = False  # qwen2 has biases on q, k and v

    def __post_init__(self):
        if not self.head_dim:
            self.head_dim = self.dim // self.n_heads


class KVCache:
    """Keys and values of every layer for `slots` sequences of up to `max_len` tokens."""

    def __init__(self, args: ModelArgs, slots: int, max_len: int, dtype: torch.dtype, device=None):
        shape = (slots, args.n_kv_heads, max_len, args.head_dim)
        # One tensor per layer rather than views of one: torch.compile then writes them in place
        # (writes into views of a shared base made inductor copy whole caches every step).
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.n_layers)]
        self.max_len = max_len
        self.device = self.k[0].device

    def slots_of(self, rows: Tensor | None, batch: int) -> Tensor:
        """The cache slots of a batch's rows: `rows`, or slots 0..B-1 when None."""
        return torch.arange(batch, device=self.device) if rows is None else rows

    def write(self, layer: int, rows: Tensor | None, input_pos: Tensor, k: Tensor, v: Tensor):
        """Write k, v ([B, T, Hkv, D]) at input_pos ([B, T]) of the rows' slots."""
        slot_index = self.slots_of(rows, input_pos.shape[0])[:, None]
        self.k[layer][slot_index, :, input_pos] = k
        self.v[layer][slot_index, :, input_pos] = v

    def update(self, layer: int, rows: Tensor | None, input_pos: Tensor, k: Tensor, v: Tensor, kv_len: int):
        """Write k, v ([B, T, Hkv, D]) at input_pos ([B, T]) and return the first kv_len positions.

        `rows` names the cache slots of the batch rows; None means slots 0..B-1 (a view, no copy).
        """
        self.write(layer, rows, input_pos, k, v)
        k_cache, v_cache = self.k[layer], self.v[layer]
        batch = input_pos.shape[0]
        if rows is None:
            return k_cache[:batch, :, :kv_len], v_cache[:batch, :, :kv_len]
        return k_cache[rows, :, :kv_len], v_cache[rows, :, :kv_len]


def fuse_on_load(parts: tuple[str, ...], fused: str):
    """A load_state_dict pre-hook concatenating separate projections (checkpoint layout) into one."""

    def hook(state_dict, prefix, *args):
        for kind in ("weight", "bias"):
            names = [f"{prefix}{part}.{kind}" for part in parts]
            if all(name in state_dict for name in names):
                state_dict[f"{prefix}{fused}.{kind}"] = torch.cat([state_dict.pop(name) for name in names])

    return hook


ROW_DOT_MAX_OUT = 4096  # widest layer a one-row CUDA step computes as dot products (the head stays a GEMM)


class Linear(nn.Linear):
    """nn.Linear, but 2-4 float32 rows on a CPU (a speculative verify) run as W @ x.T: PyTorch's CPU GEMM
    packs W for x @ W.T, so 2 rows cost ~2x one row; W @ x.T streams W once (0.4-0.7x, head to MLP).
    One row on CUDA under torch.compile runs as dot products, which inductor writes as one Triton reduction:
    2.0-2.3 us against cuBLAS's 3.4-5.1 us for SmolLM2's q/k/v, output and down layers on the H200, slower
    for the 49152-wide head (benchmarks/gpu_step_parts.py)."""

    def forward(self, x: Tensor) -> Tensor:
        rows = x.numel() // x.shape[-1]
        if rows == 1 and x.is_cuda and self.out_features <= ROW_DOT_MAX_OUT and torch.compiler.is_compiling():
            y = (x[..., None, :].float() * self.weight.float()).sum(-1).to(x.dtype)
            return y if self.bias is None else y + self.bias
        if not (x.device.type == "cpu" and x.dtype == torch.float32 and 2 <= rows <= 4):
            return F.linear(x, self.weight, self.bias)
        y = (self.weight @ x.reshape(rows, -1).T).T.reshape(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in float32 like the reference implementations; bf16 variance drifts.
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_tables(args: ModelArgs, device=None) -> tuple[Tensor, Tensor]:
    inv_freq = 1.0 / (args.rope_base ** (torch.arange(0, args.head_dim, 2, device=device).float() / args.head_dim))
    angles = torch.outer(torch.arange(args.max_seq_len, device=device).float(), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [B, T, H, D]; cos/sin: [B, T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos[:, :, None, :] + rotated * sin[:, :, None, :]).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        # q, k and v in one matmul (one kernel, one pass over x); checkpoints load through fuse_on_load.
        self.split = [args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, args.n_kv_heads * args.head_dim]
        self.wqkv = Linear(args.dim, sum(self.split), bias=args.qkv_bias)
        self.wo = Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self._register_load_state_dict_pre_hook(fuse_on_load(("wq", "wk", "wv"), "wqkv"))
        # step_attention(q, k_cache, v_cache, slots, pos, kv_len) -> [B, T, H, D]: a kernel for the few queries
        # of a decode/verify step against the cache (kernels/step_attention.py), for steps up to step_max_width.
        self.step_attention, self.step_max_width = None, 0

    def forward(self, x, cos, sin, mask, cache: KVCache, rows, input_pos, kv_len):
        bsz, seqlen, _ = x.shape
        q, k, v = self.wqkv(x).split(self.split, dim=-1)
        q = q.view(bsz, seqlen, self.n_heads, self.head_dim)
        k = k.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        v = v.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if seqlen <= self.step_max_width:
            cache.write(self.layer, rows, input_pos, k, v)
            out = self.step_attention(q, cache.k[self.layer], cache.v[self.layer], cache.slots_of(rows, bsz), input_pos,
                                      kv_len)
            return self.wo(out.reshape(bsz, seqlen, -1))
        keys, values = cache.update(self.layer, rows, input_pos, k, v, kv_len)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=self.n_heads != self.n_kv_heads
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w13 = Linear(args.dim, 2 * args.intermediate_size, bias=False)  # gate (w1) and up (w3) fused
        self.w2 = Linear(args.intermediate_size, args.dim, bias=False)  # down
        self._register_load_state_dict_pre_hook(fuse_on_load(("w1", "w3"), "w13"))

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.attention = Attention(args, layer)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, cos, sin, mask, cache, rows, input_pos, kv_len):
        h = x + self.attention(self.attention_norm(x), cos, sin, mask, cache, rows, input_pos, kv_len)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(args)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def use_step_attention(self, kernel, max_width):
        """Run the attention of steps up to max_width(n_heads, n_kv_heads, head_dim) wide with
        kernel(q, k_cache, v_cache, slots, pos, kv_len); kernel None: SDPA everywhere."""
        for layer in self.layers:
            a = layer.attention
            a.step_attention = kernel
            a.step_max_width = max_width(a.n_heads, a.n_kv_heads, a.head_dim) if kernel is not None else 0

    def forward(
        self,
        input_ids: Tensor,
        input_pos: Tensor,
        cache: KVCache,
        rows: Tensor | None = None,
        num_layers: int | None = None,
        kv_len: int | None = None,
        logits_from: int = 0,
        logits_to: int | None = None,
    ) -> Tensor:
        """Logits [B, logits_to - logits_from, V] (logits_to None: T) for input_ids [B, T] at positions
        input_pos [B, T].

        num_layers < n_layers runs only the first layers (early-exit drafting; the final norm and
        head are shared). kv_len bounds the attended cache (defaults to the whole cache; pass the
        largest position + 1 to skip empty cache on CPU). logits_from and logits_to skip the head for
        prefill positions whose logits nobody reads.
        """
        kv_len = kv_len or cache.max_len
        mask = (torch.arange(kv_len, device=input_pos.device)[None, None, :] <= input_pos[:, :, None])[:, None]
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]
        x = self.tok_embeddings(input_ids)
        for layer in self.layers[: num_layers or len(self.layers)]:
            x = layer(x, cos, sin, mask, cache, rows, input_pos, kv_len)
        return self.output(self.norm(x[:, logits_from:logits_to]))
