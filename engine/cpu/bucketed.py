"""Linear layers that round their row count up for oneDNN: the CPU bfloat16 prefill path beside
a decode forward (compiled, or eager on the CPU kernels).

oneDNN builds (JIT-compiles) a kernel for every matmul shape it meets and caches it; a new row
count costs ~1 ms a layer shape (AMX Xeon, 2 threads: the embedded model's 24 layer linears 8.7
ms at a row count they had not seen, 3.5 ms at one they had). Prefill chunks come in every
length (each prompt's new tokens), so each chunk paid for new kernels. `BucketedLinear` (and,
through `bucketed_linear`, the prefill matmul of engine.cpu.quantized's int8 layers) pads x with
zero rows to the next multiple of `ROW_BUCKET` and drops them from the output: 16 shapes a layer
at the scheduler's default 512-token chunks. Each chunk length always takes the same padded
shape, so a prompt's numbers are the same in every run. `warm_buckets` builds every bucket's
kernels when the engine is made (0.17 s for the embedded model and its drafter), so that no
request pays for them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .kernel_linear import KernelLinear

ROW_BUCKET = 32


def bucketed_linear(x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for 2-D x, computed on x's rows padded with zero rows to a
    multiple of ROW_BUCKET."""
    rows = x.shape[0]
    padded = -(-rows // ROW_BUCKET) * ROW_BUCKET
    if padded == rows:
        return F.linear(x, weight, bias)
    return F.linear(F.pad(x, (0, 0, 0, padded - rows)), weight, bias)[:rows]


class BucketedLinear(nn.Module):
    """y = x W^T + b on W as it is (no copy), x's rows padded to a multiple of ROW_BUCKET."""

    first_bucketed_rows = 1  # every call is bucketed (warm_buckets)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.detach(), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = bucketed_linear(x.reshape(-1, self.in_features), self.weight, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def kernel_only(self) -> KernelLinear:
        """The same layer through the CPU kernel: what a decode/verify forward made from a model
        an earlier engine prepared computes its rows with (engine.cpu.kernel_linear)."""
        return KernelLinear(self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"rows in {ROW_BUCKET}s")


def warm_buckets(modules: list[nn.Module], max_rows: int) -> int:
    """Run each distinct layer shape below `modules` whose forward pads rows into buckets (a
    `first_bucketed_rows` attribute: the fewest rows it pads; `BucketedLinear`, and
    engine.cpu.quantized's `Int8Linear` past its kernel rows) once at every bucket up to
    `max_rows` rows, on zeros: oneDNN then has every kernel a prefill chunk needs. Returns the
    number of calls made."""
    seen: set[tuple[type, int, int]] = set()
    calls = 0
    with torch.inference_mode():
        for module in (m for root in modules for m in root.modules()):
            least = getattr(module, "first_bucketed_rows", None)
            key = (type(module), getattr(module, "in_features", 0),
                   getattr(module, "out_features", 0))
            if least is None or key in seen:
                continue
            seen.add(key)
            for rows in range(ROW_BUCKET, max_rows + ROW_BUCKET, ROW_BUCKET):
                if rows >= least:
                    module(torch.zeros(rows, module.in_features, dtype=torch.bfloat16))
                    calls += 1
    return calls
