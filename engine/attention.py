"""Attention backends the model layers call: dense causal (no cache) and paged (KV pool).

A model layer computes q, k, v for its new tokens (flattened over the batch, RoPE applied) and
calls `backend.attend(layer, q, k, v)`. The backend decides where keys come from:
- `DenseCausal`: only the given tokens, causal within each sequence (tests, training).
- `PagedAttention`: the tokens' K/V are stored into the pool first, then every query attends over
  its sequence's cached keys up to its own position (prefill chunks, decode and verify blocks
  are all this one case: a run of new queries at the end of a cached prefix).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F

from agentflash.kernels import dispatch


class AttentionBackend(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] for the new tokens; returns [T, Hq, D]."""
        ...


class DenseCausal:
    """Causal attention inside each of several sequences laid end to end, without a cache."""

    def __init__(self, seq_lens: Sequence[int], scale: float, device: torch.device | str = "cpu"):
        self.scale = scale
        n = sum(seq_lens)
        seq_id = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(list(seq_lens)))
        pos = torch.arange(n)
        self.mask = ((seq_id[:, None] == seq_id[None, :]) & (pos[None, :] <= pos[:, None])).to(device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=self.mask,
            scale=self.scale, enable_gqa=k.shape[1] != q.shape[1],
        )
        return out.transpose(0, 1)


@dataclass
class PagedAttention:
    """Paged attention over the KV pool for one forward pass.

    Built once per forward from each sequence's (cached length, new-token count, slot list) and
    shared by all layers; `k_caches[l]`/`v_caches[l]` are layer l's slot tensors [S, Hkv, D].
    """

    k_caches: Sequence[torch.Tensor]
    v_caches: Sequence[torch.Tensor]
    slot_mapping: torch.Tensor       # [T] where each new token's K/V goes
    gather: torch.Tensor             # [B, L] slots of each sequence's keys
    q_index: torch.Tensor            # [B, Q] token row per (sequence, query); T = padding
    out_index: torch.Tensor | None   # [T] output row per token (None: identity)
    mask: torch.Tensor | None        # [B, 1, Q, L]
    scale: float

    @classmethod
    def build(
        cls,
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
        slots: Sequence[Sequence[int]],
        num_new: Sequence[int],
        scale: float,
    ) -> PagedAttention:
        """`slots[b]` lists the slots of sequence b's whole context, new tokens last;
        `num_new[b]` of them belong to this forward's tokens (laid out in batch order)."""
        device = k_caches[0].device
        batch = len(slots)
        ctx_lens = [len(s) for s in slots]
        max_len, max_q = max(ctx_lens), max(num_new)
        n_tokens = sum(num_new)
        gather = torch.zeros(batch, max_len, dtype=torch.long)
        q_index = torch.full((batch, max_q), n_tokens, dtype=torch.long)
        q_pos = torch.zeros(batch, max_q, dtype=torch.long)
        new_slots: list[int] = []
        row = 0
        for b, (s, q) in enumerate(zip(slots, num_new)):
            gather[b, : len(s)] = torch.tensor(s, dtype=torch.long)
            q_index[b, :q] = torch.arange(row, row + q)
            q_pos[b, :q] = torch.arange(len(s) - q, len(s))
            new_slots.extend(s[len(s) - q:])
            row += q
        # query i of sequence b sees key j iff j <= its position (padding queries see key 0).
        key_pos = torch.arange(max_len)
        mask = key_pos[None, None, :] <= q_pos[:, :, None]
        uniform = all(n == max_len for n in ctx_lens) and all(q == max_q for q in num_new)
        out_index = None
        if not (uniform or batch == 1):
            flat = torch.full((n_tokens + 1,), 0, dtype=torch.long)
            flat[q_index.reshape(-1)] = torch.arange(batch * max_q)
            out_index = flat[:n_tokens].to(device)
        if max_q == 1 and all(n == max_len for n in ctx_lens):
            mask_t = None  # decode with equal lengths: every key visible
        else:
            mask_t = mask[:, None].to(device)
        return cls(
            k_caches=k_caches, v_caches=v_caches,
            slot_mapping=torch.tensor(new_slots, dtype=torch.long, device=device),
            gather=gather.to(device), q_index=q_index.to(device), out_index=out_index,
            mask=mask_t, scale=scale,
        )

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.k_caches[layer], self.v_caches[layer]
        dispatch.store_kv(k_cache, v_cache, self.slot_mapping, k, v)
        return dispatch.paged_attention(
            q, k_cache, v_cache, self.gather, self.q_index, self.out_index, self.mask, self.scale
        )
