"""Picks each engine step's batch: decode tokens first, then chunks of pending prefills.

Prompts are cut into chunks at fixed positions (multiples of `max_batch_tokens` from position
0), never where a step's budget happens to run out: with each chunk in a forward of its own
(engine.runner), a prompt's K/V is computed the same way in every run, whatever shares its steps,
so speculative and plain decoding see the same prompt bit for bit.

Admission is by KV reservation: a sequence enters the running set only once the pages for its
whole budget (prompt + max_new_tokens, capped by the context) are promised, so a running
sequence never runs out of KV mid-generation and nothing needs preempting. A request that could
not fit even with every unpinned page evicted fails with KVPoolExhaustedError instead of waiting,
unless `relieve` (the runtime's: release idle sessions' pins, the longest idle first) frees pages.

For a hybrid model, admission also hands the sequence a zeroed slot of the `StatePool` (it holds
max_running slots, so one is always free), restored from the snapshot where the reused prefix
ends (only such a prefix is reused), and `remove` returns it. Nothing is preempted, so a
sequence never recomputes from position 0 while holding a slot. Its prefill chunks end at every
multiple of `state_interval`, where the engine snapshots the state.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch

from .config import SchedulerConfig, StepCost
from .errors import KVPoolExhaustedError
from .kv.manager import KVManager
from .kv.state_pool import StatePool
from .sequence import Sequence, Status


@dataclass
class BatchItem:
    """`num_tokens` new tokens of `seq` go through this forward (from position `start`).

    A verify item (num_tokens > 1 on a sequence past its prompt) feeds the sequence's last token
    (the anchor) followed by `draft`, the drafter's proposals (or the caller's prediction),
    which the engine fills in.
    Everything is fixed when the item is made, before the forward moves the sequence on, except
    that a constrained block shrinks when its grammar terminates inside the drafts."""

    seq: Sequence
    num_tokens: int
    draft: list[int] | None = None
    masks: list[torch.Tensor] | None = None  # constrained verify: allowed tokens per block row
    # whose drafts: the drafter's, the caller's prediction, or read from the context (engine.lookup)
    source: Literal["drafter", "prediction", "context"] = "drafter"
    cost: StepCost | None = None        # the step costs its verify length was chosen with
    forward_s: float = 0.0              # its share of the forward's seconds (by tokens fed)
    start: int = field(init=False)
    verifies: bool = field(init=False)
    samples: bool = field(init=False)   # yields the sequence's next token(s)

    def __post_init__(self) -> None:
        self.start = self.seq.computed
        self.verifies = not self.seq.prefilling and self.num_tokens > 1
        self.samples = self.verifies or self.start + self.num_tokens == self.seq.num_tokens

    def token_ids(self) -> list[int]:
        if self.verifies:
            assert self.draft is not None and len(self.draft) == self.num_tokens - 1
            return [*self.seq.token_slice(self.start, self.start + 1), *self.draft]
        return self.seq.token_slice(self.start, self.start + self.num_tokens)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVManager, states: StatePool | None = None,
                 state_interval: int = 0):
        if states is not None and states.num_slots < config.max_running:
            raise ValueError(f"{states.num_slots} state slots for {config.max_running} "
                             "running sequences")
        self.config = config
        self.kv = kv
        self.states = states
        self.state_interval = state_interval if states is not None else 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # set by the layer above (the runtime): frees pinned pages that nothing runs on (idle
        # sessions) when a request needs them; returns False when it had nothing to free
        self.relieve: Callable[[], bool] | None = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.state_slot is not None:
            assert self.states is not None
            self.states.free(seq.state_slot)
            seq.state_slot = None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[BatchItem], list[Sequence]]:
        """Returns (this step's batch, sequences that failed admission with an error)."""
        budget = self.config.max_batch_tokens
        items: list[BatchItem] = []
        decoding = [s for s in self.running if not s.prefilling]
        prefilling = [s for s in self.running if s.prefilling]
        for seq in decoding:
            if budget <= 0:
                break
            # a speculative sequence verifies anchor + drafts, never past its KV reservation
            n = max(1, min(seq.block_size, seq.budget - seq.computed, budget))
            items.append(BatchItem(seq, n))
            budget -= n
        prefills = 0
        for seq in prefilling:
            if budget <= 0:
                break
            n = self._prefill_chunk(seq)
            if n > budget and prefills:
                continue  # the next step's (a chunk is never cut to fit)
            items.append(BatchItem(seq, n))
            budget -= n
            prefills += 1
        failed: list[Sequence] = []
        while budget > 0 and self.waiting and len(self.running) < self.config.max_running:
            seq = self.waiting[0]
            admitted, error = self._admit(seq)
            if error is not None:
                self.waiting.popleft()
                seq.error, seq.finish_reason, seq.status = error, "error", Status.FINISHED
                failed.append(seq)
                continue
            if not admitted:
                break  # first come, first served: wait for pages to free up
            self.waiting.popleft()
            self.running.append(seq)
            n = self._prefill_chunk(seq)
            if n > budget and prefills:
                continue  # running now; its first chunk goes in the next step
            items.append(BatchItem(seq, n))
            budget -= n
            prefills += 1
        return items, failed

    def _prefill_chunk(self, seq: Sequence) -> int:
        """The next prefill chunk's length: what is left of the prompt up to the next multiple
        of max_batch_tokens (and, hybrid, of state_interval, where a snapshot is taken), counted
        from position 0. So a prompt is cut the same way in every run, whatever shares its
        steps; a step takes its first chunk even past the budget (by at most one chunk)."""
        at = seq.computed
        n = min(len(seq.prompt_ids), (at // self.config.max_batch_tokens + 1)
                * self.config.max_batch_tokens) - at
        if self.state_interval:
            n = min(n, (at // self.state_interval + 1) * self.state_interval - at)
        return n

    def _admit(self, seq: Sequence) -> tuple[bool, Exception | None]:
        kv = self.kv.begin(seq.prompt_ids, max_cached=len(seq.prompt_ids) - 1 if seq.reuse else 0,
                           with_state=self.states is not None)
        if self.kv.reserve(kv, seq.budget):
            seq.kv = kv
            if self.states is not None:
                seq.state_slot = self.states.alloc()
                if kv.length:  # resume from the snapshot where the reused prefix ends
                    assert kv.node is not None
                    self.states.restore(seq.state_slot, kv.node)
            seq.status = Status.RUNNING
            seq.counters.cached_tokens = kv.length
            seq.counters.admitted_at = time.perf_counter()
            return True, None
        cached = kv.length
        self.kv.release(kv)  # (resets kv)
        error = self.never_fits(seq, cached)
        # a request that cannot fit while pins hold pages, or that waits with nothing running
        # that could free any: idle pins give way (one per step), and admission tries again
        if (error is not None or not self.running) and self.relieve is not None \
                and self.relieve():
            return False, None
        return False, error

    def never_fits(self, seq: Sequence, cached: int) -> KVPoolExhaustedError | None:
        """The error for a sequence whose budget, with `cached` tokens of it already in shared
        pages, needs more pages than could ever be freed (pinned sessions hold the rest)."""
        page = self.kv.page_size
        needed = -(-seq.budget // page) - cached // page + 1  # +1: copy-on-write of a shared page
        available = self.kv.max_reservable()
        if needed <= available:
            return None
        return KVPoolExhaustedError(
            f"request needs {needed} KV pages ({seq.budget} tokens) but at most {available} of "
            f"{self.kv.stats()['pages_total']} can be freed; pinned sessions hold the rest "
            "(close agents or enlarge the pool)"
        )
