"""Oracles: what each of the engine's kernels computes, written as plainly as possible, one
sequence, query and head at a time, in float64.

Tests hold the implementations to these: the torch ops (kernels.torch_ops, the CPU path) and
the Triton kernels (in Triton's CPU interpreter, or on a GPU). Nothing in the engine calls
them: they are slow on purpose, so that each is obviously right. Inputs may live on any device;
results come back on the CPU (the stores write the caches where they are).
"""

from __future__ import annotations

import torch


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    gather: torch.Tensor, q_index: torch.Tensor, out_index: torch.Tensor | None,
                    mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """kernels.torch_ops.paged_attention (same arguments): for each query row, softmax over the
    keys its mask lets it see of q . k * scale, times their values. Padding queries (q_index
    == T) come out zero. Returns [T, Hq, D] (or [B*Q, Hq, D] with out_index None) in float64."""
    q, k_cache, v_cache, gather, q_index = (t.cpu() for t in (q, k_cache, v_cache, gather, q_index))
    mask = None if mask is None else mask.cpu()
    n_tokens, n_heads, head_dim = q.shape
    batch, q_len = q_index.shape
    group = n_heads // k_cache.shape[1]
    out = torch.zeros(batch * q_len, n_heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        for i in range(q_len):
            row = int(q_index[b, i])
            if row == n_tokens:
                continue
            seen = [j for j in range(gather.shape[1]) if mask is None or bool(mask[b, 0, i, j])]
            slots = gather[b, seen]
            for h in range(n_heads):
                k = k_cache[slots, h // group].double()
                v = v_cache[slots, h // group].double()
                weights = (k @ q[row, h].double() * scale).softmax(0)
                out[b * q_len + i, h] = weights @ v
    return out if out_index is None else out[out_index.cpu()]


def draft_attention(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                    ctx_lens: torch.Tensor, k_blk: torch.Tensor, v_blk: torch.Tensor,
                    scale: float, causal: bool, window: int | None) -> torch.Tensor:
    """kernels.torch_ops.draft_attention (same arguments): query i of block n sits at position
    ctx_lens[n] + i and sees the valid context keys (position j) and the block's keys
    (position ctx_lens[n] + b), only those at or before it when `causal`, and only those less
    than `window` positions from it when a window is given. Returns [N, B, Hq, D] float64."""
    q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk = (t.cpu() for t in (q, k_ctx, v_ctx, ctx_lens,
                                                                  k_blk, v_blk))
    n, block, n_heads, head_dim = q.shape
    group = n_heads // k_ctx.shape[2]
    out = torch.zeros(n, block, n_heads, head_dim, dtype=torch.float64)
    for s in range(n):
        length = int(ctx_lens[s])
        keys = [(j, k_ctx[s, j], v_ctx[s, j]) for j in range(length)]
        keys += [(length + b, k_blk[s, b], v_blk[s, b]) for b in range(block)]
        for i in range(block):
            at = length + i
            seen = [(k, v) for pos, k, v in keys
                    if (not causal or pos <= at) and (window is None or abs(at - pos) < window)]
            for h in range(n_heads):
                k = torch.stack([k[h // group] for k, _ in seen]).double()
                v = torch.stack([v[h // group] for _, v in seen]).double()
                weights = (k @ q[s, i, h].double() * scale).softmax(0)
                out[s, i, h] = weights @ v
    return out


def accept_greedy(logits: torch.Tensor, row_start: torch.Tensor, num_drafts: torch.Tensor,
                  drafts: torch.Tensor) -> torch.Tensor:
    """kernels.torch_ops.accept_greedy: per item, drafts accepted while each equals its row's
    argmax (the first index among equal maxima), and the argmax of the row after them."""
    logits, row_start, num_drafts, drafts = (t.cpu() for t in (logits, row_start, num_drafts,
                                                               drafts))
    out = []
    for n in range(drafts.shape[0]):
        start, count = int(row_start[n]), int(num_drafts[n])

        def best(row: int) -> int:
            values = logits[row].tolist()
            return values.index(max(values))

        accepted = 0
        while accepted < count and int(drafts[n, accepted]) == best(start + accepted):
            accepted += 1
        out.append([accepted, best(start + accepted)])
    return torch.tensor(out, dtype=torch.long).view(-1, 2)


def accept_sample(probs: torch.Tensor, row_start: torch.Tensor, num_drafts: torch.Tensor,
                  drafts: torch.Tensor, uniforms: torch.Tensor,
                  q_probs: torch.Tensor | None = None,
                  q_ids: torch.Tensor | None = None) -> torch.Tensor:
    """kernels.torch_ops.accept_sample: draft k is accepted when uniforms[n, k] * q_k(d_k) <
    p_k(d_k) (q_k one-hot without q_probs); at the first rejection the bonus is drawn from
    max(p_k - q_k, 0) (p_k where that is all zero), after a fully accepted block from the next
    row, by inversion with uniforms[n, num_drafts[n]]: the first token whose cumulative mass
    exceeds u times the row's total (never one of mass 0)."""
    probs, row_start, num_drafts, drafts, uniforms = (
        t.cpu() for t in (probs, row_start, num_drafts, drafts, uniforms))
    out = []
    for n in range(drafts.shape[0]):
        start, count = int(row_start[n]), int(num_drafts[n])

        def q_of(k: int) -> dict[int, float]:
            if q_probs is None:
                return {int(drafts[n, k]): 1.0}
            q: dict[int, float] = {}
            for token, mass in zip(q_ids[n, k].tolist(), q_probs[n, k].double().tolist()):
                q[token] = q.get(token, 0.0) + mass
            return q

        accepted = 0
        while accepted < count:
            d = int(drafts[n, accepted])
            q = q_of(accepted)
            if float(uniforms[n, accepted]) * q.get(d, 0.0) >= float(probs[start + accepted, d]):
                break
            accepted += 1
        p = probs[start + accepted].double().clone()
        if accepted < count:
            residual = p.clone()
            for token, mass in q_of(accepted).items():
                residual[token] = max(float(residual[token]) - mass, 0.0)
            if float(residual.sum()) > 0:
                p = residual
        target = float(uniforms[n, count]) * float(p.sum())
        weights = p.tolist()
        bonus = max(t for t, w in enumerate(weights) if w > 0)  # where rounding leaves u past all
        mass = 0.0
        for token, weight in enumerate(weights):
            mass += weight
            if mass > target:
                bonus = token
                break
        out.append([accepted, bonus])
    return torch.tensor(out, dtype=torch.long).view(-1, 2)


def store_context_kv(k: torch.Tensor, v: torch.Tensor, norm_weight: torch.Tensor | None,
                     eps: float, cos_half: torch.Tensor, sin_half: torch.Tensor,
                     positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor) -> None:
    """kernels.torch_ops.store_context_kv: per token and head, the key RMS-normalised (with
    `norm_weight`, if any) and rotated by its position (rotate-half RoPE), stored with its
    value at the token's slot, computed in float64 and rounded once to the caches' dtype."""
    half = k.shape[-1] // 2
    for t in range(k.shape[0]):
        pos, slot = int(positions[t]), int(slots[t])
        cos = cos_half[pos].double()
        sin = sin_half[pos].double()
        for h in range(k.shape[1]):
            key = k[t, h].double()
            if norm_weight is not None:
                key = key * torch.rsqrt(key.pow(2).mean() + eps) * norm_weight.double()
            x1, x2 = key[:half], key[half:]
            rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin])
            k_cache[slot, h] = rotated.to(k_cache.device, k_cache.dtype)
            v_cache[slot, h] = v[t, h].to(v_cache.dtype)
