"""Linear layers with weights prepacked for oneDNN: the CPU bfloat16 inference path.

torch's bfloat16 `F.linear` on CPU gives oneDNN the weight in its plain layout, and oneDNN
reorders it into its blocked layout on every call. For one token (a decode step) that reorder
costs about as much as the matmul itself: 0.6B-shaped layer weights stream at ~14 GB/s through
`F.linear` and at ~29.5 GB/s prepacked (measured on a 2-core EPYC with AVX512-BF16).
`pack_linears` swaps a finished model's `nn.Linear` modules for `PackedLinear`, which reorders
once. The packed call runs the same oneDNN kernels on the same numbers, so its output equals
`F.linear`'s bit for bit at every row count (tests/test_packed.py), and speculative output stays
equal to plain output wherever it was.

Packed weights are opaque oneDNN tensors: inference only (no autograd, no slicing). A model's
code that needs a slice of a weight (the DFlash drafter's K/V rows of `qkv_proj`) packs that slice
as a linear of its own before packing.
"""

from __future__ import annotations

import functools
import platform

import torch
from torch import nn

from ..device import cpu_has_native_bf16


@functools.cache
def packing_available() -> bool:
    """oneDNN bfloat16 matmuls with prepacked weights exist in this torch build and run natively
    on this CPU. oneDNN also takes bf16 on x86 CPUs with AVX512 but without AVX512-BF16 or AMX
    (Skylake-SP to Ice Lake), emulated there at about a fourth of its float32 speed (measured on
    a 2-core Xeon at 512 rows, 384 -> 2048: 55 GFLOP/s against 227 in float32 on the widened
    weight); those CPUs take agentflash's
    kernels and float32 prefill instead (engine.cpu.fastpath: widened-bf16-linears)."""
    if not (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return False
    return cpu_has_native_bf16() or platform.machine().lower() not in ("x86_64", "amd64")


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's blocked layout (CPU, bfloat16, inference)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach()),
                             persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # the model's tokens are flat: no reshapes on the hot path
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and weight.dim() == 2 and packing_available())


def pack_linears(module: nn.Module) -> int:
    """Replace every CPU bfloat16 `nn.Linear` below `module` by a `PackedLinear`, in place.
    Returns how many were packed (0 where packing does not apply)."""
    count = 0
    for name, child in module.named_children():
        if isinstance(child, nn.Linear) and can_pack(child.weight):
            setattr(module, name, PackedLinear.from_linear(child))
            count += 1
        else:
            count += pack_linears(child)
    return count

