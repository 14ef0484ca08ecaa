"""Attention backends the model layers call: dense causal (no cache) and paged (KV pool).

A model layer computes q, k, v for its new tokens (flattened over the batch, RoPE applied) and
calls `backend.attend(layer, q, k, v)`. The backend decides where keys come from:
- `DenseCausal`: only the given tokens, causal within each sequence (tests, training).
- `PagedAttention`: the tokens' K/V are stored into the pool first, then every query attends over
  its sequence's cached keys up to its own position (prefill chunks, decode and verify blocks
  are all this one case: a run of new queries at the end of a cached prefix).
(engine.cpu.attention has the same two through agentflash's CPU kernels.)
"""

from __future__ import annotations

import array
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F

from agentflash.kernels import dispatch
from agentflash.kernels.torch_ops import (INVARIANT_MAX_QUERIES, ChunkPlan, chunk_plan,
                                          gather_slots)


def index_tensor(values: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """A long tensor of Python ints, built through an `array` buffer: 3-4x faster than
    `torch.tensor` on a list (8.9 -> 2.6 us for 3 values, 23 -> 7 us for 110), which matters
    for the few index tensors every decode step builds."""
    if not values:
        return torch.empty(0, dtype=torch.long, device=device)
    flat = torch.frombuffer(array.array("q", values), dtype=torch.long)
    return flat if torch.device(device).type == "cpu" else flat.to(device)


def slot_table(page_tables: Sequence[Sequence[int]], page_size: int) -> torch.Tensor:
    """[B, max_pages * page_size] slot ids of each sequence's pages (short tables padded with
    page 0: attention masks those keys by length)."""
    max_pages = max(1, max(len(p) for p in page_tables))
    table = torch.zeros(len(page_tables), max_pages, dtype=torch.long)
    for b, pages in enumerate(page_tables):
        table[b, : len(pages)] = torch.tensor(pages, dtype=torch.long)
    return table_slots(table, page_size)


def table_slots(table: torch.Tensor, page_size: int) -> torch.Tensor:
    """[B, P * page_size] the slot ids of page tables [B, P], on their device (engine.graphs
    computes them inside a graph)."""
    offsets = torch.arange(page_size, device=table.device)
    return (table[:, :, None] * page_size + offsets).flatten(1)


class AttentionBackend(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] for the new tokens; returns [T, Hq, D]."""
        ...


class DenseCausal:
    """Causal attention inside each of several sequences laid end to end, without a cache.
    One causal kernel call per sequence: no work on the cross-sequence blocks a joint mask
    would spend (quadratic in the total length)."""

    def __init__(self, seq_lens: Sequence[int], scale: float):
        self.scale = scale
        self.bounds: list[tuple[int, int]] = []
        start = 0
        for n in seq_lens:
            self.bounds.append((start, start + n))
            start += n

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs = [
            F.scaled_dot_product_attention(
                q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
                is_causal=True, scale=self.scale, enable_gqa=k.shape[1] != q.shape[1],
            ).transpose(0, 1)
            for a, b in self.bounds
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs)


@dataclass(frozen=True)
class PagedGroup:
    """Sequences of one forward attended in one kernel call, padded to the group's longest run
    of queries and context (see `PagedAttention.build`). Indices are local to the group."""

    rows: torch.Tensor | None        # [Tg] rows of q (and of the output) holding its queries
                                     # (None: the group is the whole forward)
    gather: torch.Tensor | None      # [b, L] slots of each sequence's keys (whole pages)
    q_index: torch.Tensor            # [b, Q] group token row per (sequence, query); Tg = padding
    out_index: torch.Tensor | None   # [Tg] output row per token (None: identity)
    mask: torch.Tensor | None        # [b, 1, Q, L]
    plan: ChunkPlan | None           # the CPU bfloat16 decode/verify layout, made once here
                                     # (gather and mask may be None when there is a plan)


def _query_class(n: int) -> int:
    """Decode steps (1 query), verify blocks (a few) and prefill chunks are padded separately:
    one prefill chunk in a batch of decodes must not pad every decode to the chunk's length.
    The verify class ends where the CPU kernel's row-invariant path does, so decode rows and
    verify blocks always take that path together (kernels.torch_ops.paged_attention)."""
    return 0 if n == 1 else 1 if n <= INVARIANT_MAX_QUERIES else 2


@dataclass
class PagedAttention:
    """Paged attention over the KV pool for one forward pass.

    Built once per forward from each sequence's page table, context length and new-token count,
    and shared by all layers; `k_caches[l]`/`v_caches[l]` are layer l's slot tensors [S, Hkv, D].
    """

    k_caches: Sequence[torch.Tensor]
    v_caches: Sequence[torch.Tensor]
    slot_mapping: torch.Tensor       # [T] where each new token's K/V goes
    groups: list[PagedGroup]
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
        one_group: bool = False,
    ) -> PagedAttention:
        """Sequence b has `ctx_lens[b]` tokens of context whose KV lives in the pages
        `page_tables[b]`; its last `num_new[b]` tokens are this forward's queries (laid out in
        batch order). Their K/V is stored by `attend` before attention runs. one_group: all
        sequences in one kernel call (decode rows padded to the verify blocks' length), as the
        compiled forward takes them (engine.cpu.compiled)."""
        device = k_caches[0].device
        n_tokens = sum(num_new)
        first = [0]
        for n in num_new:
            first.append(first[-1] + n)
        classes: dict[int, list[int]] = {}
        for b, n in enumerate(num_new):
            classes.setdefault(0 if one_group else _query_class(n), []).append(b)
        slot_mapping = torch.empty(n_tokens, dtype=torch.long)
        groups = []
        for members in classes.values():
            rows = torch.cat([torch.arange(first[b], first[b + 1]) for b in members])
            slots, group = _build_group(
                [page_tables[b] for b in members], [ctx_lens[b] for b in members],
                [num_new[b] for b in members], page_size, rows, k_caches[0])
            slot_mapping[rows] = slots
            groups.append(group)
        return cls(k_caches=k_caches, v_caches=v_caches, slot_mapping=slot_mapping.to(device),
                   groups=groups, scale=scale)

    @classmethod
    def from_plan(
        cls, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor, q_index: torch.Tensor, out_index: torch.Tensor,
        plan: ChunkPlan, scale: float,
    ) -> PagedAttention:
        """One group given by its tensors alone (what a compiled forward is traced over)."""
        group = PagedGroup(rows=None, gather=None, q_index=q_index, out_index=out_index,
                           mask=None, plan=plan)
        return cls(k_caches=k_caches, v_caches=v_caches, slot_mapping=slot_mapping,
                   groups=[group], scale=scale)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.k_caches[layer], self.v_caches[layer]
        dispatch.store_kv(k_cache, v_cache, self.slot_mapping, k, v)
        if len(self.groups) == 1:
            g = self.groups[0]
            return dispatch.paged_attention(
                q, k_cache, v_cache, g.gather, g.q_index, g.out_index, g.mask, self.scale, g.plan)
        out = torch.empty_like(q)
        for g in self.groups:
            out[g.rows] = dispatch.paged_attention(
                q[g.rows], k_cache, v_cache, g.gather, g.q_index, g.out_index, g.mask,
                self.scale, g.plan)
        return out


def _build_group(
    page_tables: Sequence[Sequence[int]], ctx_lens: Sequence[int], num_new: Sequence[int],
    page_size: int, rows: torch.Tensor, cache: torch.Tensor,
) -> tuple[torch.Tensor, PagedGroup]:
    """The slots of the group's new tokens and its kernel arguments (`cache`: any layer's)."""
    device = cache.device
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
    slots = gather.gather(1, q_pos.clamp(max=gather.shape[1] - 1))[q_valid]
    # query i of sequence b sees key j iff j <= its position (padding queries see key 0).
    q_pos = torch.where(q_valid, q_pos, 0)
    mask = torch.arange(gather.shape[1])[None, None, :] <= q_pos[:, :, None]
    out_index = None
    if batch > 1 and not bool(q_valid.all()):
        flat = torch.zeros(n_tokens + 1, dtype=torch.long)
        flat[q_index.reshape(-1)] = torch.arange(batch * max_q)
        out_index = flat[:n_tokens].to(device)
    plan = None
    if device.type == "cpu" and cache.dtype == torch.bfloat16 and max_q <= INVARIANT_MAX_QUERIES:
        plan = chunk_plan(gather, mask[:, None], max_q, cache.shape[1])
    group = PagedGroup(rows=rows.to(device), gather=gather.to(device),
                       q_index=q_index.to(device), out_index=out_index,
                       mask=mask[:, None].to(device), plan=plan)
    return slots, group


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
        k_ctx = gather_slots(self.k_caches[layer], self.gather)
        v_ctx = gather_slots(self.v_caches[layer], self.gather)
        out = dispatch.draft_attention(
            q.view(n, b, *q.shape[1:]), k_ctx, v_ctx, self.ctx_lens, k.view(n, b, *k.shape[1:]),
            v.view(n, b, *v.shape[1:]), self.scale, causal, window,
        )
        return out.reshape(n * b, *q.shape[1:])
