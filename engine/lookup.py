"""Drafts read from the context itself: where a sequence's last tokens occurred before, what
followed them there (prompt lookup, as vLLM's and SGLang's n-gram speculation).

Agent replies copy much of their context: tool and argument names from the tool list, values
from the user's message and earlier tool results, JSON keys and boilerplate. Such a proposal
costs no forward, so where it is likely to hold it is cheaper to verify than the drafter's
block (whose forward costs about half a plain step on a CPU), and where the drafter backs off
it can still beat a plain step. The target verifies it like any draft: the output is the same.

`ContextIndex` follows one sequence's tokens as they are committed: for each pair of tokens the
positions after its last few occurrences, and after each token's last two. `propose` picks the
earlier occurrence that matches the most trailing tokens (up to `MAX_MATCH`) and returns what
followed it, with that match length. `LookupStats` learns, per match length and draft
position, how often the target accepts such drafts (over every request of an engine: a
model's habits of copying), and `plan` chooses how many of a proposal to verify from those
rates and the measured step costs (engine.config.StepCost).
"""

from __future__ import annotations

from .config import StepCost

MAX_MATCH = 8
"""Trailing tokens compared; longer matches are counted as this long."""

KEEP = 4
"""Occurrences of a token pair remembered (the most recent)."""


class ContextIndex:
    """Where each token pair (and token) of one sequence occurred, as positions just after."""

    def __init__(self, tokens: list[int] | None = None) -> None:
        self.tokens: list[int] = []
        self._after_pair: dict[tuple[int, int], list[int]] = {}
        self._after_token: dict[int, list[int]] = {}
        if tokens:
            self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append committed tokens."""
        seq, pairs, singles = self.tokens, self._after_pair, self._after_token
        for token in tokens:
            end = len(seq) + 1  # the position just after `token`
            if seq:
                found = pairs.get((seq[-1], token))
                if found is None:
                    pairs[(seq[-1], token)] = [end]
                else:
                    found.append(end)
                    if len(found) > KEEP:
                        del found[0]
            found = singles.get(token)
            if found is None:
                singles[token] = [end]
            else:
                found.append(end)
                if len(found) > 2:
                    del found[0]
            seq.append(token)

    def propose(self, limit: int) -> tuple[list[int], int]:
        """The `limit` tokens that followed the best earlier match of the trailing tokens, and
        its length in tokens (0 and no tokens: the last token never occurred before). A match
        that ends fewer than `limit` tokens back repeats: it goes on into its own proposal."""
        seq = self.tokens
        n = len(seq)
        if n < 2 or limit < 1:
            return [], 0
        best, match = 0, 0
        for end in reversed(self._after_pair.get((seq[-2], seq[-1]), ())):
            if end == n:
                continue  # the trailing pair itself
            m = 2
            while m < MAX_MATCH and end - m > 0 and seq[end - m - 1] == seq[n - m - 1]:
                m += 1
            if m > match:
                best, match = end, m
        if not match:
            ends = [end for end in self._after_token.get(seq[-1], ()) if end != n]
            if not ends:
                return [], 0
            best, match = ends[-1], 1
        proposal = seq[best:best + limit]
        period = n - best  # past the end, the match goes on into the proposal itself
        while len(proposal) < limit:
            proposal.append(proposal[len(proposal) - period])
        return proposal, match


class LookupStats:
    """How often the target accepts context drafts, by match length and draft position:
    accepted[m][j] of tried[m][j], draft j + 1 judged after drafts 1..j were all accepted.
    Each starts at a prior of three in four accepted: optimistic, so that a match length not
    tried yet gets tried (and its estimate falls where its drafts fail)."""

    PRIOR = (3.0, 4.0)  # accepted, tried

    def __init__(self, drafts: int) -> None:
        self.drafts = drafts
        self.accepted = [[self.PRIOR[0]] * drafts for _ in range(MAX_MATCH + 1)]
        self.tried = [[self.PRIOR[1]] * drafts for _ in range(MAX_MATCH + 1)]

    def record(self, match: int, drafted: int, accepted: int) -> None:
        """A verify of `drafted` context drafts proposed at `match`; `accepted` held."""
        tried, hits = self.tried[match], self.accepted[match]
        for j in range(min(drafted, accepted + 1)):
            tried[j] += 1
            if j < accepted:
                hits[j] += 1

    def plan(self, match: int, proposed: int, cost: StepCost) -> tuple[int, float]:
        """(drafts to verify, tokens committed per plain step of cost expected): the count of
        the proposal's leading drafts that commits the most per unit of time; (0, 1.0) where
        a plain step does better than any."""
        tried, hits = self.tried[match], self.accepted[match]
        best, rate = 0, 1.0
        held, expected = 1.0, 1.0
        for j in range(min(proposed, self.drafts, len(cost.verify) - 1)):
            held *= hits[j] / tried[j]
            expected += held
            r = expected / cost.verify[j + 1]
            if r > rate:
                best, rate = j + 1, r
        return best, rate
