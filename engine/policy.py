"""The speculation policy: per request and step, which draft source proposes, how many drafts
are verified, and when a request decodes plainly instead.

One `SpeculationPolicy` per engine holds the step costs (SpecConfig, measured at load by
engine.calibration under speculation="auto") and what it learns across requests (how often
context drafts hold, engine.lookup.LookupStats); each request's own state is its `SpecState`.

Under "always" (no step costs) a request the drafter serves verifies full blocks. Under "auto":
- the drafter proposes `draft_rows` drafts at first; a step verifies as many of them as commit
  the most tokens per unit of time given the drafter's confidence in each
  (spec.confident_length); a fully accepted block lets the next propose 2n + 1, a shorter one
  halves them again;
- a drafted step that commits fewer tokens than the plain steps it cost is followed by plain
  steps, one at first and twice as many while drafted steps keep failing (up to max_backoff);
- a step may verify drafts read from the request's own context instead (engine.lookup) where
  their expected yield beats the step planned.
A caller's prediction (Predicted Outputs) is verified while the output follows it, whatever the
mode. The output is the same in every case: only the time changes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from .config import SpecConfig, StepCost
from .lookup import ContextIndex, LookupStats
from .sequence import Sequence, SpecState
from .spec import confident_length

if TYPE_CHECKING:
    from .batch import BatchItem

Speculation = Literal["auto", "always"]

PREDICTION_BLOCK = 16
"""Tokens per verify step (anchor + 15 predicted) for a prediction on a sequence the drafter
does not serve (no drafter, or speculative=False)."""


class SpeculationPolicy:
    def __init__(self, spec: SpecConfig, block_size: int) -> None:
        self.spec = spec
        self.block_size = block_size  # the drafter's block (1: no drafter)
        self.lookup_stats = LookupStats(max(block_size - 1, 1))

    @property
    def auto(self) -> bool:
        return self.spec.cost is not None

    def start(self, seq: Sequence, drafts: bool) -> None:
        """A new request's first block: the drafter's (draft_rows + 1 under "auto"), a
        prediction's, or one token."""
        seq.spec = SpecState(drafts=drafts)
        if drafts:
            seq.block_size = self.block_size
            if self.auto:
                seq.spec.draft_rows = self._first_rows()
                seq.block_size = seq.spec.draft_rows + 1
        else:
            seq.block_size = PREDICTION_BLOCK if seq.predicting else 1

    def source(self, seq: Sequence) -> str:
        """Whose drafts a verify step of `seq` checks: the caller's prediction while the output
        follows it, context drafts where the last step chose them, else the drafter's."""
        if seq.predicting:
            return "prediction"
        return "context" if seq.spec.lookup is not None else "drafter"

    def cost_at(self, batch: int, context: int) -> StepCost | None:
        return self.spec.cost_at(batch, context)

    def verify_length(self, confidence: list[float], cost: StepCost) -> int:
        """Drafts to verify out of the drafter's, given its confidence in each."""
        return confident_length(confidence, cost) - 1

    def after(self, item: BatchItem, drafted: int, accepted: int, kept: int,
              decoding: int) -> None:
        """`item`'s step was judged (`drafted` drafts verified, `accepted` of them; `kept`
        tokens committed): set its sequence's next block."""
        seq = item.seq
        if not seq.predicting and not seq.spec.drafts:
            seq.block_size = 1
        if seq.spec.drafts and not seq.predicting and self.auto:
            self._pace(item, drafted, accepted, kept, decoding)

    def _first_rows(self) -> int:
        """Drafts a request proposes at first, and at least after halving."""
        return min(self.spec.draft_rows, self.block_size - 1)

    def _pace(self, item: BatchItem, drafted: int, accepted: int, kept: int,
              decoding: int) -> None:
        seq, state, cost = item.seq, item.seq.spec, item.cost
        rows = state.draft_rows  # the drafter's rows this step (if it ran)
        if item.verifies and item.source == "drafter":  # it ran (its drafts may all be cut)
            assert cost is not None
            spent = cost.draft[rows] + cost.verify[drafted]
            state.draft_rate = (state.draft_rate + kept / spent) / 2
            if kept < spent:  # plain steps made more
                state.cooldown = state.backoff
                state.backoff = min(2 * state.backoff, self.spec.max_backoff)
            else:
                state.backoff = 1
            if drafted == rows and accepted == drafted:
                state.draft_rows = min(2 * rows + 1, self.block_size - 1)
            elif drafted < rows:
                state.draft_rows = max(self._first_rows(), (rows - 1) // 2)
        elif state.cooldown:
            state.cooldown -= 1
        seq.block_size = 1 if state.cooldown else state.draft_rows + 1
        if self.spec.lookup and seq.finish_reason is None and item.start >= len(seq.prompt_ids):
            self._look_up(seq, decoding)  # (not after the prompt's last chunk: its index is
            #                              built later, out of the time to the first token)

    def _look_up(self, seq: Sequence, decoding: int) -> None:
        """Context drafts for the next step (engine.lookup), where the verify of those worth
        verifying is expected to commit more per unit of time than the step planned (the
        drafter's, by its recent drafted steps; or a plain one while it backs off)."""
        state = seq.spec
        if state.index is None:
            state.index = ContextIndex(seq.tokens)
        else:
            state.index.extend(seq.output_ids[len(state.index.tokens) - len(seq.prompt_ids):])
        state.lookup = None
        tokens, match = state.index.propose(min(self.block_size, seq.budget - seq.num_tokens) - 1)
        if not tokens:
            return
        cost = self.cost_at(decoding, seq.num_tokens)
        assert cost is not None
        drafts, rate = self.lookup_stats.plan(match, len(tokens), cost)
        if drafts and rate > (1.0 if state.cooldown else state.draft_rate):
            state.lookup, state.lookup_match = tokens[:drafts], match
            seq.block_size = drafts + 1
