"""Runs the forwards of one engine step on the model(s): lays out tokens, builds the paged
attention metadata, extends each sequence's KV, and returns the logits of the rows that sample.

With a DFlash drafter attached, every target forward also captures the hidden states of the
drafter's target layers and materialises the drafter's context K/V for the fed positions into
the drafter's layers of the same paged pool (same page ids and slots as the target KV), so a
prefix-cache hit restores the drafter's warm state along with the target's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .attention import PagedAttention, PagedDraftAttention
from .kv.manager import KVManager
from .kv.pool import KVPool
from .models.dflash import DFlashDraftModel
from .models.qwen3 import CausalLM
from .scheduler import BatchItem


class RunnerOutput(NamedTuple):
    logits: torch.Tensor            # [R, V] float32: the sampling rows of all items, in order
    rows: list[tuple[int, int]]     # per item: (first row in logits, row count); count 0: none


class ModelRunner:
    def __init__(
        self, model: CausalLM, pool: KVPool, kv: KVManager,
        drafter: DFlashDraftModel | None = None, draft_layers: range | None = None,
    ):
        self.model = model
        self.pool = pool
        self.kv = kv
        self.drafter = drafter
        self.draft_layers = draft_layers
        self.device = model.device
        self.num_layers = model.config.num_hidden_layers
        self.capture = tuple(drafter.config.target_layer_ids) if drafter is not None else ()

    @torch.inference_mode()
    def forward(self, items: list[BatchItem]) -> RunnerOutput:
        """One target forward over all items (prefill chunks, decode tokens, verify blocks)."""
        ids: list[int] = []
        positions: list[int] = []
        page_tables, ctx_lens, num_new = [], [], []
        logit_rows: list[int] = []
        rows: list[tuple[int, int]] = []
        for item in items:
            seq, n, start = item.seq, item.num_tokens, item.start
            count = n if item.verifies else int(item.samples)
            rows.append((len(logit_rows), count))
            logit_rows.extend(range(len(ids) + n - count, len(ids) + n))
            ids.extend(item.token_ids())
            positions.extend(range(start, start + n))
            self.kv.extend(seq.kv, start + n)
            page_tables.append(seq.kv.pages)
            ctx_lens.append(start + n)
            num_new.append(n)
        attn = PagedAttention.build(
            self.pool.k[: self.num_layers], self.pool.v[: self.num_layers], page_tables, ctx_lens,
            num_new, self.kv.page_size, self.model.attention_scale,
        )
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        out = self.model(torch.tensor(ids, dtype=torch.long, device=self.device), pos, attn,
                         self.capture)
        if self.drafter is not None:
            self._store_draft_context(out.captured, pos, attn.slot_mapping)
        index = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
        return RunnerOutput(self.model.logits(out.hidden[index]), rows)

    def _store_draft_context(
        self, captured: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> None:
        assert self.drafter is not None and self.draft_layers is not None
        ctx = self.drafter.context_features(captured)
        for i, layer in enumerate(self.draft_layers):
            self.drafter.store_context_kv(i, ctx, positions, slots, self.pool.k[layer],
                                          self.pool.v[layer])

    @torch.inference_mode()
    def draft(self, items: list[BatchItem], block_size: int, drafts: int) -> torch.Tensor:
        """One drafter forward for the verify items: block [anchor, MASK x (B-1)] at positions
        start .. start+B-1 over each sequence's cached drafter context. Returns the drafter's logits
        [N, drafts, V] for the first `drafts` (<= B-1) draft positions: the head runs only on the
        positions some item verifies."""
        assert self.drafter is not None and self.draft_layers is not None
        cfg = self.drafter.config
        ids, positions, page_tables, ctx_lens = [], [], [], []
        for item in items:
            seq = item.seq
            start = seq.computed
            ids.extend(seq.token_slice(start, start + 1) + [cfg.mask_token_id] * (block_size - 1))
            positions.extend(range(start, start + block_size))
            page_tables.append(seq.kv.pages)
            ctx_lens.append(start)
        attn = PagedDraftAttention.build(
            [self.pool.k[i] for i in self.draft_layers], [self.pool.v[i] for i in self.draft_layers],
            page_tables, ctx_lens, block_size, self.kv.page_size, self.drafter,
        )
        block = self.drafter.embed_block(self.model, torch.tensor(ids, device=self.device))
        hidden = self.drafter(block, torch.tensor(positions, device=self.device), attn)
        hidden = hidden.view(len(items), block_size, -1)[:, 1 : 1 + drafts]
        return self.drafter.logits(self.model, hidden)
