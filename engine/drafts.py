"""Draft sources: what proposes the tokens a verify step checks.

A source fills the drafts of the verify items the policy assigned to it (`propose`), and counts
a judged step of its drafts (`record`). Three exist:
- `PredictionDrafts`: the caller's Predicted Output, from where the output has reached in it;
- `ContextDrafts`: what followed the last tokens where they occurred before in the request's
  own context (engine.lookup), chosen by the policy where they pay;
- `DrafterDrafts`: the DFlash drafter, one forward for every item's block (its drafts: each
  position's argmax, or a DFlash2 selector's walk), the verify length cut to the drafts the
  drafter is confident enough of under speculation="auto".
Under a grammar each draft is checked against it (engine.constraint): a source's drafts stop
where the grammar would refuse one, and each sampled verify row gets the grammar's mask
(greedy rows are checked at commit: engine.constraint.settle_greedy).

To add a source: a class with a `name`, `propose` (`fill` does it for a list of tokens) and
`record`, listed in
`Engine.__init__`'s sources, and a case in `SpeculationPolicy.source` saying when it proposes.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Protocol

from .constraint import follow, propose
from .errors import RequestError
from .spec import Verdict

if TYPE_CHECKING:
    from .accounting import Accounting, SeqUpdate
    from .policy import SpeculationPolicy
    from .drafter_runner import DrafterRunner
    from .batch import BatchItem

Failed = list[tuple["BatchItem", RequestError]]


class DraftSource(Protocol):
    name: str

    def propose(self, items: list[BatchItem], decoding: int) -> Failed:
        """Fill each item's `draft` (at most its planned length - 1 tokens; fewer where the
        source has fewer or a grammar cuts them) and, under a grammar, its `masks`; items
        whose grammar fails come back with the error, the others are ready to verify.
        `decoding`: requests past their prompt in this step (step costs depend on it)."""
        ...

    def record(self, item: BatchItem, verdict: Verdict, kept: int, update: SeqUpdate) -> None:
        """Count a judged verify step of this source's drafts (`kept` tokens committed)."""
        ...


def fill(items: list[BatchItem], decoding: int, policy: SpeculationPolicy,
         tokens_of: Callable[[BatchItem, int], list[int]]) -> Failed:
    """Each item's drafts: `tokens_of(item, n)`, at most n = its planned length - 1, cut by its
    grammar; and
    the step costs its verify is planned with. Returns the items whose grammar failed."""
    failed = []
    for item in items:
        seq = item.seq
        item.cost = policy.cost_at(decoding, seq.num_tokens)
        tokens = tokens_of(item, item.planned - 1)
        if seq.constraint is None:
            item.draft = tokens
            continue
        t_grammar = time.perf_counter()
        try:
            item.draft, item.masks = follow(seq.constraint, tokens, masks=not seq.params.greedy)
        except RequestError as e:
            failed.append((item, e))
            continue
        seq.counters.grammar_s += time.perf_counter() - t_grammar
    return failed


class PredictionDrafts:
    name = "prediction"

    def __init__(self, policy: SpeculationPolicy) -> None:
        self.policy = policy

    def propose(self, items: list[BatchItem], decoding: int) -> Failed:
        return fill(items, decoding, self.policy, _predicted)

    def record(self, item: BatchItem, verdict: Verdict, kept: int, update: SeqUpdate) -> None:
        pass  # Sequence.follow_prediction counts what the output reproduced


class ContextDrafts:
    name = "context"

    def __init__(self, policy: SpeculationPolicy, accounting: Accounting) -> None:
        self.policy = policy
        self.accounting = accounting

    def propose(self, items: list[BatchItem], decoding: int) -> Failed:
        return fill(items, decoding, self.policy, _looked_up)

    def record(self, item: BatchItem, verdict: Verdict, kept: int, update: SeqUpdate) -> None:
        assert item.draft is not None
        drafted, seq = len(item.draft), item.seq
        c = seq.counters
        c.lookups += 1
        c.lookup_tokens += drafted
        c.lookup_accepted += verdict.accepted
        c.lookup_committed += kept
        self.accounting.speculated(item, kept)
        self.policy.lookup_stats.record(seq.spec.lookup_match, drafted, verdict.accepted)
        update.lookup_tokens = drafted
        total = self.accounting.counters
        total.lookups += 1
        total.lookup_tokens += drafted
        total.lookup_accepted += verdict.accepted


def _predicted(item: BatchItem, n: int) -> list[int]:
    """The next n tokens of the prediction, from where the output has reached in it."""
    seq = item.seq
    assert seq.prediction is not None
    at = len(seq.output_ids)
    return seq.prediction[at:at + n]


def _looked_up(item: BatchItem, n: int) -> list[int]:
    assert item.seq.spec.lookup is not None
    return item.seq.spec.lookup[:n]


class DrafterDrafts:
    name = "drafter"

    def __init__(self, runner: DrafterRunner, policy: SpeculationPolicy,
                 accounting: Accounting) -> None:
        self.runner = runner
        self.policy = policy
        self.accounting = accounting

    def propose(self, items: list[BatchItem], decoding: int) -> Failed:
        policy = self.policy
        block = policy.block_size
        rows = max(item.planned for item in items) - 1
        t0 = time.perf_counter()
        # the drafts, and the drafter's probability of each where step costs choose how many
        # to verify
        proposal = self.runner.propose(items, block, rows, confidence=policy.auto)
        drafts, confidence = proposal.drafts, proposal.confidence
        seconds = time.perf_counter() - t0
        cost = policy.cost_at(decoding, items[0].seq.num_tokens) if policy.auto else None
        self.accounting.drafted(items, seconds,
                                None if cost is None else cost.draft[rows] * cost.plain_s)
        failed = []
        for i, item in enumerate(items):
            n = item.planned - 1
            if confidence is not None:  # verify what the drafter is confident enough of
                # (under a grammar, the confidence of the drafter's own choice even where
                # the grammar will propose another token: an overestimate there)
                item.cost = policy.cost_at(decoding, item.seq.num_tokens)
                assert item.cost is not None
                n = policy.verify_length(confidence[i][:n], item.cost)
            constraint = item.seq.constraint
            if constraint is None:
                item.draft = drafts[i][:n]
                q = proposal.q[i]
                item.q = None if q is None else (q[0][:n], q[1][:n])
                continue
            t_grammar = time.perf_counter()
            try:
                anchor = item.seq.token_slice(item.start, item.start + 1)[0]
                item.draft, item.masks = propose(constraint, proposal.logits[i, :n].float(),
                                                 drafts[i][:n],
                                                 self.runner.chooser(proposal, i, anchor),
                                                 masks=not item.seq.params.greedy)
            except RequestError as e:
                failed.append((item, e))
                continue
            item.seq.counters.grammar_s += time.perf_counter() - t_grammar
        return failed

    def record(self, item: BatchItem, verdict: Verdict, kept: int, update: SeqUpdate) -> None:
        assert item.draft is not None
        drafted, c = len(item.draft), item.seq.counters
        self.accounting.speculated(item, kept)
        c.draft_forwards += 1
        c.draft_tokens += drafted
        c.accepted_tokens += verdict.accepted
        c.acceptance_lengths.append(kept)
        block = self.policy.block_size
        if len(c.accepted_per_position) < block - 1:
            c.accepted_per_position.extend([0] * (block - 1))
        for k in range(verdict.accepted):
            c.accepted_per_position[k] += 1
        if c.drafts is not None:
            c.drafts.append(list(item.draft))
        update.draft_tokens, update.accepted_tokens = drafted, verdict.accepted
        total = self.accounting.counters
        total.draft_tokens += drafted
        total.accepted_tokens += verdict.accepted
