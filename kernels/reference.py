"""Plain torch reference implementations of the engine's kernels (the CPU path)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    gather: torch.Tensor,
    q_index: torch.Tensor,
    out_index: torch.Tensor | None,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Attention of a flattened batch of queries over paged K/V.

    q        [T, Hq, D]   queries of all sequences, flattened
    k_cache  [S, Hkv, D]  one layer's key slots (S = pages * page_size); v_cache likewise
    gather   [B, L]       slot index of each sequence's key j (padding points at any valid slot)
    q_index  [B, Q]       row of q for each (sequence, query) pair; T means padding
    out_index [T]         row of the flattened [B*Q] output holding each query (None: identity)
    mask     [B, 1, Q, L] True where query may see key (None: all visible)
    returns  [T, Hq, D]
    """
    n_tokens, n_heads, head_dim = q.shape
    batch, q_len = q_index.shape
    q_pad = torch.cat([q, q.new_zeros(1, n_heads, head_dim)])[q_index]  # [B, Q, Hq, D]
    k = k_cache[gather].transpose(1, 2)  # [B, Hkv, L, D]
    v = v_cache[gather].transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2), k, v, attn_mask=mask, scale=scale,
        enable_gqa=k.shape[1] != n_heads,
    )  # [B, Hq, Q, D]
    out = out.transpose(1, 2).reshape(batch * q_len, n_heads, head_dim)
    return out if out_index is None else out[out_index]


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Write new keys/values [T, Hkv, D] into their slots [T] of one layer's cache."""
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)


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
    """Attention of N drafted blocks over their cached context and themselves (DFlash drafter).

    q        [N, B, Hq, D]   block queries; query i of sequence n sits at position ctx_lens[n] + i
    k_ctx    [N, L, Hkv, D]  context keys, key j at position j; only the first ctx_lens[n] valid
    v_ctx    [N, L, Hkv, D]
    ctx_lens [N]             valid context length of each sequence (0 .. L)
    k_blk    [N, B, Hkv, D]  the block's own keys/values, at the queries' positions
    v_blk    [N, B, Hkv, D]
    causal   False: every query sees the whole block; True: block keys up to its own position
    window   None, or a key is visible only if |query_pos - key_pos| < window
    returns  [N, B, Hq, D]

    Every query sees at least its own key, so no row is fully masked.
    """
    n, b, n_heads, _ = q.shape
    ctx_len = k_ctx.shape[1]
    device = q.device
    lens = ctx_lens.to(device=device, dtype=torch.long)
    ctx_pos = torch.arange(ctx_len, device=device).expand(n, ctx_len)
    q_pos = lens[:, None] + torch.arange(b, device=device)                  # [N, B]
    key_pos = torch.cat([ctx_pos, q_pos], dim=1)                            # [N, L + B]
    block = torch.ones_like(q_pos, dtype=torch.bool)
    valid = torch.cat([ctx_pos < lens[:, None], block], dim=1)              # padding: False
    mask = valid[:, None, :].expand(n, b, ctx_len + b)
    diff = q_pos[:, :, None] - key_pos[:, None, :]                          # [N, B, L + B]
    if causal:
        mask = mask & (diff >= 0)
    if window is not None:
        mask = mask & (diff.abs() < window)
    k = torch.cat([k_ctx, k_blk], dim=1).transpose(1, 2)                    # [N, Hkv, L + B, D]
    v = torch.cat([v_ctx, v_blk], dim=1).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k, v, attn_mask=mask[:, None], scale=scale,
        enable_gqa=k.shape[1] != n_heads,
    )  # [N, Hq, B, D]
    return out.transpose(1, 2)
