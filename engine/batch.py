"""One sequence's part of an engine step: the tokens it feeds the forward, and what the step
learns about them on the way (drafts, grammar masks, the costs it was planned with, its share
of the forward's time)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import StepCost
from .sequence import Sequence


@dataclass
class BatchItem:
    """`planned` new tokens of `seq` go through this forward (from position `start`).

    A verify item (planned > 1 on a sequence past its prompt) feeds the sequence's last token
    (the anchor) followed by `draft`, which its draft source (engine.drafts) fills in: at most
    planned - 1 tokens, fewer where the source has fewer, the policy verifies fewer or a
    grammar cuts them. `num_tokens` is what the forward feeds: the anchor and the drafts once
    they are filled in, else `planned`."""

    seq: Sequence
    planned: int
    draft: list[int] | None = None
    masks: list[torch.Tensor | None] | None = None  # constrained verify: allowed tokens per
                                        # block row (engine.constraint.Masks; None where a
                                        # greedy row's was not needed)
    q: tuple[torch.Tensor, torch.Tensor] | None = None  # sampled drafts: the distribution each
                                        # was drawn from (probs [n, K], token ids [n, K]);
                                        # None: each draft was chosen for certain
    source: str = ""                    # whose drafts (engine.drafts: a DraftSource's name)
    cost: StepCost | None = None        # the step costs its verify was planned with
    forward_s: float = 0.0              # its share of the forward's seconds (by tokens fed)
    start: int = field(init=False)
    verifies: bool = field(init=False)
    samples: bool = field(init=False)   # yields the sequence's next token(s)

    def __post_init__(self) -> None:
        self.start = self.seq.computed
        self.verifies = not self.seq.prefilling and self.planned > 1
        self.samples = self.verifies or self.start + self.planned == self.seq.num_tokens

    @property
    def num_tokens(self) -> int:
        return self.planned if self.draft is None else len(self.draft) + 1

    def token_ids(self) -> list[int]:
        if self.verifies:
            assert self.draft is not None
            return [*self.seq.token_slice(self.start, self.start + 1), *self.draft]
        return self.seq.token_slice(self.start, self.start + self.planned)
