"""Linear layers through agentflash's CPU kernel (kernels.cpu_ops.linear).

`KernelLinear` computes `nn.Linear`'s forward through the kernel, on the same weight and bias
tensors (no copy, no packed layout). `with_kernel_linears` gives a copy of a model that shares
every parameter and has each linear computed that way: what engine.compiled traces its
programs from, so the decode and verify rows of a compiled step read the checkpoint's weights
through the kernel while the eager model (prefill) keeps its own linears.

`swap_linears` puts `KernelLinear`s in a finished model in place: on CPUs without native bf16
matmuls (AVX2), where torch emulates them at a fraction of its float32 speed, every bfloat16
linear of the eager model runs the kernel, prefill included. Its rows do not depend on the
call at any row count, and greedy speculative output equals plain output only if prefill rows
do not either (a speculative run cuts its prompts into other prefill chunks than a plain one:
float32 matmuls on the widened weight were measured to part them).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from agentflash.kernels import cpu_ops


class KernelLinear(nn.Module):
    """y = x W^T + b through the CPU kernel (bfloat16, CPU)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_ops.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel"


def with_kernel_linears(module: nn.Module) -> nn.Module:
    """A copy of `module` sharing every parameter, with each `nn.Linear` below it (itself
    included) a `KernelLinear`; `module` is unchanged."""
    if isinstance(module, nn.Linear):
        return KernelLinear(module.weight, module.bias)
    clone = copy.copy(module)
    clone._modules = {name: None if child is None else with_kernel_linears(child)
                      for name, child in module._modules.items()}
    return clone


def swap_linears(module: nn.Module) -> int:
    """Replace every bfloat16 `nn.Linear` below `module` by a `KernelLinear` on the same
    tensors, in place. Returns how many were replaced."""
    count = 0
    for name, child in module.named_children():
        if isinstance(child, nn.Linear) and child.weight.dtype == torch.bfloat16:
            setattr(module, name, KernelLinear(child.weight, child.bias))
            count += 1
        else:
            count += swap_linears(child)
    return count
