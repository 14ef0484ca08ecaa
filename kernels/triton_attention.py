"""Triton versions of the attention kernels in reference.py (same signatures, same semantics).

Both are flash-attention loops: one program per (sequence, query head, tile of queries) walks the
keys a tile at a time with an online softmax in float32 and stores the rows in q's dtype.
- `paged_attention`: keys come from the caches through each sequence's slot list `gather`; the
  visibility comes from the given boolean mask tile.
- `draft_attention`: keys are the sequence's valid context then the block's own keys; the
  visibility (length, causal, window) is computed from positions inside the kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_Q = 16   # queries per program (tl.dot needs >= 16 rows)
BLOCK_N = 32   # keys per loop step
# Masked scores are -inf while the running max starts finite: a tile with no visible key for a
# row then adds exp(-inf) = 0 and leaves the max alone, so no -inf - -inf NaN ever appears.
_M_INIT = tl.constexpr(-1.0e30)


@triton.jit
def _online_step(acc, m_i, l_i, q, k, v, visible, scale, PRECISION: tl.constexpr):
    """Fold one key tile into the running (acc, max, sum) of a query tile."""
    if PRECISION == "ieee":
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, gather_ptr, q_index_ptr, mask_ptr, out_ptr,
    scale, n_tokens, q_len, kv_len, group,
    s_qt, s_qh, s_qd,
    s_ks, s_kh, s_kd,
    s_vs, s_vh, s_vd,
    s_gb, s_gl,
    s_ib, s_iq,
    s_mb, s_mq, s_ml,
    s_ot, s_oh, s_od,
    HAS_MASK: tl.constexpr, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // group
    offs_q = tl.program_id(2) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_in = offs_q < q_len
    rows = tl.load(q_index_ptr + b * s_ib + offs_q * s_iq, mask=q_in, other=n_tokens)
    real = rows < n_tokens  # padding queries (row T) load zeros and are never read back
    q = tl.load(q_ptr + rows[:, None] * s_qt + h * s_qh + offs_d[None, :] * s_qd,
                mask=real[:, None], other=0.0)
    if PRECISION == "ieee":
        q = q.to(tl.float32)

    acc = tl.zeros([BLOCK_Q, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_Q], _M_INIT, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    for start in range(0, kv_len, BLOCK_N):
        keys = start + offs_n
        k_in = keys < kv_len
        slots = tl.load(gather_ptr + b * s_gb + keys * s_gl, mask=k_in, other=0)
        k = tl.load(k_ptr + slots[:, None] * s_ks + kvh * s_kh + offs_d[None, :] * s_kd,
                    mask=k_in[:, None], other=0.0)
        v = tl.load(v_ptr + slots[:, None] * s_vs + kvh * s_vh + offs_d[None, :] * s_vd,
                    mask=k_in[:, None], other=0.0)
        visible = q_in[:, None] & k_in[None, :]
        if HAS_MASK:
            tile = tl.load(mask_ptr + b * s_mb + offs_q[:, None] * s_mq + keys[None, :] * s_ml,
                           mask=visible, other=0)
            visible = visible & (tile != 0)
        acc, m_i, l_i = _online_step(acc, m_i, l_i, q, k, v, visible, scale, PRECISION)

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    out_rows = b * q_len + offs_q
    tl.store(out_ptr + out_rows[:, None] * s_ot + h * s_oh + offs_d[None, :] * s_od,
             out.to(out_ptr.dtype.element_ty), mask=q_in[:, None])


@triton.jit
def _draft_attention_kernel(
    q_ptr, kc_ptr, vc_ptr, lens_ptr, kb_ptr, vb_ptr, out_ptr,
    scale, blk_len, ctx_cap, group, window,
    s_qn, s_qb, s_qh, s_qd,
    s_kcn, s_kcl, s_kch, s_kcd,
    s_vcn, s_vcl, s_vch, s_vcd,
    s_kbn, s_kbb, s_kbh, s_kbd,
    s_vbn, s_vbb, s_vbh, s_vbd,
    s_on, s_ob, s_oh, s_od,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
):
    n = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // group
    q_start = tl.program_id(2) * BLOCK_Q
    offs_q = q_start + tl.arange(0, BLOCK_Q)  # index within the block; position ctx_len + i
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_in = offs_q < blk_len
    ctx_len = tl.load(lens_ptr + n).to(tl.int32)
    ctx_len = tl.minimum(ctx_len, ctx_cap)
    q = tl.load(q_ptr + n * s_qn + offs_q[:, None] * s_qb + h * s_qh + offs_d[None, :] * s_qd,
                mask=q_in[:, None], other=0.0)
    if PRECISION == "ieee":
        q = q.to(tl.float32)

    acc = tl.zeros([BLOCK_Q, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_Q], _M_INIT, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    # Context keys j < ctx_len sit before every query, so causality always holds for them; a
    # window lets the tile's first query (position ctx_len + q_start) see only j > pos - window.
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx_len + q_start - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    for start in range(lo, ctx_len, BLOCK_N):
        keys = start + offs_n
        k_in = keys < ctx_len
        k = tl.load(kc_ptr + n * s_kcn + keys[:, None] * s_kcl + kvh * s_kch
                    + offs_d[None, :] * s_kcd, mask=k_in[:, None], other=0.0)
        v = tl.load(vc_ptr + n * s_vcn + keys[:, None] * s_vcl + kvh * s_vch
                    + offs_d[None, :] * s_vcd, mask=k_in[:, None], other=0.0)
        visible = q_in[:, None] & k_in[None, :]
        if HAS_WINDOW:
            visible = visible & ((ctx_len + offs_q)[:, None] - keys[None, :] < window)
        acc, m_i, l_i = _online_step(acc, m_i, l_i, q, k, v, visible, scale, PRECISION)

    # The block's own keys share the queries' positions: compare indices directly.
    for start in range(0, blk_len, BLOCK_N):
        keys = start + offs_n
        k_in = keys < blk_len
        k = tl.load(kb_ptr + n * s_kbn + keys[:, None] * s_kbb + kvh * s_kbh
                    + offs_d[None, :] * s_kbd, mask=k_in[:, None], other=0.0)
        v = tl.load(vb_ptr + n * s_vbn + keys[:, None] * s_vbb + kvh * s_vbh
                    + offs_d[None, :] * s_vbd, mask=k_in[:, None], other=0.0)
        visible = q_in[:, None] & k_in[None, :]
        diff = offs_q[:, None] - keys[None, :]
        if CAUSAL:
            visible = visible & (diff >= 0)
        if HAS_WINDOW:
            visible = visible & (diff < window) & (-diff < window)
        acc, m_i, l_i = _online_step(acc, m_i, l_i, q, k, v, visible, scale, PRECISION)

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    tl.store(out_ptr + n * s_on + offs_q[:, None] * s_ob + h * s_oh + offs_d[None, :] * s_od,
             out.to(out_ptr.dtype.element_ty), mask=q_in[:, None])


def _check_heads(n_heads: int, n_kv_heads: int, head_dim: int) -> int:
    assert head_dim in (16, 32, 64, 128, 256), f"head_dim {head_dim}: need a power of two 16..256"
    assert n_heads % n_kv_heads == 0, f"{n_heads} query heads over {n_kv_heads} KV heads"
    return n_heads // n_kv_heads


def _precision(q: torch.Tensor) -> str:
    """"ieee": the dots run in float32 (inputs upcast in-kernel); "tf32": in the inputs' 16-bit
    dtype with float32 accumulation. float32 inputs must not be rounded to tf32 on the GPU
    (greedy tokens would drift from the CPU's), and CPU tensors mean Triton's interpreter, whose
    tl.dot returns garbage for bfloat16 operands (triton 3.9)."""
    return "ieee" if q.dtype == torch.float32 or q.device.type == "cpu" else "tf32"


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    gather: torch.Tensor,
    q_index: torch.Tensor,
    out_index: torch.Tensor | None,
    mask: torch.Tensor | None,
    scale: float,
    plan: object = None,
) -> torch.Tensor:
    """Same contract as `reference.paged_attention` (`plan`, the reference's CPU layout, is
    not needed here)."""
    n_tokens, n_heads, head_dim = q.shape
    group = _check_heads(n_heads, k_cache.shape[1], head_dim)
    batch, q_len = q_index.shape
    kv_len = gather.shape[1]
    out = q.new_empty(batch * q_len, n_heads, head_dim)
    if out.numel() == 0:
        return out if out_index is None else out[out_index]
    if mask is None:
        mask_arg, mask_strides = gather, (0, 0, 0)  # never read
    else:
        assert mask.dtype == torch.bool and mask.shape[1] == 1
        mask_arg = mask
        mask_strides = (mask.stride(0), mask.stride(2), mask.stride(3))
    grid = (batch, n_heads, triton.cdiv(q_len, BLOCK_Q))
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, gather, q_index, mask_arg, out,
        scale, n_tokens, q_len, kv_len, group,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *gather.stride(), *q_index.stride(),
        *mask_strides, *out.stride(),
        HAS_MASK=mask is not None, HEAD_DIM=head_dim, PRECISION=_precision(q),
        BLOCK_Q=BLOCK_Q, BLOCK_N=BLOCK_N,
    )
    return out if out_index is None else out[out_index]


def draft_attention(
    q: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    ctx_lens: torch.Tensor,
    k_blk: torch.Tensor,
    v_blk: torch.Tensor,
    scale: float,
    causal: bool,
    window: int | None,
) -> torch.Tensor:
    """Same contract as `reference.draft_attention`."""
    n, blk_len, n_heads, head_dim = q.shape
    group = _check_heads(n_heads, k_blk.shape[2], head_dim)
    out = torch.empty_like(q)
    if out.numel() == 0:
        return out
    lens = ctx_lens.to(device=q.device)
    precision = _precision(q)
    grid = (n, n_heads, triton.cdiv(blk_len, BLOCK_Q))
    _draft_attention_kernel[grid](
        q, k_ctx, v_ctx, lens, k_blk, v_blk, out,
        scale, blk_len, k_ctx.shape[1], group, 0 if window is None else window,
        *q.stride(), *k_ctx.stride(), *v_ctx.stride(), *k_blk.stride(), *v_blk.stride(),
        *out.stride(),
        CAUSAL=causal, HAS_WINDOW=window is not None, HEAD_DIM=head_dim,
        PRECISION=precision, BLOCK_Q=BLOCK_Q, BLOCK_N=BLOCK_N, num_warps=_warps(precision, head_dim),
    )
    return out


def _warps(precision: str, head_dim: int) -> int:
    """Warps per program: 8 where float32 tiles of 128-wide heads would spill registers."""
    return 8 if precision == "ieee" and head_dim >= 128 else 4
