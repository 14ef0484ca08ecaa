"""What the engine reports: per-step updates, completions, and the counters of what it did.

`Accounting` keeps the engine's totals (EngineCounters) and each sequence's (SeqCounters) as
steps run: tokens fed by kind, forwards and their time (a forward's seconds shared by tokens
fed), and what the counterfactuals of agentflash.usage need: the prefill cost units of the
chunks a sequence computed and of its whole prompt (PrefillCost), and the seconds plain decode
steps would have taken for the tokens its verify steps committed (step costs at load times the
machine's slowdown since, engine.slowdown).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .config import PrefillCost
from .kv.manager import Pin
from .sequence import SeqCounters
from .slowdown import Slowdown

if TYPE_CHECKING:
    from .policy import SpeculationPolicy
    from .batch import BatchItem


@dataclass
class SeqUpdate:
    """What happened to one sequence in one step."""

    seq_id: int
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: Exception | None = None
    draft_tokens: int = 0       # proposed by the drafter this step
    accepted_tokens: int = 0    # of those, accepted by the target
    lookup_tokens: int = 0      # proposed from the context this step (engine.lookup)


@dataclass
class Completion:
    """A finished sequence."""

    seq_id: int
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str
    counters: SeqCounters
    pin: Pin | None = None
    error: Exception | None = None


@dataclass
class EngineCounters:
    """Engine-wide totals since start."""

    steps: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    cached_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    draft_context_tokens: int = 0
    lookups: int = 0            # verify steps of context drafts (engine.lookup)
    lookup_tokens: int = 0
    lookup_accepted: int = 0
    draft_s: float = 0.0        # drafter forwards
    target_s: float = 0.0       # target forwards (prefill, decode and verify)
    step_s: float = 0.0         # whole steps: the rest is scheduling and bookkeeping


class Accounting:
    def __init__(self, policy: SpeculationPolicy, drafter: bool, chunk: int) -> None:
        self.counters = EngineCounters()
        self.policy = policy          # its step costs price plain steps at load
        self.drafter = drafter        # drafter context K/V is computed for every fed token
        self.chunk = chunk            # max_batch_tokens: how a whole prompt would be computed
        self.prefill_cost: PrefillCost | None = None  # measured by the layer above, if at all
        self.slowdown = Slowdown()    # how much slower than at load the machine runs now

    def forward(self, items: list[BatchItem], seconds: float, decoding: int) -> None:
        """A target forward over `items` that took `seconds`, `decoding` of them past their
        prompts."""
        c = self.counters
        fed = sum(item.num_tokens for item in items)
        c.steps += 1
        c.target_forwards += 1
        c.target_s += seconds
        if self.drafter:
            c.draft_context_tokens += fed
        quiet = self._quiet_s(items, decoding)
        if quiet is not None:
            self.slowdown.add(seconds, quiet)
        for item in items:
            self._count(item, seconds * item.num_tokens / fed)

    def drafted(self, items: list[BatchItem], seconds: float, quiet_s: float | None) -> None:
        """A drafter forward over `items`' blocks that took `seconds` (`quiet_s` at load)."""
        self.counters.draft_s += seconds
        self.counters.draft_forwards += 1
        for item in items:
            item.seq.counters.draft_compute_s += seconds / len(items)
        if quiet_s is not None:
            self.slowdown.add(seconds, quiet_s)

    def speculated(self, item: BatchItem, kept: int) -> None:
        """A drafted or context-drafted verify step's time, and what plain decode steps for
        its `kept` tokens would have taken: their time at load (its step costs, one
        sequence's share), times how much slower the machine runs now."""
        c = item.seq.counters
        c.speculated_s += item.forward_s
        cost = item.cost
        slowdown = self.slowdown.factor
        if cost is None or slowdown is None or c.plain_equivalent_s is None:
            c.plain_equivalent_s = None
        else:
            c.plain_equivalent_s += kept * cost.plain_s / cost.batch * slowdown

    def _count(self, item: BatchItem, forward_s: float) -> None:
        seq, c, n = item.seq, item.seq.counters, item.num_tokens
        item.forward_s = forward_s
        c.target_forwards += 1
        if self.drafter:
            c.draft_context_tokens += n
        if item.start < len(seq.prompt_ids):
            c.prefill_tokens += n
            c.prefill_compute_s += forward_s
            self.counters.prefill_tokens += n
            cost = self.prefill_cost
            if cost is None or c.prefill_units is None:
                c.prefill_units = c.recompute_units = None
            else:
                c.prefill_units += cost.units(n, item.start)
                if item.start + n == len(seq.prompt_ids):  # what computing all of it costs
                    c.recompute_units = cost.chunked(len(seq.prompt_ids), self.chunk)
        else:
            c.decode_tokens += n
            c.decode_compute_s += forward_s
            if item.verifies:
                c.verify_compute_s += forward_s
            self.counters.decode_tokens += n

    def _quiet_s(self, items: list[BatchItem], decoding: int) -> float | None:
        """What a forward over `items` took at load (step and prefill costs), if known."""
        auto = self.policy.auto
        total = 0.0
        for item in items:
            if item.start < len(item.seq.prompt_ids):
                if self.prefill_cost is None:
                    return None
                total += self.prefill_cost.units(item.num_tokens, item.start)
            elif not auto:
                return None
            elif item.cost is not None:  # a verify (its source set the costs it was planned with)
                cost = item.cost
                total += cost.verify[item.num_tokens - 1] * cost.plain_s / cost.batch
            else:  # a plain decode row
                total += self.policy.spec.plain_s_at(decoding, item.start) or 0.0
        return total
