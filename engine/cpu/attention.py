"""The attention backends of the CPU fast path: decode rows and verify blocks through
agentflash's CPU kernel (kernels.cpu_ops.paged_attention), which reads the pool in place.

`KernelAttention` is engine.attention.PagedAttention's case of few new queries per sequence
(its metadata: each sequence's page table, each query's sequence and key count);
`KernelDraftAttention` the drafter's block attention over each block's context in place, the
block's own K/V passed beside the pool. What the decode/verify forward (engine.cpu.forward)
and the compiled programs (engine.cpu.compiled) run where the kernel does.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from agentflash.kernels import cpu_ops, dispatch

from ..attention import index_tensor


@dataclass
class KernelAttention:
    """Paged attention for one forward of decode rows and verify blocks through the CPU kernel:
    query t sees the first `token_keys[t]` keys of sequence `token_seq[t]`, whose key j sits in
    page `page_table[seq, j // page_size]` of every layer's cache, at offset j % page_size."""

    k_caches: Sequence[torch.Tensor]
    v_caches: Sequence[torch.Tensor]
    slot_mapping: torch.Tensor       # [T] where each new token's K/V goes
    page_table: torch.Tensor         # [B, P] each sequence's pages (short ones padded with 0)
    token_seq: torch.Tensor          # [T] each query's sequence
    token_keys: torch.Tensor         # [T] how many keys each query sees (its position + 1)
    page_size: int
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
    ) -> KernelAttention:
        """As `PagedAttention.build`: sequence b's last `num_new[b]` of `ctx_lens[b]` tokens
        are the queries, laid out in batch order. (Python lists, then one tensor each: this
        runs every decode step.)"""
        seq: list[int] = []
        keys: list[int] = []
        slots: list[int] = []
        width = max(1, max(len(p) for p in page_tables))
        table: list[list[int]] = []
        for b, (pages, n, new) in enumerate(zip(page_tables, ctx_lens, num_new)):
            seq.extend([b] * new)
            keys.extend(range(n - new + 1, n + 1))
            slots.extend(pages[p // page_size] * page_size + p % page_size
                         for p in range(n - new, n))
            table.append(list(pages) + [0] * (width - len(pages)))
        # one tensor, then views of it (a tensor from a list costs ~8 us: this runs every step)
        flat = index_tensor([*slots, *seq, *keys, *itertools.chain.from_iterable(table)],
                            k_caches[0].device)
        t = len(slots)
        return cls(k_caches, v_caches, flat[:t], flat[3 * t:].view(len(table), width),
                   flat[t:2 * t], flat[2 * t:3 * t], page_size, scale)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.k_caches[layer], self.v_caches[layer]
        dispatch.store_kv(k_cache, v_cache, self.slot_mapping, k, v)
        return cpu_ops.paged_attention(q, k_cache, v_cache, self.page_table, self.page_size,
                                       self.token_seq, self.token_keys, self.scale)


@dataclass
class KernelDraftAttention:
    """The DFlash drafter's attention for one forward through the CPU kernel: N blocks of B
    queries, block n over its sequence's first ctx_lens[n] cached drafter-context keys (read in
    place through its page table, nothing gathered) and the block's own K/V (passed beside the
    pool, never stored). Every query of a non-causal layer sees the whole block; of a causal one,
    the block up to itself. Layers with a window take `PagedDraftAttention` (`supports`)."""

    k_caches: Sequence[torch.Tensor]   # per drafter layer [S, Hkv, D]
    v_caches: Sequence[torch.Tensor]
    page_table: torch.Tensor           # [N, P] each sequence's pages (padded with 0)
    token_seq: torch.Tensor            # [N*B] each query's block
    token_keys: torch.Tensor           # [N*B] keys a query sees in a non-causal layer
    causal_keys: torch.Tensor          # [N*B] ... in a causal layer
    ctx_lens: torch.Tensor             # [N] context keys in the pool
    page_size: int
    scale: float
    causal: Sequence[bool]             # per layer

    @staticmethod
    def supports(drafter) -> bool:
        return (cpu_ops.attends(drafter.config.head_dim)
                and all(drafter.layer_kind(i).window is None for i in range(len(drafter.layers))))

    @classmethod
    def build(cls, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor],
              page_tables: Sequence[Sequence[int]], ctx_lens: Sequence[int], block_size: int,
              page_size: int, drafter) -> KernelDraftAttention:
        width = max(1, max(-(-n // page_size) for n in ctx_lens))
        keys = [n + block_size for n in ctx_lens for _ in range(block_size)]
        causal = [n + i + 1 for n in ctx_lens for i in range(block_size)]
        seq = [b for b in range(len(ctx_lens)) for _ in range(block_size)]
        table = [list(pages[:width]) + [0] * (width - len(pages[:width])) for pages in page_tables]
        t, n = len(seq), len(ctx_lens)
        flat = index_tensor([*seq, *keys, *causal, *ctx_lens,
                             *itertools.chain.from_iterable(table)], k_caches[0].device)
        return cls(k_caches, v_caches, flat[3 * t + n:].view(n, width), flat[:t], flat[t:2 * t],
                   flat[2 * t:3 * t], flat[3 * t:3 * t + n], page_size, drafter.attention_scale,
                   [drafter.layer_kind(i).causal for i in range(len(k_caches))])

    def select(self, rows: torch.Tensor) -> KernelDraftAttention:
        """This attention for the queries of the block tokens `rows` only (indices into the
        N*B); `attend` still takes every block token's k and v."""
        return replace(self, token_seq=self.token_seq.index_select(0, rows),
                       token_keys=self.token_keys.index_select(0, rows),
                       causal_keys=self.causal_keys.index_select(0, rows))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys = self.causal_keys if self.causal[layer] else self.token_keys
        return cpu_ops.paged_attention(q, self.k_caches[layer], self.v_caches[layer],
                                       self.page_table, self.page_size, self.token_seq, keys,
                                       self.scale, k, v, self.ctx_lens)
