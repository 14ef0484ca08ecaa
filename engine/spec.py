"""Verification of a step's target rows: which drafts the target accepts, and the bonus token.

A block is `[anchor, d_1 .. d_n]`; the target's row k (the output at block position k) is its
distribution for the token at position k+1, so draft d_{k+1} is judged by row k and the bonus
comes from the row after the last accepted draft. A plain decode row is a block with no drafts.

- Greedy: accept the longest prefix with d_{k+1} == argmax(row k); bonus = argmax of the next row.
  The committed tokens are exactly what greedy autoregressive decoding would produce.
- Sampling: a draft chosen for certain (a one-hot proposal) is accepted with probability p(d)
  and, on rejection, the bonus is sampled from p with d's mass removed (renormalised); a draft
  drawn from a distribution q (a DFlash2 selector's, `Rows.q`) is accepted with probability
  min(1, p(d) / q(d)) and the bonus drawn from max(p - q, 0); after a fully accepted block
  the bonus is sampled from the last row. p is the target distribution after temperature, top-k
  and top-p. The committed tokens have exactly the target's sampling distribution.

`judge` verifies a whole batch with one kernel launch per rule (kernels.dispatch.accept_greedy /
accept_sample) and one host sync each (greedy rows on CPU: one argmax, then compared on the host,
which is cheaper there than the kernel's dozen small ops); each request's random numbers come from
its own generator.
`confident_length` chooses how many of a block's drafts to verify, from the drafter's own
confidence in them and the step costs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..kernels import dispatch
from .config import StepCost
from .sampler import SamplingParams, target_probs, top1


class Verdict(NamedTuple):
    accepted: int          # drafts accepted (0 .. len(drafts))
    bonus: int             # the target's own token after them


class Rows(NamedTuple):
    """One request's part of a step's logits: rows start .. start + len(drafts)."""

    start: int
    drafts: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    q: tuple[torch.Tensor, torch.Tensor] | None = None  # the drafts' distribution (BatchItem.q)


def judge(logits: torch.Tensor, batch: list[Rows]) -> list[Verdict]:
    """The verdict of every request in `batch`, in order, from the step's logits [R, V]."""
    verdicts: list[Verdict | None] = [None] * len(batch)
    greedy = [i for i, r in enumerate(batch) if r.params.greedy]
    sampled = [i for i, r in enumerate(batch) if not r.params.greedy]
    if greedy and logits.device.type == "cpu" and dispatch.uses_torch("accept_greedy", "cpu"):
        # no device to sync with: the torch ops' verdicts, judged on the host
        choice, _ = top1(logits)
        for i in greedy:
            r = batch[i]
            accepted = 0
            while accepted < len(r.drafts) and r.drafts[accepted] == choice[r.start + accepted]:
                accepted += 1
            verdicts[i] = Verdict(accepted, choice[r.start + accepted])
    elif greedy:
        chosen = [batch[i] for i in greedy]
        out = dispatch.accept_greedy(logits, *_layout(chosen, logits.device))
        for i, (accepted, bonus) in zip(greedy, out.tolist()):
            verdicts[i] = Verdict(accepted, bonus)
    if sampled:
        chosen = [batch[i] for i in sampled]
        probs = torch.cat([target_probs(logits[r.start:r.start + len(r.drafts) + 1], r.params)
                           for r in chosen])
        starts = [0]
        for r in chosen[:-1]:
            starts.append(starts[-1] + len(r.drafts) + 1)
        chosen = [r._replace(start=s) for r, s in zip(chosen, starts)]
        row_start, num_drafts, drafts = _layout(chosen, logits.device)
        uniforms = torch.zeros(len(chosen), drafts.shape[1] + 1, device=logits.device)
        for j, r in enumerate(chosen):
            n = len(r.drafts) + 1
            uniforms[j, :n] = torch.rand(n, generator=r.generator, device=logits.device)
        out = dispatch.accept_sample(probs, row_start, num_drafts, drafts, uniforms,
                                     *_draft_distributions(chosen, drafts))
        for i, (accepted, bonus) in zip(sampled, out.tolist()):
            verdicts[i] = Verdict(accepted, bonus)
    return verdicts  # type: ignore[return-value]


def _draft_distributions(batch: list[Rows], drafts: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor] | tuple[()]:
    """(q_probs, q_ids) [N, D, K] where some drafts were sampled (a one-hot q for the others),
    else nothing: kernels.dispatch.accept_sample's one-hot rule."""
    if all(r.q is None for r in batch):
        return ()
    n, width = drafts.shape
    top = max(r.q[0].shape[1] for r in batch if r.q is not None)
    q_probs = drafts.new_zeros((n, width, top), dtype=torch.float32)
    q_ids = drafts.new_zeros((n, width, top))
    q_probs[:, :, 0] = 1.0
    q_ids[:, :, 0] = drafts
    for i, r in enumerate(batch):
        if r.q is not None:
            probs, ids = r.q
            q_probs[i, :len(r.drafts)] = 0.0
            q_probs[i, :len(r.drafts), :probs.shape[1]] = probs[:len(r.drafts)]
            q_ids[i, :len(r.drafts), :ids.shape[1]] = ids[:len(r.drafts)]
    return q_probs, q_ids


def _layout(batch: list[Rows], device: torch.device) -> tuple[torch.Tensor, ...]:
    """row_start [N], num_drafts [N], drafts [N, D] (zero-padded) on `device`."""
    width = max(len(r.drafts) for r in batch)
    table = [[r.start, len(r.drafts), *r.drafts, *[0] * (width - len(r.drafts))] for r in batch]
    t = torch.tensor(table, dtype=torch.long, device=device)
    return t[:, 0], t[:, 1], t[:, 2:]


def confident_length(confidence: list[float], cost: StepCost) -> int:
    """Tokens to verify (1: none of the drafts) out of an anchor and `len(confidence)` drafts,
    given the drafter's probability of each draft (its softmax at the draft's row): the number
    that commits the most tokens per unit of time, the drafter's forward paid either way.

    The drafter's probabilities are its estimate that each draft is the target's token (on
    agentflash-11m's held-out agent prompts they are, if anything, low: drafts it gives 0.5
    are accepted 0.77 of the time), so verifying k tokens commits about 1 + sum over
    j < k - 1 of prod over i <= j of confidence[i], for cost.draft[n] + cost.verify[k - 1]
    plain steps (n = len(confidence))."""
    drafted = len(confidence)
    paid = cost.draft[drafted]
    best, best_rate = 1, 1.0 / (paid + 1.0)
    expected, chain = 1.0, 1.0
    for j, p in enumerate(confidence):
        chain *= p
        expected += chain
        rate = expected / (paid + cost.verify[j + 1])
        if rate > best_rate:
            best, best_rate = j + 2, rate
    return best
