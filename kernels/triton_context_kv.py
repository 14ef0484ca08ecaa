"""Triton store of the drafter's context K/V (same contract as `reference.store_context_kv`).

After the one matmul that projects the context features for every drafter layer, each layer's
keys still need k_norm, RoPE at their positions and a scatter into their pages, and the values a
scatter: six or more torch ops per layer. Here it is one launch per layer, one program per
(token, KV head): load the head's key, normalise it in float32, rotate it, store both into the
token's slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_context_kv_kernel(
    k_ptr, v_ptr, w_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, kc_ptr, vc_ptr,
    eps,
    s_kt, s_kh, s_kd,
    s_vt, s_vh, s_vd,
    s_ct, s_st,
    s_kcs, s_kch, s_kcd,
    s_vcs, s_vch, s_vcd,
    HAS_NORM: tl.constexpr, HALF: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + t)
    slot = tl.load(slot_ptr + t)
    x1 = tl.load(k_ptr + t * s_kt + h * s_kh + offs * s_kd).to(tl.float32)
    x2 = tl.load(k_ptr + t * s_kt + h * s_kh + (offs + HALF) * s_kd).to(tl.float32)
    if HAS_NORM:
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + eps)
        x1 = tl.load(w_ptr + offs).to(tl.float32) * (x1 * inv)
        x2 = tl.load(w_ptr + offs + HALF).to(tl.float32) * (x2 * inv)
    cos = tl.load(cos_ptr + pos * s_ct + offs)
    sin = tl.load(sin_ptr + pos * s_st + offs)
    dtype = kc_ptr.dtype.element_ty
    out = kc_ptr + slot * s_kcs + h * s_kch
    tl.store(out + offs * s_kcd, (x1 * cos - x2 * sin).to(dtype))
    tl.store(out + (offs + HALF) * s_kcd, (x2 * cos + x1 * sin).to(dtype))
    val = v_ptr + t * s_vt + h * s_vh
    dst = vc_ptr + slot * s_vcs + h * s_vch
    tl.store(dst + offs * s_vcd, tl.load(val + offs * s_vd).to(dtype))
    tl.store(dst + (offs + HALF) * s_vcd, tl.load(val + (offs + HALF) * s_vd).to(dtype))


def store_context_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    cos_half: torch.Tensor,
    sin_half: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """Same contract as `reference.store_context_kv`; the key's arithmetic stays in float32 and
    is rounded once, where the reference rounds after each op in 16-bit dtypes."""
    tokens, heads, head_dim = k.shape
    half = head_dim // 2
    assert half >= 1 and half & (half - 1) == 0, f"head_dim {head_dim}: need a power of two"
    assert cos_half.stride(1) == 1 and sin_half.stride(1) == 1
    if tokens == 0:
        return
    weight = norm_weight if norm_weight is not None else cos_half  # never read without a norm
    _store_context_kv_kernel[(tokens, heads)](
        k, v, weight.contiguous(), cos_half, sin_half, positions.contiguous(), slots.contiguous(),
        k_cache, v_cache, eps,
        *k.stride(), *v.stride(), cos_half.stride(0), sin_half.stride(0),
        *k_cache.stride(), *v_cache.stride(),
        HAS_NORM=norm_weight is not None, HALF=half,
    )
