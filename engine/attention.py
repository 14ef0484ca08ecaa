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


def slot_table(page_tables: Sequence[Sequence[int]], page_size: int) -> torch.Tensor:
    """[B, max_pages * page_size] slot ids of each sequence's pages (short tables padded with
    page 0: attention masks those keys by length)."""
    max_pages = max(1, max(len(p) for p in page_tables))
    table = torch.zeros(len(page_tables), max_pages, dtype=torch.long)
    for b, pages in enumerate(page_tables):
        table[b, : len(pages)] = torch.tensor(pages, dtype=torch.long)
    return (table[:, :, None] * page_size + torch.arange(page_size)).flatten(1)


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

    Built once per forward from each sequence's page table, context length and new-token count,
    and shared by all layers; `k_caches[l]`/`v_caches[l]` are layer l's slot tensors [S, Hkv, D].
    """

    k_caches: Sequence[torch.Tensor]
    v_caches: Sequence[torch.Tensor]
    slot_mapping: torch.Tensor       # [T] where each new token's K/V goes
    gather: torch.Tensor             # [B, L] slots of each sequence's keys (whole pages)
    q_index: torch.Tensor            # [B, Q] token row per (sequence, query); T = padding
    out_index: torch.Tensor | None   # [T] output row per token (None: identity)
    mask: torch.Tensor | None        # [B, 1, Q, L]
    scale: float

    @classmethod
    def build(
        cls,
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
        page_tables: Sequence[Sequence[int]],
        ctx_lens: Sequence[int],
        num_new: Sequence[int],
        page_size: int,
        scale: float,
    ) -> PagedAttention:
        """Sequence b has `ctx_lens[b]` tokens of context whose KV lives in the pages
        `page_tables[b]`; its last `num_new[b]` tokens are this forward's queries (laid out in
        batch order). Their K/V is stored by `attend` before attention runs."""
        device = k_caches[0].device
        batch = len(page_tables)
        max_q = max(num_new)
        n_tokens = sum(num_new)
        gather = slot_table(page_tables, page_size)
        lens = torch.tensor(ctx_lens, dtype=torch.long)
        n_new = torch.tensor(num_new, dtype=torch.long)
        q_off = torch.arange(max_q)
        q_valid = q_off[None, :] < n_new[:, None]                       # [B, Q]
        q_pos = (lens - n_new)[:, None] + q_off[None, :]                # [B, Q] absolute positions
        first_row = torch.cumsum(n_new, 0) - n_new
        q_index = torch.where(q_valid, first_row[:, None] + q_off[None, :], n_tokens)
        slot_mapping = gather.gather(1, q_pos.clamp(max=gather.shape[1] - 1))[q_valid]
        # query i of sequence b sees key j iff j <= its position (padding queries see key 0).
        q_pos = torch.where(q_valid, q_pos, 0)
        mask = torch.arange(gather.shape[1])[None, None, :] <= q_pos[:, :, None]
        out_index = None
        if batch > 1 and not bool(q_valid.all()):
            flat = torch.zeros(n_tokens + 1, dtype=torch.long)
            flat[q_index.reshape(-1)] = torch.arange(batch * max_q)
            out_index = flat[:n_tokens].to(device)
        return cls(
            k_caches=k_caches, v_caches=v_caches, slot_mapping=slot_mapping.to(device),
            gather=gather.to(device), q_index=q_index.to(device), out_index=out_index,
            mask=mask[:, None].to(device), scale=scale,
        )

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.k_caches[layer], self.v_caches[layer]
        dispatch.store_kv(k_cache, v_cache, self.slot_mapping, k, v)
        return dispatch.paged_attention(
            q, k_cache, v_cache, self.gather, self.q_index, self.out_index, self.mask, self.scale
        )


@dataclass
class PagedDraftAttention:
    """The DFlash drafter's attention for one forward: N blocks of B queries, each over its
    sequence's cached drafter context K/V (paged, same page tables as the target) plus the
    block's own K/V; non-causal for full layers, causal with a window for sliding layers."""

    k_caches: Sequence[torch.Tensor]           # per drafter layer [S, Hkv, D]
    v_caches: Sequence[torch.Tensor]
    gather: torch.Tensor                       # [N, L] context slots (whole pages)
    ctx_lens: torch.Tensor                     # [N] valid context keys
    block_size: int
    scale: float
    kinds: Sequence[tuple[bool, int | None]]   # per layer: (causal, window)

    @classmethod
    def build(
        cls,
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
        page_tables: Sequence[Sequence[int]],
        ctx_lens: Sequence[int],
        block_size: int,
        page_size: int,
        drafter,
    ) -> PagedDraftAttention:
        device = k_caches[0].device
        gather = slot_table(page_tables, page_size)
        kinds = [drafter.layer_kind(i) for i in range(len(k_caches))]
        return cls(k_caches, v_caches, gather.to(device),
                   torch.tensor(ctx_lens, dtype=torch.long, device=device), block_size,
                   drafter.attention_scale, kinds)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n, b = self.gather.shape[0], self.block_size
        causal, window = self.kinds[layer]
        out = dispatch.draft_attention(
            q.view(n, b, *q.shape[1:]), self.k_caches[layer][self.gather],
            self.v_caches[layer][self.gather], self.ctx_lens, k.view(n, b, *k.shape[1:]),
            v.view(n, b, *v.shape[1:]), self.scale, causal, window,
        )
        return out.reshape(n * b, *q.shape[1:])
