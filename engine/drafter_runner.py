"""The DFlash drafter beside the target: the context K/V it keeps in the paged pool and its
block forward.

Every target forward captures the hidden states of the drafter's target layers and writes the
drafter's context K/V of the fed positions into the drafter's layers of the same pool (same
page ids and slots as the target's K/V), so a prefix-cache hit restores the drafter's warm
state with the target's. `draft` runs the block `[anchor, MASK x (B-1)]` of each verify item
over its cached context. `NoDrafter` stands in for an engine without one: it captures and
stores nothing.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .attention import PagedDraftAttention, index_tensor
from .batch import BatchItem
from .cpu.forward import DraftForward
from .kv.manager import KVManager
from .kv.pool import KVPool
from .models.dflash import DFlashDraftModel
from .models.qwen3 import CausalLM


class DraftContext(Protocol):
    capture: tuple[int, ...]   # target layers whose hidden states the drafter reads

    def caches(self, caches: list[torch.Tensor]) -> list[torch.Tensor]:
        """The drafter's layers of one of the pool's cache lists (K or V)."""

    def store(self, captured: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
              ) -> None:
        """Write the drafter's context K/V of the fed positions from the captured states."""


class NoDrafter:
    capture: tuple[int, ...] = ()

    def caches(self, caches: list[torch.Tensor]) -> list[torch.Tensor]:
        return []

    def store(self, captured: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
              ) -> None:
        pass


class DrafterRunner:
    def __init__(self, drafter: DFlashDraftModel, model: CausalLM, pool: KVPool, kv: KVManager,
                 forward: DraftForward | None = None) -> None:
        cfg = drafter.config
        self.drafter = drafter
        self.model = model  # the target: embeddings and head
        self.pool = pool
        self.kv = kv
        self.forward = forward  # the fast path's block forward (engine.cpu), if any
        self.layers = pool.add_layers([(cfg.num_key_value_heads, cfg.head_dim)]
                                      * cfg.num_hidden_layers)
        self.capture = tuple(cfg.target_layer_ids)
        self.device = model.device

    def caches(self, caches: list[torch.Tensor]) -> list[torch.Tensor]:
        return [caches[i] for i in self.layers]

    def store(self, captured: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
              ) -> None:
        ctx = self.drafter.context_features(captured)
        for i, layer in enumerate(self.layers):
            self.drafter.store_context_kv(i, ctx, positions, slots, self.pool.k[layer],
                                          self.pool.v[layer])

    @torch.inference_mode()
    def draft(self, items: list[BatchItem], block_size: int, drafts: int) -> torch.Tensor:
        """One drafter forward for the verify items: block [anchor, MASK x (B-1)] at positions
        start .. start+B-1 over each sequence's cached drafter context. Returns the drafter's logits
        [N, drafts, V] for the first `drafts` (<= B-1) draft positions: the head, and with the
        CPU kernels the drafter's last layer, run only on the positions some item verifies
        (with the CPU kernels the head is part of the drafter's forward)."""
        cfg = self.drafter.config
        ids, positions, page_tables, ctx_lens = [], [], [], []
        for item in items:
            seq = item.seq
            start = seq.computed
            ids.extend(seq.token_slice(start, start + 1) + [cfg.mask_token_id] * (block_size - 1))
            positions.extend(range(start, start + block_size))
            page_tables.append(seq.kv.pages)
            ctx_lens.append(start)
        meta = (self.caches(self.pool.k), self.caches(self.pool.v), page_tables,
                ctx_lens, block_size, self.kv.page_size, self.drafter)
        # the rows whose drafts are verified: 1 .. drafts of each block
        rows = [b * block_size + 1 + i for b in range(len(items)) for i in range(drafts)]
        flat = index_tensor([*ids, *positions, *rows], self.device)
        n = len(ids)
        block_ids, pos, wanted = flat[:n], flat[n:2 * n], flat[2 * n:]
        if self.forward is not None:
            out = self.forward(block_ids, pos, self.forward.attention(*meta), wanted)
            if self.forward.returns_logits:
                return out.view(len(items), drafts, -1)
            hidden = out
        else:
            attn = PagedDraftAttention.build(*meta)
            hidden = self.drafter(self.drafter.embed_block(self.model, block_ids), pos, attn,
                                  block_size=block_size)
            hidden = hidden.index_select(0, wanted)
        return self.drafter.logits(self.model, hidden.view(len(items), drafts, -1))
