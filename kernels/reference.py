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
