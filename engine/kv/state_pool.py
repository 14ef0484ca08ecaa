"""Per-sequence state slots of a hybrid model's linear-attention (Gated DeltaNet) layers.

A full-attention layer keeps a sequence's history as K/V in the paged pool (pool.py), which the
radix tree can share by prefix; a linear-attention layer keeps it as a fixed-size state per
sequence: the causal conv's window of its last `kernel - 1` inputs and the recurrent matrix state.
`StatePool` preallocates both for `num_slots` sequences, per linear layer l (its ordinal among the
linear layers):

    conv[l]       [num_slots, conv_dim, kernel - 1]   model dtype
    recurrent[l]  [num_slots, Hv, Dk, Dv]             float32

Invariant: the rows of a slot in use hold the state after the `computed` tokens of the sequence
that owns it. A slot is zeroed when handed out (its sequence starts at position 0) and comes back
when the sequence ends. Tensors here, bookkeeping a free list; the scheduler hands slots out.

Snapshots make prefix reuse possible: unlike K/V, a state cannot be cut back to an earlier
position, so where a turn ends (a finished sequence's last cached token) the engine copies its
slot's rows onto the radix node ending there (`snapshot`), and a later request that matches the
prefix up to that node starts from a copy of them (`restore`) instead of from zero. At most
`max_snapshots` are kept, the least recently used dropped first; evicting a node drops its own.
"""

from __future__ import annotations

import collections
from typing import NamedTuple, Sequence

import torch

from .prefix import RadixNode


class StateSnapshot(NamedTuple):
    """A copy of one slot's rows: conv and recurrent state, one tensor per linear layer."""

    conv: list[torch.Tensor]
    recurrent: list[torch.Tensor]


class StatePool:
    """Conv and recurrent state rows for `num_slots` sequences, from preallocated tensors (e.g.
    those of `RecurrentStates.zeros(config, [1] * num_slots, ...)`)."""

    def __init__(self, conv: list[torch.Tensor], recurrent: list[torch.Tensor],
                 max_snapshots: int = 64) -> None:
        if len(conv) != len(recurrent):
            raise ValueError("conv and recurrent states must cover the same layers")
        sizes = {t.shape[0] for t in (*conv, *recurrent)}
        if len(sizes) != 1:
            raise ValueError(f"every state tensor needs the same number of slots, got {sizes}")
        self.conv = conv
        self.recurrent = recurrent
        self.num_slots = sizes.pop()
        self._free = list(range(self.num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._used: set[int] = set()
        self.max_snapshots = max_snapshots
        self._snapshots: collections.OrderedDict[RadixNode, None] = collections.OrderedDict()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        """A free slot, its rows zeroed (the state before a sequence's first token)."""
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} state slots are in use")
        slot = self._free.pop()
        self._used.add(slot)
        for tensor in (*self.conv, *self.recurrent):
            tensor[slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"state slot {slot} is not in use")
        self._used.remove(slot)
        self._free.append(slot)

    def gather(self, slots: Sequence[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of the rows of `slots` (row i: slots[i]): (conv, recurrent), one per layer."""
        index = self._index(slots)
        return ([t.index_select(0, index) for t in self.conv],
                [t.index_select(0, index) for t in self.recurrent])

    def scatter(self, slots: Sequence[int], conv: list[torch.Tensor],
                recurrent: list[torch.Tensor]) -> None:
        """Write rows back (row i into slot slots[i]): the inverse of `gather`."""
        index = self._index(slots)
        for pool, rows in zip((*self.conv, *self.recurrent), (*conv, *recurrent)):
            pool.index_copy_(0, index, rows)

    def snapshot(self, slot: int, node: RadixNode) -> None:
        """Keep a copy of `slot`'s rows on `node` (the state after node.end tokens)."""
        index = self._index([slot])
        node.state = StateSnapshot([t.index_select(0, index) for t in self.conv],
                                   [t.index_select(0, index) for t in self.recurrent])
        self._keep(node)

    def restore(self, slot: int, node: RadixNode) -> None:
        """Set `slot`'s rows to the snapshot `node` holds."""
        state = node.state
        assert isinstance(state, StateSnapshot), "restore from a node without a snapshot"
        self.scatter([slot], state.conv, state.recurrent)
        self._keep(node)

    @property
    def num_snapshots(self) -> int:
        return sum(node.state is not None for node in self._snapshots)

    def _keep(self, node: RadixNode) -> None:
        """Mark `node`'s snapshot the most recently used; drop the least recent over the cap
        (and forget nodes whose snapshot eviction already dropped)."""
        self._snapshots[node] = None
        self._snapshots.move_to_end(node)
        for old in [n for n in self._snapshots if n.state is None]:
            del self._snapshots[old]
        while len(self._snapshots) > self.max_snapshots:
            old, _ = self._snapshots.popitem(last=False)
            old.state = None

    def check_integrity(self) -> None:
        assert len(set(self._free)) == len(self._free), "a slot is free twice"
        assert not self._used & set(self._free), "a slot is both free and in use"
        assert len(self._free) + len(self._used) == self.num_slots, "a slot went missing"

    def _index(self, slots: Sequence[int]) -> torch.Tensor:
        if unknown := [s for s in slots if s not in self._used]:
            raise ValueError(f"state slots {unknown} are not in use")
        device = self.conv[0].device if self.conv else torch.device("cpu")
        return torch.tensor(list(slots), dtype=torch.long, device=device)
