"""Weight-only int8 quantization (per-output-channel symmetric scales), after gpt-fast's quantize.py.

Every nn.Linear becomes an Int8Linear, the tied output head included: the head is a fifth of
SmolLM2's weights and the largest single matmul of a decode step, so leaving it in float would keep
much of the cost. The embedding table stays in float (a lookup reads one row per token; quantizing
it saves memory, not time).
"""
import copy as copy_module

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autotune.embedded.model import Transformer


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
