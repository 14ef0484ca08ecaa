"""Runs the forwards of one engine step on the model(s): lays out tokens, builds the paged
attention metadata, extends each sequence's KV, and returns the logits of the rows that sample.

With a DFlash drafter attached (engine.drafter_runner), every target forward also captures the
hidden states of the drafter's target layers and writes the drafter's context K/V for the fed
positions into the drafter's layers of the same paged pool.

With a decode/verify forward (engine.cpu.forward: compiled ahead of time, or eager on the CPU
kernels; engine.graphs: replayed per bucket), every decode row and verify block runs through
it; each prefill chunk runs in a forward of its own (the scheduler cuts prompts at fixed
positions), so a sequence's rows never depend on what else was scheduled with them. Where the
CPU kernels take prefill's row counts faster than oneDNN (AMX, AVX512-BF16; compiled, AVX2
too: `DecodeForward.takes_prefill`), the chunks go through that forward too, with the step's other
items: its linears and attention compute each row by itself, whatever else the call holds (the
chunks' rows laid out first and counted, for the linears' float32 matrix product of prefill
rows: kernels.cpu_ops.prefer_float32).

With a hybrid target (Qwen3.5), the pool holds only its full-attention layers' K/V; the
linear-attention states travel through `LinearStates.forward` (engine.states), every item in
one forward.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from agentflash.kernels.torch_ops import INVARIANT_MAX_QUERIES

from .attention import PagedAttention, index_tensor
from .batch import BatchItem
from .cpu.forward import DecodeForward
from .drafter_runner import DraftContext, NoDrafter
from .kv.manager import KVManager
from .kv.pool import KVPool
from .models.qwen3 import CausalLM
from .models.qwen3_5 import HybridCausalLM
from .states import LinearStates, NoStates, SequenceStates


class RunnerOutput(NamedTuple):
    logits: torch.Tensor            # [R, V] float32: the sampling rows of all items, in order
    rows: list[tuple[int, int]]     # per item: (first row in logits, row count); count 0: none


class ModelRunner:
    def __init__(
        self, model: CausalLM | HybridCausalLM, pool: KVPool, kv: KVManager,
        decode: DecodeForward | None = None, drafter: DraftContext = NoDrafter(),
        states: SequenceStates = NoStates(),
    ):
        if isinstance(model, HybridCausalLM) != isinstance(states, LinearStates):
            raise ValueError("a hybrid model needs LinearStates, and only a hybrid model has them")
        self.model = model
        self.states = states
        self.decode = decode
        self.pool = pool
        self.kv = kv
        self.drafter = drafter  # its context K/V is written with every forward
        self.device = model.device
        self.num_layers = model.config.num_kv_layers

    @torch.inference_mode()
    def forward(self, items: list[BatchItem]) -> RunnerOutput:
        """The target's forwards over all items (prefill chunks, decode tokens, verify blocks):
        decode rows and verify blocks together (through the decode/verify forward, if any),
        each prefill chunk of a dense model in a forward of its own (so its rows, like a decode
        row's, are computed the same way whatever shares the step: matmuls and SDPA choose how
        to block a call by its shape), unless the decode/verify forward takes prefill chunks
        (`takes_prefill`: every row of its kernels is independent of the call): then every
        item in one forward through it."""
        if not self.states.chunks_apart:  # hybrid: every item in one forward
            return self._forward(items, False)
        if self.decode is not None and self.decode.takes_prefill:  # rows invariant whatever M
            return self._forward(items, True)
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
        rows: list[tuple[int, int]] = [(0, 0)] * len(items)
        for i, item in enumerate(items):
            seq, n, start = item.seq, item.num_tokens, item.start
            count = n if item.verifies else int(item.samples)
            rows[i] = (len(logit_rows), count)
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
        flat = index_tensor([*ids, *positions, *logit_rows], self.device)
        input_ids, pos = flat[:len(ids)], flat[len(ids):2 * len(ids)]
        wanted = flat[2 * len(ids):]
        if small:  # with a drafter, the forward stores its context K/V too
            assert self.decode is not None
            out = self.decode(self.decode.args(input_ids, pos, attn, wanted),
                              attn.k_caches, attn.v_caches, self.drafter.caches(self.pool.k),
                              self.drafter.caches(self.pool.v))
            if len(logit_rows) < out.shape[0]:  # a forward that gives every row (graphs)
                out = out[wanted]
            return RunnerOutput(out if self.decode.returns_logits else self.model.logits(out),
                                rows)
        hidden, captured = self.states.forward(self.model, items, input_ids, pos, attn,
                                               self.drafter.capture)
        self.drafter.store(captured, pos, attn.slot_mapping)
        if len(logit_rows) < hidden.shape[0]:  # (every row samples in decode and verify steps)
            hidden = hidden[wanted]
        return RunnerOutput(self.model.logits(hidden), rows)
