"""Weight-only int8 linear layers for CPU decoding: an opt-in transformation of a finished model
(engine.cpu.fastpath, `quantize="int8"`).

A decode step on CPU streams every weight once for one token, so its matmuls are bound by memory
bandwidth: fewer bytes per weight are fewer bytes to read.

`Int8Linear`: each output row's weights get one float32 scale, w ~ q * scale with q in -127..127
and scale = max |w| / 127 (symmetric, per channel). Rows of a decode step or a verify block go
through agentflash's int8 CPU kernel (kernels.cpu_ops.linear_int8: half the bytes of bfloat16,
every row computed the same way whatever the call, so speculative output equals the quantized
model's own plain output); more rows (prefill chunks) are a bfloat16 matmul on the int8 values
scaled after it where oneDNN's bf16 matmuls run, else float32 on the weight dequantized for the
call. The model's head gets an int8 copy of its matrix too (tied embeddings keep theirs for the
lookup): at Qwen3-0.6B's size it is a quarter of the weights.

`quantize_drafter_int8` does the same to a DFlash drafter, whose numbers only decide which
drafts are proposed: engine.cpu.fastpath's `int8-drafter`, on by default where the kernels run
(except on AMX tiles, where bfloat16 linears are faster at every row count). Its
layers are `dynamic`: their kernel rows quantize x to 16-bit integers too and sum the products in
int32 (kernels.cpu_ops.linear_int8, dynamic): 1.3-2.9x the float32 kernel's speed on a
drafter's 1-15 rows when its weights are in cache, about the same at 1-2 rows from memory; a
drafter's numbers may move, never the output.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from agentflash.kernels import cpu_ops

from ..models.dflash import DFlashDraftModel
from .bucketed import bucketed_linear
from .kernel_linear import WIDEN_ROWS
from .packed import packing_available


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
    a matmul for more (module docstring). dynamic: the kernel quantizes x's rows to 16-bit
    integers too (a drafter's layers)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 kernel_rows: int | None = WIDEN_ROWS, dynamic: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.kernel_rows = kernel_rows
        self.dynamic = dynamic
        q, scale = quantize_int8(weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self._widened: torch.Tensor | None = None

    def widen(self) -> None:
        """Keep the float32 weight the matmul of many rows computes with (4x the int8 bytes)
        instead of dequantizing it every call: the same numbers, without a pass over the
        weight per prefill chunk (1.3 ms for a 384 x 1152 drafter projection on AVX2)."""
        self._widened = self.qweight * self.scale[:, None]

    @property
    def first_bucketed_rows(self) -> int | None:
        """The fewest rows whose matmul is bucketed (engine.cpu.bucketed.warm_buckets), or None
        where none is."""
        if self.kernel_rows is None or not packing_available():
            return None
        return self.kernel_rows + 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel_rows is None or x.numel() <= self.kernel_rows * self.in_features:
            return cpu_ops.linear_int8(x, self.qweight, self.scale, self.bias, self.dynamic)
        if x.dtype == torch.bfloat16 and packing_available():
            # where oneDNN's bf16 matmuls run (as bf16 prefill's do, engine.cpu.fastpath): on the
            # int8 values (exact in bf16), scaled after; 2.6-3.4x float32's speed at 512 rows on
            # AVX512-BF16 (the product rounded to bf16 once more)
            # (rows padded: engine.cpu.bucketed)
            flat = x.reshape(-1, self.in_features)
            y = bucketed_linear(flat, self.qweight.to(x.dtype)).view(*x.shape[:-1], -1)
            y = y.float() * self.scale
        else:
            weight = self._widened
            if weight is None:
                weight = self.qweight * self.scale[:, None]  # float32 by promotion: one pass
            y = F.linear(x.float(), weight)
        return (y if self.bias is None else y + self.bias).to(x.dtype)

    def kernel_only(self) -> Int8Linear:
        """The same layer (sharing its buffers) with every call through the kernel: what a
        decode/verify forward computes its rows with (engine.cpu.forward)."""
        clone = copy.copy(self)
        clone.kernel_rows = None
        return clone

    def dynamic_view(self) -> Int8Linear:
        """The same layer (sharing its buffers), `dynamic`: an int8 target's head as its
        drafter drafts with it."""
        clone = copy.copy(self)
        clone.dynamic = True
        return clone

    def extra_repr(self) -> str:
        x = ", x as int16" if self.dynamic else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, int8{x}"


def quantize_linears_int8(module: nn.Module, dynamic: bool = False) -> int:
    """Replace every `nn.Linear` below `module` by an `Int8Linear`, in place; returns how many
    were replaced."""
    count = 0
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8Linear(child.weight, child.bias, dynamic=dynamic))
            count += 1
        else:
            count += quantize_linears_int8(child, dynamic)
    return count


def quantize_drafter_int8(drafter: DFlashDraftModel) -> None:
    """Every linear of a DFlash drafter as a dynamic `Int8Linear`, in place, its context K/V
    rows (the K and V rows of each layer's qkv_proj, which the target's steps project every
    committed token with) first given linears of their own."""
    if drafter.context_kv_proj is None:
        drafter.context_kv_proj = nn.ModuleList(
            Int8Linear(*drafter.context_kv_rows(i), dynamic=True)
            for i in range(len(drafter.layers)))
    quantize_linears_int8(drafter, dynamic=True)
