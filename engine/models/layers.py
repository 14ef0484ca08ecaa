"""Building blocks shared by the target and drafter models: RMSNorm and the SiLU-gated MLP.

Both reproduce transformers' numerics (RMSNorm statistics in float32, cast back before the weight
multiply) and store projections fused (`gate_up_proj` = [gate; up] rows) so one matmul serves both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = weight * (x / rms(x)), the normalisation computed in float32 as HF Llama/Qwen3 do."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, self.weight)

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """This norm over x's last dimension with another `weight` (broadcast against x)."""
        if x.dtype == torch.float32:  # one fused op (the float32 path runs every CPU decode step)
            return weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)
        h = F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=self.eps)
        return weight * h.to(x.dtype)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one [2 * inter, hidden] weight."""

    def __init__(self, hidden: int, inter: int, bias: bool) -> None:
        super().__init__()
        self.inter = inter
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)
