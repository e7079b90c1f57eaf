"""Weight-only int8 quantization (per-output-channel symmetric scales), after gpt-fast's quantize.py,
and a GGUF's own quantized blocks run as they are (GGUFLinear, kernels/gguf_linear.c).

Every nn.Linear becomes an Int8Linear, the tied output head included: the head is a fifth of
SmolLM2's weights and the largest single matmul of a decode step, so leaving it in float would keep
much of the cost. The embedding table stays in float (a lookup reads one row per token; quantizing
it saves memory, not time).
"""
import copy as copy_module
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
from functools import cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autotune import package_path
from autotune.embedded.model import Transformer

KERNEL_SOURCES = [package_path("embedded", "kernels", name) for name in ("gguf_linear.c", "attention.c")]
# ggml type -> name, weights per block, bytes per block (ggml's type_traits)
GGML_BLOCKS = {2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34),
               12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210)}
FUSED = {"wqkv": ("wq", "wk", "wv"), "w13": ("w1", "w3")}  # model.py's fused linears, parts in order


class Int8Linear(nn.Module):
    """y = x @ (weight * scales[:, None]).T + bias, weight int8 [out, in], scales float32 [out]."""

    def __init__(self, weight: Tensor, scales: Tensor, bias: Tensor | None):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        w = linear.weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
        weight = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(weight, scales, bias)

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type == "cpu":
            # PyTorch's CPU int8-weight kernel takes bf16 activations; at decode sizes it runs 2-3x
            # faster than a float32 F.linear, while dequantising to float32 first runs slower.
            flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
            y = torch._weight_int8pack_mm(flat, self.weight, self.scales.to(torch.bfloat16))
            y = y.reshape(*x.shape[:-1], -1).to(x.dtype)
        else:
            y = F.linear(x, self.weight.to(x.dtype)) * self.scales.to(x.dtype)  # inductor fuses the dequant
        return y if self.bias is None else y + self.bias


def quantize_int8(model: Transformer, copy: bool = True) -> Transformer:
    """An int8 version of model; with copy=True a new object sharing nothing with the original."""
    quantized = copy_module.deepcopy(model) if copy else model
    for module in list(quantized.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear.from_linear(child))
    return quantized


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights: parameters and persistent buffers, shared storage counted once."""
    tensors = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.state_dict().values()}
    return sum(tensors.values())


class GGUFLinear(nn.Module):
    """y = norm(x) @ W.T + bias with W kept in GGUF blocks (Q4_0/1, Q5_0/1, Q8_0, Q4_K, Q5_K, Q6_K), float32, CPU.

    parts: (ggml type, uint8 rows [out, bytes]) runs of output rows, in order; a fused layer (q/k/v,
    gate/up) whose parts differ in format (a Q4_K_M file's Q6_K attn_v) runs one kernel call per run. The
    kernel quantises x to 8-bit blocks (of 32, or of 256 with per-16 sums for the K-quants: ggml's Q8_K) and
    takes integer dot products with the blocks as stored, as llama.cpp does, so it reads 4-7x fewer bytes than
    float32 weights and does a quarter of the arithmetic.
    norm: the RMSNorm in front of this layer, applied by the kernel in the same pass over x (quantize_gguf
    folds it in), or None. gated: x holds gate then up (2 * in_features values a row) and the layer's input
    is silu(gate) * up, computed in the same pass (SwiGLU folded into the down projection).
    """

    def __init__(self, parts: list[tuple[int, np.ndarray]], in_features: int, bias: Tensor | None = None,
                 norm: nn.Module | None = None):
        super().__init__()
        self.gated = False
        self.in_features, self.out_features = in_features, sum(rows.shape[0] for _, rows in parts)
        self.parts = []  # (ggml type, first output row, rows) of each run
        for i, (ggml_type, rows) in enumerate(parts):
            name, per_block, block_bytes = GGML_BLOCKS[ggml_type]
            if in_features % per_block or rows.shape[1] != in_features // per_block * block_bytes:
                raise ValueError(f"{name} rows of {rows.shape[1]} bytes do not hold {in_features} weights")
            self.register_buffer(f"blocks{i}", torch.from_numpy(pack_rows(ggml_type, rows, in_features)))
            self.parts.append((ggml_type, sum(r.shape[0] for _, r in parts[:i]), rows.shape[0]))
        self.register_buffer("bias", bias)
        self.register_buffer("norm_weight", None if norm is None else norm.weight.detach().float().contiguous())
        self.eps = 0.0 if norm is None else norm.eps

    @property
    def ggml_types(self) -> list[int]:
        return [ggml_type for ggml_type, _, _ in self.parts]

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features * (2 if self.gated else 1)).contiguous()
        y = torch.empty(flat.shape[0], self.out_features)
        # buffers from the dict, not as attributes: nn.Module's lookup costs ~1 us each, at ~150 calls a decode step
        buffers, linear = self._buffers, _kernel().gguf_linear
        norm = 0 if buffers["norm_weight"] is None else buffers["norm_weight"].data_ptr()
        for i, (ggml_type, first, rows) in enumerate(self.parts):
            linear(ggml_type, flat.data_ptr(), flat.shape[0], self.in_features, buffers[f"blocks{i}"].data_ptr(), rows,
                   y.data_ptr() + 4 * first, self.out_features, norm, self.eps, self.gated, torch.get_num_threads())
        y = y.view(*x.shape[:-1], self.out_features)
        return y if buffers["bias"] is None else y + buffers["bias"]


def pack_rows(ggml_type: int, rows: np.ndarray, in_features: int) -> np.ndarray:
    """GGUF rows laid out as the kernel reads them (gguf_pack: the same bytes, blocks of 32 with their scales apart)."""
    source = np.ascontiguousarray(rows, dtype=np.uint8)
    packed = np.empty((rows.shape[0], _kernel().gguf_packed_row_bytes(ggml_type, in_features)), np.uint8)
    _kernel().gguf_pack(ggml_type, source.ctypes.data, rows.shape[0], in_features, packed.ctypes.data)
    return packed


class FusedFeedForward(nn.Module):
    """model.FeedForward on GGUF blocks: w2's kernel call applies SwiGLU to w13's output as it quantises it."""

    def __init__(self, w13: GGUFLinear, w2: GGUFLinear):
        super().__init__()
        self.w13, self.w2 = w13, w2
        w2.gated = True

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.w13(x))


class FusedAttention(nn.Module):
    """model.Attention on the CPU: after the q/k/v matmul, RoPE, the KV-cache write and causal GQA attention are
    one C call (kernels/attention.c); on a decode step its ~20 PyTorch ops cost more than their arithmetic.
    The mask argument is not read: Transformer.forward's mask is always "key position <= query position"."""

    def __init__(self, attention: nn.Module):
        super().__init__()
        self.wqkv, self.wo, self.layer = attention.wqkv, attention.wo, attention.layer
        self.n_heads, self.n_kv_heads, self.head_dim = attention.n_heads, attention.n_kv_heads, attention.head_dim

    def forward(self, x, cos, sin, mask, cache, rows, input_pos, kv_len):
        bsz, seqlen, _ = x.shape
        qkv = self.wqkv(x).contiguous()
        slots = torch.arange(bsz) if rows is None else rows.contiguous()
        positions, cos, sin = input_pos.contiguous(), cos.contiguous(), sin.contiguous()
        k_cache, v_cache = cache.k[self.layer], cache.v[self.layer]
        out = torch.empty(bsz, seqlen, self.n_heads * self.head_dim)
        _kernel().attention(qkv.data_ptr(), bsz, seqlen, self.n_heads, self.n_kv_heads, self.head_dim, cos.data_ptr(),
                            sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[2], slots.data_ptr(),
                            positions.data_ptr(), kv_len, out.data_ptr(), torch.get_num_threads())
        return self.wo(out)


def quantize_gguf(model: Transformer, blocks: dict | None, device: torch.device, dtype: torch.dtype) -> int:
    """Swap, in place, every linear layer whose GGUF tensors are in a native block format for a GGUFLinear,
    fold each RMSNorm into the layer it feeds (the kernel normalises while it quantises x), and run each
    layer's attention and SwiGLU as fused CPU calls (FusedAttention, FusedFeedForward).

    blocks is weights.LoadedModel.gguf_blocks. Returns how many layers were swapped; the others (other
    block formats) keep their float weights.
    """
    if blocks is None:
        raise ValueError("quantization gguf runs a GGUF file's own blocks: the model is not a GGUF file")
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError("quantization gguf runs on the CPU in float32 (use --device cpu --dtype float32)")
    _kernel()  # fail here, with the compiler's message, not at the first request
    norms = {"output": (model, "norm")}  # linear -> (module, attribute) of the RMSNorm in front of it
    for i, layer in enumerate(model.layers):
        norms[f"layers.{i}.attention.wqkv"] = (layer, "attention_norm")
        norms[f"layers.{i}.feed_forward.w13"] = (layer, "ffn_norm")
    swapped = 0
    for path, linear in [(p, m) for p, m in model.named_modules() if isinstance(m, nn.Linear)]:
        parent_path, _, attr = path.rpartition(".")
        if path == "output":
            names = ["tok_embeddings" if linear.weight is model.tok_embeddings.weight else "output"]
        else:
            names = [f"{parent_path}.{part}" for part in FUSED.get(attr, (attr,))]
        sources = [blocks.get(f"{name}.weight") for name in names]
        if any(s is None for s in sources):
            continue
        runs = []  # neighbouring parts in one format become one run of rows
        for ggml_type, rows in sources:
            if runs and runs[-1][0] == ggml_type:
                runs[-1] = (ggml_type, np.concatenate([runs[-1][1], rows]))
            else:
                runs.append((ggml_type, rows))
        owner, norm_attr = norms.get(path, (None, None))
        norm = getattr(owner, norm_attr) if owner is not None else None
        setattr(model.get_submodule(parent_path) if parent_path else model, attr,
                GGUFLinear(runs, linear.in_features, linear.bias, norm))
        if owner is not None:
            setattr(owner, norm_attr, nn.Identity())
        swapped += 1
    for layer in model.layers:
        if isinstance(layer.attention.wqkv, GGUFLinear):
            layer.attention = FusedAttention(layer.attention)
        ff = layer.feed_forward
        if isinstance(ff.w13, GGUFLinear) and isinstance(ff.w2, GGUFLinear):
            layer.feed_forward = FusedFeedForward(ff.w13, ff.w2)
    return swapped


def build_kernel(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """kernels/*.c built for this CPU and loaded, its entry points typed."""
    lib = ctypes.CDLL(str(compile_kernel(KERNEL_SOURCES, extra_flags)))
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.gguf_linear.argtypes = [ctypes.c_int, pointer, size, size, pointer, size, pointer, size, pointer, ctypes.c_float,
                                ctypes.c_int, ctypes.c_int]
    lib.gguf_linear.restype = ctypes.c_int
    lib.gguf_packed_row_bytes.argtypes = [ctypes.c_int, size]
    lib.gguf_packed_row_bytes.restype = size
    lib.gguf_pack.argtypes = [ctypes.c_int, pointer, size, size, pointer]
    lib.gguf_pack.restype = None
    lib.attention.argtypes = [pointer, size, size, size, size, size, pointer, pointer, pointer, pointer, size, pointer,
                              pointer, size, pointer, ctypes.c_int]
    lib.attention.restype = None
    return lib


def compile_kernel(sources: list[Path], extra_flags: tuple[str, ...] = ()) -> Path:
    """The shared library of sources, built for this CPU (a second, once: cached by source, compiler, flags and the
    CPU's feature flags, since -march=native builds for the CPU it runs on and a home directory may be shared)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("quantization gguf compiles a small C kernel and no C compiler (cc, gcc) was found")
    # -ffp-contract=off: a multiply-add is fused only where the source says so, never by the compiler's choice,
    # which can differ between the 1-, 2- and 4-row loops: a row's bits must not depend on its batch (greedy
    # speculative decoding is exact only if a verify step computes what a decode step would)
    flags = ["-O3", "-march=native", *extra_flags, "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
    text = b"".join(path.read_bytes() for path in sources)
    key = hashlib.sha256(text + " ".join([compiler, *flags, _cpu_flags()]).encode()).hexdigest()[:16]
    cache_dir = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "autotune" / "kernels"
    library = cache_dir / f"gguf_linear-{key}.so"
    if not library.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        partial = library.with_suffix(f".{os.getpid()}.tmp")
        built = subprocess.run([compiler, *flags, "-o", str(partial), *map(str, sources)], capture_output=True,
                               text=True, check=False)
        if built.returncode != 0:
            last_line = (built.stderr.strip().splitlines() or ["no message"])[-1]
            raise RuntimeError(f"building the gguf kernel with {compiler} failed: {last_line}")
        partial.replace(library)  # atomic: concurrent engines never load a half-written library
    return library


def _cpu_flags() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    return next((line for line in lines if line.startswith(("flags", "Features"))), platform.machine())


@cache
def _kernel() -> ctypes.CDLL:
    return build_kernel()
