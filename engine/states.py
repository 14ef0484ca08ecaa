"""What a target keeps per sequence besides its paged K/V, behind one interface the scheduler,
the runner and the engine call.

`NoStates`: a dense target (every layer full attention) keeps nothing else; each call is free.
`LinearStates`: a hybrid target (Qwen3.5) keeps each running sequence's linear-attention state
in a `StatePool` slot (engine.kv.state_pool). Admission hands out a slot, restored from the
snapshot where the reused prefix ends (the prefix cache reuses only prefixes that end at one);
a prefill chunk that ends the prompt or a multiple of `interval`, and a finished sequence,
leave a snapshot on the radix node where their cached tokens end, so the next turn computes
only its new tokens. Every forward gathers its sequences' rows, advances them and writes them
back; a verify block runs stepwise through the linear layers and keeps its inputs until the
engine has judged it, and `settle` then rewrites the state as it stood after the committed
tokens (a state cannot be cut back as K/V can).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from .kv.manager import KVManager
from .kv.state_pool import StatePool
from .models.gated_deltanet import RecurrentStates, StepInputs, replay

if TYPE_CHECKING:
    from .attention import PagedAttention
    from .models.qwen3 import CausalLM
    from .models.qwen3_5 import HybridCausalLM
    from .batch import BatchItem
    from .sequence import Sequence


class SequenceStates(Protocol):
    snapshots_only: bool   # reuse only cached prefixes that end at a state snapshot
    interval: int          # prefill chunks end at multiples of it (0: no such bound)
    chunks_apart: bool     # each prefill chunk may run in a forward of its own

    def admit(self, seq: Sequence) -> None:
        """`seq` starts running, its cached prefix (seq.kv) reused."""

    def release(self, seq: Sequence) -> None:
        """`seq` stops running (finished, failed or aborted)."""

    def prefilled(self, item: BatchItem) -> None:
        """A prefill chunk was computed."""

    def finished(self, seq: Sequence) -> None:
        """`seq` ended well, its tokens cached (seq.kv at their last node)."""

    def forward(self, model: CausalLM | HybridCausalLM, items: list[BatchItem],
                input_ids: torch.Tensor, positions: torch.Tensor, attn: PagedAttention,
                capture: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's eager forward over `items`: (hidden, captured layers' hidden)."""

    def settle(self, seq_id: int, fed: int) -> None:
        """A verify block was judged: keep what the first `fed` of its tokens made."""


class NoStates:
    snapshots_only = False
    interval = 0
    chunks_apart = True

    def admit(self, seq: Sequence) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass

    def prefilled(self, item: BatchItem) -> None:
        pass

    def finished(self, seq: Sequence) -> None:
        pass

    def forward(self, model: CausalLM | HybridCausalLM, items: list[BatchItem],
                input_ids: torch.Tensor, positions: torch.Tensor, attn: PagedAttention,
                capture: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        return model(input_ids, positions, attn, capture)

    def settle(self, seq_id: int, fed: int) -> None:
        pass


class _Rollback(NamedTuple):
    """What a hybrid verify block needs to be rolled back to a prefix of its tokens."""

    slot: int                       # the sequence's state slot
    tokens: int                     # tokens the block fed
    conv: list[torch.Tensor]        # per linear layer: the window before the block [C, K - 1]
    recurrent: list[torch.Tensor]   # the state before the block [Hv, Dk, Dv]
    inputs: list[StepInputs]        # per linear layer: the block's recorded inputs


class LinearStates:
    snapshots_only = True
    chunks_apart = False  # every item in one forward (the kernel linears are not row-invariant)

    def __init__(self, pool: StatePool, kv: KVManager, interval: int, max_running: int) -> None:
        if pool.num_slots < max_running:
            raise ValueError(f"{pool.num_slots} state slots for {max_running} running sequences")
        self.pool = pool
        self.kv = kv
        self.interval = interval
        self._rollbacks: dict[int, _Rollback] = {}  # by sequence id: this step's verify blocks

    def admit(self, seq: Sequence) -> None:
        assert seq.kv is not None
        seq.state_slot = self.pool.alloc()
        if seq.kv.length:  # resume from the snapshot where the reused prefix ends
            assert seq.kv.node is not None
            self.pool.restore(seq.state_slot, seq.kv.node)

    def release(self, seq: Sequence) -> None:
        if seq.state_slot is not None:
            self.pool.free(seq.state_slot)
            seq.state_slot = None

    def prefilled(self, item: BatchItem) -> None:
        """Its tokens go into the prefix cache and the state after them onto the node ending
        there where the chunk ended the prompt or a multiple of `interval`."""
        seq, end = item.seq, item.start + item.num_tokens
        if end < len(seq.prompt_ids) and not (self.interval and end % self.interval == 0):
            return
        assert seq.kv is not None and seq.state_slot is not None
        if self.kv.cache_running(seq.kv, seq.prompt_ids):
            assert seq.kv.node is not None
            self.pool.snapshot(seq.state_slot, seq.kv.node)

    def finished(self, seq: Sequence) -> None:
        if seq.state_slot is not None and seq.kv is not None and seq.kv.length:
            assert seq.kv.node is not None  # the state after the cached tokens, kept there
            self.pool.snapshot(seq.state_slot, seq.kv.node)

    def forward(self, model: CausalLM | HybridCausalLM, items: list[BatchItem],
                input_ids: torch.Tensor, positions: torch.Tensor, attn: PagedAttention,
                capture: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each item's slot rows in, advanced rows back; verify blocks stepwise, with what
        `settle` needs to roll them back kept."""
        self._rollbacks.clear()  # a step's verify blocks are settled before the next forward
        slots = []
        for item in items:
            assert item.seq.state_slot is not None, "a hybrid sequence runs with a state slot"
            slots.append(item.seq.state_slot)
        # Correctness first: the rows are copied out and back. Layers indexing the pool's
        # tensors by slot in place would save both copies (the whole state, every forward).
        conv, recurrent = self.pool.gather(slots)
        stepwise = frozenset(i for i, item in enumerate(items) if item.verifies)
        before = {i: ([c[i].clone() for c in conv], [r[i].clone() for r in recurrent])
                  for i in stepwise}
        states = RecurrentStates([item.num_tokens for item in items], conv, recurrent, stepwise)
        out = model(input_ids, positions, attn, states, capture)  # type: ignore[call-arg]
        self.pool.scatter(slots, states.conv, states.recurrent)
        self._rollbacks.update({
            items[i].seq.id: _Rollback(slots[i], items[i].num_tokens, *before[i],
                                       [states.inputs[(layer, i)] for layer in range(len(conv))])
            for i in stepwise})
        return out.hidden, out.captured

    def settle(self, seq_id: int, fed: int) -> None:
        rollback = self._rollbacks.pop(seq_id, None)
        if rollback is None or fed == rollback.tokens:
            return  # not a verify block of the last forward, or every token stays
        assert 0 <= fed < rollback.tokens
        conv, recurrent = [], []
        for window, state, inputs in zip(rollback.conv, rollback.recurrent, rollback.inputs):
            window, state = replay(window, state, inputs, fed)
            conv.append(window[None])
            recurrent.append(state[None])
        self.pool.scatter([rollback.slot], conv, recurrent)
