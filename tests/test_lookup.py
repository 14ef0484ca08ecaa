"""Context drafts (engine.lookup): what the index proposes, and how many drafts the
learned rates and step costs choose to verify."""

from __future__ import annotations

import random

from agentflash.engine.config import StepCost
from agentflash.engine.lookup import KEEP, MAX_MATCH, ContextIndex, LookupStats


def test_the_proposal_continues_the_longest_earlier_match():
    #         0  1  2  3  4  5  6  7  8  9 10 11 12
    tokens = [5, 1, 2, 3, 9, 9, 7, 2, 3, 8, 1, 2, 3]
    # the trailing 1 2 3 occurred at 1..3 (then 9 9 7 ..); 2 3 alone at 7..8 (then 8)
    assert ContextIndex(tokens).propose(4) == ([9, 9, 7, 2], 3)
    assert ContextIndex(tokens).propose(1) == ([9], 3)
    # a single token that occurred before: its most recent earlier occurrence
    assert ContextIndex([4, 6, 0, 4]).propose(3) == ([6, 0, 4], 1)
    # nothing occurred before: no proposal
    assert ContextIndex([1, 2, 3]).propose(5) == ([], 0)
    assert ContextIndex([7]).propose(5) == ([], 0)
    # a match that ends near the end repeats: a run of one token, a cycle of three
    assert ContextIndex([3, 3, 3, 3]).propose(5) == ([3, 3, 3, 3, 3], 3)
    assert ContextIndex([1, 4, 5, 6, 4, 5, 6]).propose(7) == ([4, 5, 6, 4, 5, 6, 4], 3)


def test_matches_are_counted_up_to_max_match_and_ties_go_to_the_most_recent():
    block = list(range(10, 10 + MAX_MATCH + 3))
    tokens = block + [1] + block[:-1] + [2] + block[:-1]
    proposal, match = ContextIndex(tokens).propose(2)
    assert match == MAX_MATCH and proposal == [2, 10]  # both match past MAX_MATCH: the later


def test_building_at_once_equals_extending_token_by_token():
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(400)]
    whole, grown = ContextIndex(tokens), ContextIndex()
    for i in range(0, len(tokens), 7):
        grown.extend(tokens[i:i + 7])
    assert grown.tokens == tokens
    for limit in (1, 4, 15):
        assert whole.propose(limit) == grown.propose(limit)


def test_every_proposal_follows_an_earlier_occurrence_of_its_match():
    rng = random.Random(1)
    tokens = [rng.randrange(8) for _ in range(300)]
    index = ContextIndex()
    for t in tokens:
        index.extend([t])
        seq = index.tokens
        proposal, match = index.propose(6)
        if not match:
            assert seq[-1] not in seq[:-1]
            continue
        tail = seq[len(seq) - match:]
        ends = [e for e in range(match, len(seq)) if seq[e - match:e] == tail]
        assert ends and len(proposal) == 6, (seq, match)
        assert any(seq[e:e + 6] == proposal[:len(seq) - e] for e in ends)
        # no earlier occurrence among the pair's last KEEP (the trailing one included) matches
        # more tokens
        if match < MAX_MATCH and len(seq) > 2:
            pair_ends = [e for e in range(2, len(seq)) if seq[e - 2:e] == seq[-2:]][-(KEEP - 1):]
            longer = seq[len(seq) - match - 1:]
            assert not any(seq[e - match - 1:e] == longer for e in pair_ends if e > match)


def test_plan_verifies_what_its_rates_pay_for():
    cost = StepCost((0.0,) * 8, tuple(1.0 + 0.2 * k for k in range(8)))  # a token: +0.2
    stats = LookupStats(7)
    # the optimistic prior (3 in 4) pays for some drafts of a fresh match length
    drafts, rate = stats.plan(3, 7, cost)
    assert drafts > 0 and rate > 1.0
    # a match length whose drafts always fail: a plain step is better
    for _ in range(50):
        stats.record(1, 3, 0)
    assert stats.plan(1, 7, cost) == (0, 1.0)
    # one whose drafts always hold: all of them, but never more than proposed
    for _ in range(50):
        stats.record(6, 7, 7)
    assert stats.plan(6, 7, cost)[0] == 7
    assert stats.plan(6, 2, cost)[0] == 2


def test_record_counts_a_position_only_where_it_was_judged():
    stats = LookupStats(4)
    tried = [list(row) for row in stats.tried]
    hits = [list(row) for row in stats.accepted]
    stats.record(2, 4, 1)   # draft 1 accepted, draft 2 rejected, drafts 3-4 never judged
    assert [a - b for a, b in zip(stats.tried[2], tried[2])] == [1, 1, 0, 0]
    assert [a - b for a, b in zip(stats.accepted[2], hits[2])] == [1, 0, 0, 0]
    stats.record(2, 2, 2)   # both verified drafts accepted
    assert [a - b for a, b in zip(stats.tried[2], tried[2])] == [2, 2, 0, 0]
    assert [a - b for a, b in zip(stats.accepted[2], hits[2])] == [2, 1, 0, 0]
