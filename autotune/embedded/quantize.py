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
import shutil
import subprocess
from functools import cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autotune.embedded.model import Transformer

KERNEL_SOURCE = Path(__file__).parent / "kernels" / "gguf_linear.c"
GGML_BLOCKS = {2: ("Q4_0", 18), 3: ("Q4_1", 20), 8: ("Q8_0", 34)}  # ggml type -> name, bytes per 32 weights
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
    """y = x @ W.T + bias with W kept in a GGUF block format (Q4_0, Q4_1, Q8_0), float32 activations, CPU.

    The dequantised weights are bit-identical to the gguf package's, the ones every other path of this
    engine (and transformers' GGUF loader) uses; a decode step just reads 4-7x fewer bytes of them. The
    kernel also beats a float32 GEMM on prefill-sized inputs (it tiles x to stay in L1), so every input
    size goes through it.
    """

    def __init__(self, ggml_type: int, rows: np.ndarray, in_features: int, bias: Tensor | None):
        super().__init__()
        name, block_bytes = GGML_BLOCKS[ggml_type]
        blocks = np.ascontiguousarray(rows).reshape(rows.shape[0], -1, block_bytes)
        self.ggml_type, self.in_features, self.out_features = ggml_type, in_features, rows.shape[0]
        self.register_buffer("d", _half_to_float(blocks[..., 0:2]))
        self.register_buffer("m", _half_to_float(blocks[..., 2:4]) if name == "Q4_1" else None)
        self.register_buffer("qs", torch.from_numpy(np.ascontiguousarray(blocks[..., 4 if name == "Q4_1" else 2:])))
        self.register_buffer("bias", bias)

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features).float().contiguous()
        y = torch.empty(flat.shape[0], self.out_features)
        _kernel().gguf_linear(self.ggml_type, flat.data_ptr(), flat.shape[0], self.in_features, self.qs.data_ptr(),
                              self.d.data_ptr(), 0 if self.m is None else self.m.data_ptr(), self.out_features,
                              y.data_ptr(), torch.get_num_threads())
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias


def quantize_gguf(model: Transformer, blocks: dict | None, device: torch.device, dtype: torch.dtype) -> int:
    """Swap, in place, every linear layer whose GGUF tensors are in a native block format for a GGUFLinear.

    blocks is weights.LoadedModel.gguf_blocks. Returns how many layers were swapped; the others (other
    block formats, or parts of a fused layer in different formats) keep their float weights.
    """
    if blocks is None:
        raise ValueError("quantization gguf runs a GGUF file's own blocks: the model is not a GGUF file")
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError("quantization gguf runs on the CPU in float32 (use --device cpu --dtype float32)")
    _kernel()  # fail here, with the compiler's message, not at the first request
    swapped = 0
    for path, linear in [(p, m) for p, m in model.named_modules() if isinstance(m, nn.Linear)]:
        parent_path, _, attr = path.rpartition(".")
        if path == "output":
            parts = ["tok_embeddings" if linear.weight is model.tok_embeddings.weight else "output"]
        else:
            parts = [f"{parent_path}.{part}" for part in FUSED.get(attr, (attr,))]
        sources = [blocks.get(f"{part}.weight") for part in parts]
        if any(s is None for s in sources) or len({ggml_type for ggml_type, _ in sources}) != 1:
            continue
        rows = np.concatenate([r for _, r in sources]) if len(sources) > 1 else sources[0][1]
        native = GGUFLinear(sources[0][0], rows, linear.in_features, linear.bias)
        setattr(model.get_submodule(parent_path) if parent_path else model, attr, native)
        swapped += 1
    return swapped


def _half_to_float(raw: np.ndarray) -> Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32))


def build_kernel(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """kernels/gguf_linear.c built for this CPU (a second, once: cached by source, compiler and flags)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("quantization gguf compiles a small C kernel and no C compiler (cc, gcc) was found")
    flags = ["-O3", "-march=native", *extra_flags, "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
    key = hashlib.sha256(KERNEL_SOURCE.read_bytes() + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
    cache_dir = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "autotune" / "kernels"
    library = cache_dir / f"gguf_linear-{key}.so"
    if not library.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        partial = library.with_suffix(f".{os.getpid()}.tmp")
        built = subprocess.run([compiler, *flags, "-o", str(partial), str(KERNEL_SOURCE)], capture_output=True, text=True)
        if built.returncode != 0:
            last_line = (built.stderr.strip().splitlines() or ["no message"])[-1]
            raise RuntimeError(f"building the gguf kernel with {compiler} failed: {last_line}")
        partial.replace(library)  # atomic: concurrent engines never load a half-written library
    lib = ctypes.CDLL(str(library))
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.gguf_linear.argtypes = [ctypes.c_int, pointer, size, size, pointer, pointer, pointer, size, pointer, ctypes.c_int]
    lib.gguf_linear.restype = None
    return lib


@cache
def _kernel() -> ctypes.CDLL:
    return build_kernel()
