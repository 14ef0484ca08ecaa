"""Verification of drafted blocks: which drafts the target accepts, and the bonus token.

Pure functions over tensors. A block is `[anchor, d_1 .. d_{n}]`; the target's row k (the output
at block position k) is its distribution for the token at position k+1, so draft d_{k+1} is judged
by row k and the bonus comes from the row after the last accepted draft.

- Greedy: accept the longest prefix with d_{k+1} == argmax(row k); bonus = argmax of the next row.
  The committed tokens are exactly what greedy autoregressive decoding would produce.
- Sampling: drafts are one-hot proposals, so the exact rule accepts d with probability p(d) and,
  on rejection, samples from p with d's mass removed (renormalised); after a fully accepted block
  the bonus is sampled from the last row. p is the target distribution after temperature, top-k
  and top-p. The committed tokens have exactly the target's sampling distribution.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Verdict(NamedTuple):
    accepted: int          # drafts accepted (0 .. len(drafts))
    bonus: int             # the target's own token after them

    @property
    def tokens(self) -> int:
        """Tokens committed by this verify step (tau)."""
        return self.accepted + 1


def greedy_accept(drafts: list[int], target_argmax: list[int]) -> Verdict:
    """target_argmax[k] is the target's choice after block position k (len(drafts) + 1 rows)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target_argmax[accepted]:
        accepted += 1
    return Verdict(accepted, target_argmax[accepted])


def sample_accept(
    drafts: list[int], probs: torch.Tensor, generator: torch.Generator | None
) -> Verdict:
    """Exact speculative sampling for one-hot drafts. probs [len(drafts)+1, V] (rows sum to 1)."""
    for k, d in enumerate(drafts):
        p = probs[k]
        u = torch.rand((), generator=generator, device=p.device)
        if bool(u < p[d]):
            continue
        residual = p.clone()
        residual[d] = 0.0
        # p[d] < 1 here (u < 1 always accepts a draft with p = 1), so residual has mass
        bonus = torch.multinomial(residual / residual.sum(), 1, generator=generator)
        return Verdict(k, int(bonus))
    bonus = torch.multinomial(probs[len(drafts)], 1, generator=generator)
    return Verdict(len(drafts), int(bonus))
