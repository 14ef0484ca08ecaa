"""Weight-only quantized linear layers for CPU decoding: opt-in transformations of a finished
model (engine.fastpath, `quantize="int8"` or `"int4"`).

A decode step on CPU streams every weight once for one token, so its matmuls are bound by memory
bandwidth: fewer bits per weight are fewer bytes to read.

int8 (`Int8Linear`): each output row's weights get one float32 scale, w ~ q * scale with q in
-127..127 and scale = max |w| / 127 (symmetric, per channel). Rows of a decode step or a verify
block go through agentflash's int8 CPU kernel (kernels.cpu_ops.linear_int8: half the bytes of
bfloat16, every row computed the same way whatever the call, so speculative output equals the
quantized model's own plain output); more rows (prefill chunks) are a bfloat16 matmul on the
int8 values scaled after it where the CPU has native bf16, else float32 on the weight
dequantized for the call. The model's head gets an int8 copy of its matrix too (tied
embeddings keep theirs for the lookup): at Qwen3-0.6B's size it is a quarter of the weights.

int4 (`Int4Linear`): four bits per weight instead of sixteen is a quarter of the bytes. torch's
CPU int4 matmul (`aten._weight_int4pack_mm_for_cpu`) reads 0.6B-shaped layer weights at 69 GB/s bf16
equivalent for one row, against 24 GB/s for oneDNN's packed bf16 (2-core EPYC; docs/
performance.md); for 16 rows it is slower than bf16 (10 against 18 GB/s), so verifying drafts
costs more in plain steps than it does in bf16.

Quantization is group-wise asymmetric, as torch's kernel expects: each row's weights in groups
of `group_size` along the input dimension get a bf16 scale and zero point (w ~ (q - 8) * scale +
zero, q in 0..15) from the group's min and max. The kernel's rows do not depend on how many
rows share the call (tests/test_quantized.py), so speculative output equals the quantized
model's own plain output. A layer whose shape the kernel does not take (output features not a
multiple of 16, input features not a multiple of the group size) is left as it was.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from agentflash.kernels import cpu_ops

from ..device import cpu_has_native_bf16
from .kernel_linear import WIDEN_ROWS

GROUP_SIZE = 128


def int4_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def quantize_weight(weight: torch.Tensor, group_size: int = GROUP_SIZE
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K] int32 in 0..15, scales_zeros [K // group_size, N, 2] bf16) of a weight [N, K]."""
    n, k = weight.shape
    w = weight.detach().float().view(n, k // group_size, group_size)
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    # the kernel computes (q - 8) * scale + zero with bf16 scale and zero: round them first and
    # pick each q against the rounded pair
    scale = ((high - low) / 15).clamp(min=1e-30).to(torch.bfloat16).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group
    zero = (low + 8 * scale).to(torch.bfloat16).float()
    q = ((w - zero) / scale + 8).round().clamp(0, 15).to(torch.int32).view(n, k)
    scales_zeros = torch.cat([scale, zero], -1).transpose(0, 1).contiguous()
    return q, scales_zeros.to(torch.bfloat16)


def dequantize(q: torch.Tensor, scales_zeros: torch.Tensor, group_size: int = GROUP_SIZE
               ) -> torch.Tensor:
    """The float32 weight [N, K] that `quantize_weight`'s output stands for."""
    n, k = q.shape
    scale, zero = scales_zeros.float().transpose(0, 1).unbind(-1)          # [N, K / g] each
    w = (q.view(n, k // group_size, group_size).float() - 8) * scale[..., None] + zero[..., None]
    return w.view(n, k)


def fits(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> bool:
    n, k = weight.shape
    return weight.device.type == "cpu" and n % 16 == 0 and k % group_size == 0


class Int4Linear(nn.Module):
    """y = x W^T + b with W as 4-bit groups (CPU; bfloat16 activations; inference only)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 group_size: int = GROUP_SIZE) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.group_size = group_size
        q, scales_zeros = quantize_weight(weight, group_size)
        # buffers in the state dict: what a compiled program's cache key reads (engine.compiled)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        self.register_buffer("scales_zeros", scales_zeros)
        self.register_buffer("bias", None if bias is None else bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size,
                                                         self.scales_zeros)
        if self.bias is not None:
            out = out + self.bias
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int4, group_size={self.group_size}")


def quantize_linears_int4(module: nn.Module, group_size: int = GROUP_SIZE) -> int:
    """Replace every `nn.Linear` below `module` whose shape the kernel takes by an
    `Int4Linear`, in place; returns how many were replaced."""
    count = 0
    for name, child in module.named_children():
        if isinstance(child, nn.Linear) and fits(child.weight, group_size):
            setattr(module, name, Int4Linear(child.weight, child.bias, group_size))
            count += 1
        else:
            count += quantize_linears_int4(child, group_size)
    return count



def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K] int8 in -127..127, scale [N] float32) with weight ~ q * scale[:, None]."""
    w = weight.detach().float()
    scale = w.abs().amax(1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row
    q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    """y = x W^T + b with W as int8 rows and a float32 scale per row (CPU; bfloat16
    activations; inference only): the kernel for up to `kernel_rows` rows (None: every call),
    a matmul for more (module docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 kernel_rows: int | None = WIDEN_ROWS) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.kernel_rows = kernel_rows
        q, scale = quantize_int8(weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel_rows is None or x.numel() <= self.kernel_rows * self.in_features:
            return cpu_ops.linear_int8(x, self.qweight, self.scale, self.bias)
        if x.dtype == torch.bfloat16 and cpu_has_native_bf16():
            # a bf16 matmul on the int8 values (exact in bf16), scaled after: 3x float32's
            # speed at 512 rows on AVX512-BF16 (the product rounded to bf16 once more)
            y = F.linear(x, self.qweight.to(x.dtype)).float() * self.scale
        else:
            weight = self.qweight * self.scale[:, None]  # float32 by promotion: one pass
            y = F.linear(x.float(), weight)
        return (y if self.bias is None else y + self.bias).to(x.dtype)

    def kernel_only(self) -> Int8Linear:
        """The same layer (sharing its buffers) with every call through the kernel: what a
        decode/verify forward computes its rows with (engine.forward)."""
        clone = copy.copy(self)
        clone.kernel_rows = None
        return clone

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_linears_int8(module: nn.Module) -> int:
    """Replace every `nn.Linear` below `module` by an `Int8Linear`, in place; returns how many
    were replaced."""
    count = 0
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8Linear(child.weight, child.bias))
            count += 1
        else:
            count += quantize_linears_int8(child)
    return count
