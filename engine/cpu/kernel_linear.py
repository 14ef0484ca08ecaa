"""Linear layers through agentflash's CPU kernel (kernels.cpu_ops.linear).

`KernelLinear` computes `nn.Linear`'s forward through the kernel, on the same weight and bias
tensors (where the kernels prefer float32 products, on a copy of the weight packed in panels).
`with_kernel_linears` gives a copy of a model that shares every parameter and has each linear
computed that way: what engine.cpu.compiled traces its programs from, so the rows of a
compiled step go through the kernel while the eager model keeps its own linears.

`WidenedLinear` is the eager bfloat16 linear for CPUs without native bf16 matmuls (AVX2), where
torch emulates them at a fifth of its float32 speed: few rows go through the kernel, more rows
(prefill chunks) are computed in float32 on the weight widened for the call (~1.6x the kernel's
throughput at 512 rows; widening costs about what 64 rows of the kernel do) and rounded once to
bfloat16. Which one a row takes depends on the call's row count, so a caller that needs a row's
numbers to be the same in every run calls it with rows cut the same way (engine.runner runs each
prefill chunk alone; the scheduler cuts prompts at fixed positions). `swap_linears` puts them
(or `KernelLinear`s, for a model that needs every row independent of the call) in a finished
model in place.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from agentflash.kernels import cpu_ops


class KernelLinear(nn.Module):
    """y = x W^T + b through the CPU kernel (bfloat16, CPU). Where the kernels prefer float32
    products (kernels.cpu_ops.prefer_float32), W is also packed once into `linear_panels`'
    layout (`panels`: the same bytes again) and every call takes it; else `linear` reads W in
    place."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.bias = bias
        panels = None
        if cpu_ops.prefer_float32() and weight.dtype == torch.bfloat16:
            panels = cpu_ops.pack_panels(weight.detach())
        self.register_buffer("panels", panels, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            return cpu_ops.linear_panels(x, self.panels, self.out_features, self.bias)
        return cpu_ops.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        kind = "panels" if self.panels is not None else "kernel"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}"


WIDEN_ROWS = 64
"""A `WidenedLinear` call of more rows than this computes in float32 (else the kernel)."""


PACK_ROWS = 512
"""The row count a packed float32 weight's layout is chosen for (a prefill chunk's, by default)."""


def float32_packing_available() -> bool:
    """oneDNN float32 matmuls on prepacked weights exist in this torch build."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                            "_reorder_linear_weight")


class WidenedLinear(KernelLinear):
    """y = x W^T + b in bfloat16 on a CPU without bf16 matmuls: the kernel for few rows,
    float32 on the widened weight for many (inference). After `pack()`, the float32 weight is
    kept, reordered once into oneDNN's blocked layout (twice the bf16 weight's memory; 1.05-1.15x
    the throughput of widening per call at 296-512 rows on AVX2), instead of widened per call."""

    _packed: torch.Tensor | None = None
    _bias: torch.Tensor | None = None

    def pack(self) -> None:
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.float(), PACK_ROWS)
        self._bias = None if self.bias is None else self.bias.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= WIDEN_ROWS * self.in_features:
            return super().forward(x)  # the kernel (its panels, where it packed them)
        if self._packed is not None:
            flat = x.reshape(-1, self.in_features).float()
            out = torch.ops.mkldnn._linear_pointwise(flat, self._packed, self._bias, "none",
                                                     [], "")
            return out.view(*x.shape[:-1], self.out_features).to(x.dtype)
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)

    def kernel_only(self) -> KernelLinear:
        return KernelLinear(self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, widened"


def with_kernel_linears(module: nn.Module) -> nn.Module:
    """A copy of `module` sharing every parameter, with each `nn.Linear` below it (itself
    included) a `KernelLinear` and each layer that takes a call's row count into account (a
    `WidenedLinear`, engine.cpu.quantized's `Int8Linear`, engine.cpu.bucketed's
    `BucketedLinear`) its `kernel_only()` self;
    `module` is unchanged."""
    if isinstance(module, nn.Linear):
        return KernelLinear(module.weight, module.bias)
    if hasattr(module, "kernel_only"):
        return module.kernel_only()
    clone = copy.copy(module)
    clone._modules = {name: None if child is None else with_kernel_linears(child)
                      for name, child in module._modules.items()}
    return clone


def swap_linears(module: nn.Module,
                 kind: Callable[[torch.Tensor, torch.Tensor | None], nn.Module] = WidenedLinear
                 ) -> int:
    """Replace every bfloat16 `nn.Linear` below `module` by `kind(weight, bias)` on the same
    tensors, in place. Returns how many were replaced."""
    count = 0
    for name, child in module.named_children():
        if isinstance(child, nn.Linear) and child.weight.dtype == torch.bfloat16:
            setattr(module, name, kind(child.weight, child.bias))
            count += 1
        else:
            count += swap_linears(child, kind)
    return count
