"""Triton verification of drafted blocks (same contracts as `reference.accept_greedy` and
`reference.accept_sample`): one launch for the whole batch, one program per sequence, the
result left on the device, so the engine syncs with the host once per step, not per draft.

Each program walks its drafts in order and stops at the first rejection, so it reads only the
rows it needs: greedy takes the argmax of at most accepted + 1 rows, tile by tile over the
vocabulary; sampling reads one probability per draft and inverts one row's cumulative sum
(with a draft distribution q over K tokens, a DFlash2 selector's: minus q at the rejection).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 1024  # vocabulary entries per tile
Q_BLOCK_V = 256  # with a draft distribution: each tile compares against its K tokens too


@triton.jit
def _row_argmax(row_ptr, vocab, BLOCK_V: tl.constexpr):
    """First index of the row's maximum: per-lane running maxima (strict >, so the earliest
    tile wins a tie), then the smallest index among the lanes holding the global maximum."""
    offs = tl.arange(0, BLOCK_V)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    where = tl.zeros([BLOCK_V], tl.int64)
    for start in range(0, vocab, BLOCK_V):
        idx = start + offs
        x = tl.load(row_ptr + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
        better = x > best
        best = tl.where(better, x, best)
        where = tl.where(better, idx.to(tl.int64), where)
    top = tl.max(best, axis=0)
    return tl.min(tl.where(best == top, where, vocab), axis=0)


@triton.jit
def _accept_greedy_kernel(
    logits_ptr, row_start_ptr, num_drafts_ptr, drafts_ptr, out_ptr,
    vocab, s_lr, s_dn, s_dk,
    BLOCK_V: tl.constexpr,
):
    n = tl.program_id(0)
    row0 = tl.load(row_start_ptr + n)
    num = tl.load(num_drafts_ptr + n)
    k = num * 0
    bonus = num * 0
    going = num >= 0
    while going:
        bonus = _row_argmax(logits_ptr + (row0 + k) * s_lr, vocab, BLOCK_V)
        draft = tl.load(drafts_ptr + n * s_dn + k * s_dk, mask=k < num, other=-1)
        going = (k < num) & (draft == bonus)
        k += going.to(k.dtype)
    tl.store(out_ptr + 2 * n, k)
    tl.store(out_ptr + 2 * n + 1, bonus)


@triton.jit
def _accept_sample_kernel(
    probs_ptr, row_start_ptr, num_drafts_ptr, drafts_ptr, u_ptr, qp_ptr, qi_ptr, out_ptr,
    vocab, top, s_pr, s_dn, s_dk, s_un, s_uk, s_qn, s_qk, s_qj,
    HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Without HAS_Q each draft's q is one-hot (lane 0: the draft, mass 1); with it, the
    `top` tokens q_ids and their masses q_probs."""
    n = tl.program_id(0)
    row0 = tl.load(row_start_ptr + n)
    num = tl.load(num_drafts_ptr + n)
    lanes = tl.arange(0, BLOCK_K)
    k = num * 0
    going = num >= 0
    while going:
        live = k < num
        draft = tl.load(drafts_ptr + n * s_dn + k * s_dk, mask=live, other=0)
        p = tl.load(probs_ptr + (row0 + k) * s_pr + draft, mask=live, other=0.0)
        ids, qp = _draft_q(drafts_ptr, qp_ptr, qi_ptr, n, k, num, top, s_dn, s_dk, s_qn, s_qk,
                           s_qj, lanes, HAS_Q)
        q = tl.sum(tl.where(ids == draft, qp, 0.0), axis=0)
        u = tl.load(u_ptr + n * s_un + k * s_uk, mask=live, other=2.0)
        going = live & (u * q < p)
        k += going.to(k.dtype)

    # the bonus: max(row k - q, 0) after a rejection (row k where that is all zero)
    ids, qp = _draft_q(drafts_ptr, qp_ptr, qi_ptr, n, k, num, top, s_dn, s_dk, s_qn, s_qk,
                       s_qj, lanes, HAS_Q)
    row_ptr = probs_ptr + (row0 + k) * s_pr
    offs = tl.arange(0, BLOCK_V)
    left = 0.0
    total = 0.0
    for start in range(0, vocab, BLOCK_V):
        idx = start + offs
        p = tl.load(row_ptr + idx, mask=idx < vocab, other=0.0)
        taken = tl.sum(tl.where(idx[:, None] == ids[None, :], qp[None, :], 0.0), axis=1)
        left += tl.sum(tl.maximum(p - taken, 0.0), axis=0)
        total += tl.sum(p, axis=0)
    residual = left > 0
    target = tl.load(u_ptr + n * s_un + num * s_uk) * tl.where(residual, left, total)
    pick = vocab + num * 0
    last = num * 0
    mass = 0.0
    for start in range(0, vocab, BLOCK_V):
        idx = start + offs
        p = tl.load(row_ptr + idx, mask=idx < vocab, other=0.0)
        taken = tl.sum(tl.where(idx[:, None] == ids[None, :], qp[None, :], 0.0), axis=1)
        p = tl.where(residual, tl.maximum(p - taken, 0.0), p)
        cdf = mass + tl.cumsum(p, axis=0)
        pick = tl.minimum(pick, tl.min(tl.where(cdf > target, idx, vocab), axis=0))
        last = tl.maximum(last, tl.max(tl.where(p > 0, idx, 0), axis=0))
        mass += tl.sum(p, axis=0)
    tl.store(out_ptr + 2 * n, k)
    tl.store(out_ptr + 2 * n + 1, tl.minimum(pick, last))


@triton.jit
def _draft_q(drafts_ptr, qp_ptr, qi_ptr, n, k, num, top, s_dn, s_dk, s_qn, s_qk, s_qj, lanes,
             HAS_Q: tl.constexpr):
    """Draft k's distribution as (token ids, masses) over the lanes; nothing (ids -1) past
    the drafts."""
    live = (lanes * 0 + k < num) & (lanes < top)
    if HAS_Q:
        at = n * s_qn + k * s_qk + lanes * s_qj
        ids = tl.load(qi_ptr + at, mask=live, other=-1)
        qp = tl.load(qp_ptr + at, mask=live, other=0.0)
    else:
        draft = tl.load(drafts_ptr + n * s_dn + k * s_dk + lanes * 0, mask=live, other=-1)
        ids = tl.where(live, draft, -1)
        qp = tl.where(live, 1.0, 0.0)
    return ids, qp


def _out(drafts: torch.Tensor) -> torch.Tensor:
    return torch.empty(drafts.shape[0], 2, dtype=torch.int64, device=drafts.device)


def accept_greedy(
    logits: torch.Tensor, row_start: torch.Tensor, num_drafts: torch.Tensor, drafts: torch.Tensor
) -> torch.Tensor:
    """Same contract as `reference.accept_greedy`."""
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    out = _out(drafts)
    if out.numel():
        _accept_greedy_kernel[(drafts.shape[0],)](
            logits, row_start.contiguous(), num_drafts.contiguous(), drafts, out,
            logits.shape[1], logits.stride(0), *drafts.stride(), BLOCK_V=BLOCK_V,
        )
    return out


def accept_sample(
    probs: torch.Tensor,
    row_start: torch.Tensor,
    num_drafts: torch.Tensor,
    drafts: torch.Tensor,
    uniforms: torch.Tensor,
    q_probs: torch.Tensor | None = None,
    q_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `reference.accept_sample`."""
    assert probs.dtype == torch.float32 and probs.stride(1) == 1
    out = _out(drafts)
    if not out.numel():
        return out
    has_q = q_probs is not None
    if has_q:
        assert q_ids is not None and q_probs.shape == q_ids.shape
        q_probs = q_probs.float()
    else:
        q_probs = q_ids = torch.empty(0, 0, 1, device=probs.device)
    _accept_sample_kernel[(drafts.shape[0],)](
        probs, row_start.contiguous(), num_drafts.contiguous(), drafts, uniforms, q_probs,
        q_ids, out, probs.shape[1], q_probs.shape[2], probs.stride(0), *drafts.stride(),
        *uniforms.stride(), *q_probs.stride(), HAS_Q=has_q,
        BLOCK_V=Q_BLOCK_V if has_q else BLOCK_V,
        BLOCK_K=triton.next_power_of_2(max(q_probs.shape[2], 2)),
    )
    return out
