"""Runs the forwards of one engine step on the model(s): lays out tokens, builds the paged
attention metadata, extends each sequence's KV, and returns the logits of the rows that sample.

With a DFlash drafter attached, every target forward also captures the hidden states of the
drafter's target layers and materialises the drafter's context K/V for the fed positions into
the drafter's layers of the same paged pool (same page ids and slots as the target KV), so a
prefix-cache hit restores the drafter's warm state along with the target's.

With a decode/verify forward (engine.cpu.forward: compiled ahead of time, or eager on the CPU
kernels), every decode row and verify block runs through it; each prefill chunk runs in a forward
of its own (the scheduler cuts prompts at fixed positions), so a sequence's rows never depend on
what else was scheduled with them.

With a hybrid target (Qwen3.5), the pool holds only its full-attention layers' K/V; the
linear-attention states travel through `LinearStates.forward` (engine.states), every item in
one forward.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from agentflash.kernels.torch_ops import INVARIANT_MAX_QUERIES

from .attention import PagedAttention, PagedDraftAttention, index_tensor
from .batch import BatchItem
from .cpu.forward import DecodeForward, DraftForward, step_args
from .kv.manager import KVManager
from .kv.pool import KVPool
from .models.dflash import DFlashDraftModel
from .models.qwen3 import CausalLM
from .models.qwen3_5 import HybridCausalLM
from .states import LinearStates, NoStates, SequenceStates


class RunnerOutput(NamedTuple):
    logits: torch.Tensor            # [R, V] float32: the sampling rows of all items, in order
    rows: list[tuple[int, int]]     # per item: (first row in logits, row count); count 0: none


class ModelRunner:
    def __init__(
        self, model: CausalLM | HybridCausalLM, pool: KVPool, kv: KVManager,
        drafter: DFlashDraftModel | None = None, draft_layers: range | None = None,
        decode: DecodeForward | None = None, draft_forward: DraftForward | None = None,
        states: SequenceStates = NoStates(),
    ):
        if isinstance(model, HybridCausalLM) != isinstance(states, LinearStates):
            raise ValueError("a hybrid model needs LinearStates, and only a hybrid model has them")
        self.model = model
        self.states = states
        self.decode = decode
        self.draft_forward = draft_forward
        self.pool = pool
        self.kv = kv
        self.drafter = drafter
        self.draft_layers = draft_layers
        self.device = model.device
        self.num_layers = model.config.num_kv_layers
        self.capture = tuple(drafter.config.target_layer_ids) if drafter is not None else ()

    @torch.inference_mode()
    def forward(self, items: list[BatchItem]) -> RunnerOutput:
        """The target's forwards over all items (prefill chunks, decode tokens, verify blocks):
        decode rows and verify blocks together (through the decode/verify forward, if any),
        each prefill chunk of a dense model in a forward of its own (so its rows, like a decode
        row's, are computed the same way whatever shares the step: matmuls and SDPA choose how
        to block a call by its shape)."""
        if not self.states.chunks_apart:  # hybrid: every item in one forward
            return self._forward(items, False)
        small = [i for i, item in enumerate(items) if item.num_tokens <= INVARIANT_MAX_QUERIES]
        groups = [small] if small else []
        groups += [[i] for i, item in enumerate(items) if item.num_tokens > INVARIANT_MAX_QUERIES]
        if len(groups) == 1:
            return self._forward(items, self.decode is not None and bool(small))
        parts = [self._forward([items[i] for i in group], self.decode is not None
                               and group is small) for group in groups]
        rows: list[tuple[int, int]] = [(0, 0)] * len(items)
        offset = 0
        for order, part in zip(groups, parts):
            for i, (first, count) in zip(order, part.rows):
                rows[i] = (first + offset, count)
            offset += part.logits.shape[0]
        return RunnerOutput(torch.cat([p.logits for p in parts]), rows)

    def _forward(self, items: list[BatchItem], small: bool) -> RunnerOutput:
        """One forward: through the decode/verify forward when `small`, else the eager model."""
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
        meta = (self.pool.k[: self.num_layers], self.pool.v[: self.num_layers], page_tables,
                ctx_lens, num_new, self.kv.page_size, self.model.attention_scale)
        attn = (self.decode.attention(*meta) if small and self.decode is not None
                else PagedAttention.build(*meta))
        flat = index_tensor([*ids, *positions], self.device)
        input_ids, pos = flat[:len(ids)], flat[len(ids):]
        if small:  # with a drafter, the forward stores its context K/V too
            assert self.decode is not None
            out = self.decode(step_args(input_ids, pos, attn), attn.k_caches, attn.v_caches,
                              self._draft_caches(self.pool.k), self._draft_caches(self.pool.v))
            if self.decode.returns_logits:
                if len(logit_rows) < out.shape[0]:  # a short prefill chunk: its last row only
                    out = out[index_tensor(logit_rows, self.device)]
                return RunnerOutput(out, rows)
            hidden = out
        else:
            hidden, captured = self.states.forward(self.model, items, input_ids, pos, attn,
                                                   self.capture)
            if self.drafter is not None:
                self._store_draft_context(captured, pos, attn.slot_mapping)
        if len(logit_rows) < hidden.shape[0]:  # (every row samples in decode and verify steps)
            hidden = hidden[index_tensor(logit_rows, self.device)]
        return RunnerOutput(self.model.logits(hidden), rows)

    def _draft_caches(self, caches: list[torch.Tensor]) -> list[torch.Tensor]:
        return [caches[i] for i in self.draft_layers] if self.draft_layers is not None else []

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
        [N, drafts, V] for the first `drafts` (<= B-1) draft positions: the head, and with the
        CPU kernels the drafter's last layer, run only on the positions some item verifies
        (with the CPU kernels the head is part of the drafter's forward)."""
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
        meta = (self._draft_caches(self.pool.k), self._draft_caches(self.pool.v), page_tables,
                ctx_lens, block_size, self.kv.page_size, self.drafter)
        # the rows whose drafts are verified: 1 .. drafts of each block
        rows = [b * block_size + 1 + i for b in range(len(items)) for i in range(drafts)]
        flat = index_tensor([*ids, *positions, *rows], self.device)
        n = len(ids)
        block_ids, pos, wanted = flat[:n], flat[n:2 * n], flat[2 * n:]
        if self.draft_forward is not None:
            out = self.draft_forward(block_ids, pos, self.draft_forward.attention(*meta), wanted)
            if self.draft_forward.returns_logits:
                return out.view(len(items), drafts, -1)
            hidden = out
        else:
            attn = PagedDraftAttention.build(*meta)
            hidden = self.drafter(self.drafter.embed_block(self.model, block_ids), pos, attn,
                                  block_size=block_size)
            hidden = hidden.index_select(0, wanted)
        return self.drafter.logits(self.model, hidden.view(len(items), drafts, -1))
