"""Picks each engine step's batch: decode tokens first, then chunks of pending prefills; while
prompts wait to be prefilled, up to `prefill_first_steps` steps in a row take only their chunks
(the decode rows wait), so a burst of requests gets its first tokens sooner.

Prompts are cut into chunks at fixed positions (multiples of `max_batch_tokens` from position
0), never where a step's budget happens to run out: with each chunk in a forward of its own
(engine.runner), a prompt's K/V is computed the same way in every run, whatever shares its steps,
so speculative and plain decoding see the same prompt bit for bit. (Where the decode/verify
forward takes the chunks too, AMX, every row is computed alone and the cuts change nothing.)

Admission is by KV reservation: a sequence enters the running set only once the pages for its
whole budget (prompt + max_new_tokens, capped by the context) are promised, so a running
sequence never runs out of KV mid-generation and nothing needs preempting. A request that could
not fit even with every unpinned page evicted fails with KVPoolExhaustedError instead of waiting,
unless `relieve` (the runtime's: release idle sessions' pins, the longest idle first) frees pages.

Sequences are admitted first come, first served, except that one whose prompt shares a prefix
with a sequence still prefilling it waits until that prefix is cached, then reuses it
(`_prefix_in_flight`).

Admission and removal tell the target's per-sequence states (engine.states): a hybrid model's
sequence gets a linear-attention state slot (max_running of them, so one is always free),
restored where its reused prefix ends (only prefixes that end at a snapshot are reused), and
its prefill chunks also end at every multiple of the states' `interval`, where the engine
snapshots them. Nothing is preempted, so a sequence never recomputes from position 0.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

from .batch import BatchItem
from .config import SchedulerConfig
from .errors import KVPoolExhaustedError
from .kv.manager import KVManager
from .kv.prefix import common_prefix
from .sequence import Sequence, Status
from .states import NoStates, SequenceStates


HOLD_MIN_TOKENS = 64
"""The fewest prompt tokens a held sequence must gain by waiting for another's prefill: waiting
costs it a step's fixed work (decode rows, drafting, host), which on the embedded model is about
what 20-50 prompt tokens cost to prefill."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVManager,
                 states: SequenceStates = NoStates()):
        self.config = config
        self.kv = kv
        self.states = states
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # set by the layer above (the runtime): frees pinned pages that nothing runs on (idle
        # sessions) when a request needs them; returns False when it had nothing to free
        self.relieve: Callable[[], bool] | None = None
        self._prefill_only = 0  # steps in a row that left the decode rows out

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.states.release(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[BatchItem], list[Sequence]]:
        """Returns (this step's batch, sequences that failed admission with an error)."""
        budget = self.config.max_batch_tokens
        decoding = [s for s in self.running if not s.prefilling]
        prefill_first = bool(decoding) and self._prefill_only < self.config.prefill_first_steps
        if prefill_first:
            items, failed = self._prefills([], budget)
            if items:  # decode rows wait this step
                self._prefill_only += 1
                return items, failed
        self._prefill_only = 0
        items = []
        for seq in decoding:
            if budget <= 0:
                break
            # a speculative sequence verifies anchor + drafts, never past its KV reservation
            n = max(1, min(seq.block_size, seq.budget - seq.computed, budget))
            items.append(BatchItem(seq, n))
            budget -= n
        if prefill_first:  # nothing to prefill, and admission was tried once this step
            return items, failed
        return self._prefills(items, budget)

    def _prefills(self, items: list[BatchItem], budget: int
                  ) -> tuple[list[BatchItem], list[Sequence]]:
        """`items` with the next chunks of running prefills and the first chunks of admitted
        sequences added within `budget`; and the sequences that failed admission."""
        prefills = 0
        for seq in [s for s in self.running if s.prefilling]:
            if budget <= 0:
                break
            n = self._prefill_chunk(seq)
            if n > budget and prefills:
                continue  # the next step's (a chunk is never cut to fit)
            items.append(BatchItem(seq, n))
            budget -= n
            prefills += 1
        failed: list[Sequence] = []
        held: list[Sequence] = []
        while budget > 0 and self.waiting and len(self.running) < self.config.max_running:
            seq = self.waiting[0]
            if len(held) < self.config.max_running and self._prefix_in_flight(seq):
                held.append(self.waiting.popleft())
                continue
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
        self.waiting.extendleft(reversed(held))
        return items, failed

    def _prefix_in_flight(self, seq: Sequence) -> bool:
        """Whether `seq` should wait for a running sequence that is prefilling a prefix of its
        prompt HOLD_MIN_TOKENS or more beyond what the prefix cache holds now: admitted once that
        prefix is computed and cached (the engine caches each prefill chunk), it reuses those
        tokens instead of computing them a second time. Agents of one application start with
        the same system prompt and tools; several arriving together compute them once. The
        held sequence waits for steps that would otherwise compute those tokens twice."""
        if not seq.reuse or self.states.snapshots_only:
            return False
        prompt = seq.prompt_ids[:-1]  # (the last prompt token is always computed)
        shared = max((common_prefix(prompt, other.prompt_ids) for other in self.running
                      if other.prefilling), default=0)
        return shared - self.kv.cached_length(prompt) >= HOLD_MIN_TOKENS

    def _prefill_chunk(self, seq: Sequence) -> int:
        """The next prefill chunk's length: what is left of the prompt up to the next multiple
        of max_batch_tokens (and of the states' interval, where a snapshot is taken), counted
        from position 0. So a prompt is cut the same way in every run, whatever shares its
        steps; a step takes its first chunk even past the budget (by at most one chunk)."""
        at = seq.computed
        n = min(len(seq.prompt_ids), (at // self.config.max_batch_tokens + 1)
                * self.config.max_batch_tokens) - at
        interval = self.states.interval
        if interval:
            n = min(n, (at // interval + 1) * interval - at)
        return n

    def _admit(self, seq: Sequence) -> tuple[bool, Exception | None]:
        kv = self.kv.begin(seq.prompt_ids, max_cached=len(seq.prompt_ids) - 1 if seq.reuse else 0,
                           with_state=self.states.snapshots_only)
        if self.kv.reserve(kv, seq.budget):
            seq.kv = kv
            self.states.admit(seq)
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
