"""Rotary position embeddings (default, linear, llama3, yarn) with transformers' exact numerics.

Inverse frequencies are computed on the CPU in float32 with the same operations, in the same order,
as transformers 5's `modeling_rope_utils` (so scaled variants agree bit for bit), then cos/sin are
tabulated for positions [0, max_positions) as `cos(pos * inv_freq) * attention_factor` in float32,
exactly as HF's rotary module computes them per forward. The tables are non-persistent buffers:
a model built on the `meta` device must call `RotaryEmbedding.build(device)` after loading.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from ..config import RopeConfig

# rope_type -> fn(rope, head_dim, max_position_embeddings) -> (inv_freq, attention factor)
InvFreqFn = Callable[[RopeConfig, int, int], tuple[torch.Tensor, float]]


def _default(rope: RopeConfig, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    exponents = torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim
    return 1.0 / (rope.theta**exponents), 1.0


def _linear(rope: RopeConfig, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    inv_freq, _ = _default(rope, dim, max_pos)
    return inv_freq / rope.factor, 1.0


def _llama3(rope: RopeConfig, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    inv_freq, _ = _default(rope, dim, max_pos)
    factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    old_context_len = rope.original_max_position_embeddings or max_pos
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are divided by factor, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    base, factor = rope.theta, rope.factor
    original = rope.original_max_position_embeddings or max_pos
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(
                factor, rope.mscale_all_dim
            )
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    pairs = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = torch.clamp((pairs - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # weight of the unscaled frequency, per dimension pair

    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").to(dtype=torch.float) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    inv_freq = inv_freq_interpolation * (1 - extrapolation) + inv_freq_extrapolation * extrapolation
    return inv_freq, float(attention_factor)


INV_FREQ: dict[str, InvFreqFn] = {
    "default": _default,
    "linear": _linear,
    "llama3": _llama3,
    "yarn": _yarn,
}


def inv_freq_and_scale(
    rope: RopeConfig, head_dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32, CPU, [head_dim // 2]) and the factor applied to cos/sin.

    Like transformers, a missing original_max_position_embeddings means max_position_embeddings.
    """
    return INV_FREQ[rope.rope_type](rope, head_dim, max_position_embeddings)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions [0, max_positions); positions past the end are not valid."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_position_embeddings: int) -> None:
        super().__init__()
        self.rope = rope
        self.head_dim = head_dim
        self.max_positions = max_position_embeddings
        self.cos_half: torch.Tensor
        self.sin_half: torch.Tensor
        self.build()

    def build(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the tables on `device` (default: the current default device, e.g. meta)."""
        inv_freq, scale = inv_freq_and_scale(self.rope, self.head_dim, self.max_positions)
        positions = torch.arange(self.max_positions, device=device).float()
        freqs = positions[:, None] * inv_freq.to(positions.device)
        # Only half is stored: HF's table is cat((freqs, freqs)), so both halves are identical.
        self.register_buffer("cos_half", freqs.cos() * scale, persistent=False)
        self.register_buffer("sin_half", freqs.sin() * scale, persistent=False)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] for `positions` [T], cast to `dtype` (HF casts to the model's)."""
        cos, sin = self.cos_half[positions], self.sin_half[positions]
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        if dtype is not None:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by cos/sin [T, D] (rotate_half convention of HF Llama/Qwen3)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return (x * cos) + (rotate_half(x) * sin)
