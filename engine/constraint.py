"""Token constraints inside the (speculative) decode loop: the protocol and the two walks.

A `TokenConstraint` is a per-sequence state machine over token ids (a grammar matcher: JSON
schema, tool-call format). The engine never imports a grammar library; the agent layer adapts
one (agentflash/grammar.py adapts xgrammar) to this protocol.

Speculation and constraints meet in two places:
- `propose`: before the verify forward, the drafter's logits are masked position by position
  while the matcher advances through its own proposals, so every draft is grammatical and each
  verify row gets the mask of the state it is judged in (row k: after anchor + d_1..d_k).
- `follow`: the same for drafts the caller supplied (a prediction), cut where the grammar
  would not allow them.
- `settle` (at commit): the matcher rolls back the rejected drafts and accepts the bonus token.

Every committed token is the masked target's choice at its state, exactly as in token-by-token
constrained decoding, so constrained greedy output is identical with and without speculation.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch

from .errors import RequestError


class TokenConstraint(Protocol):
    """What the engine needs from a grammar matcher. Called on the engine thread only."""

    def allowed(self) -> torch.Tensor:
        """Bool mask [vocab] of the tokens allowed next."""
        ...

    def accept(self, token: int) -> bool:
        """Advance by one token; False (state unchanged) if the token is not allowed."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        ...

    def is_terminated(self) -> bool:
        """True once the grammar is complete and its stop token was accepted."""
        ...


def masked(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Logits [..., V] with disallowed tokens at -inf (the mask may be shorter than V: tokens
    past it, e.g. a model's padded vocabulary, are disallowed)."""
    if not bool(allowed.any()):
        raise RequestError("the output constraint allows no next token")
    n = min(allowed.shape[-1], logits.shape[-1])
    keep = allowed[..., :n].to(logits.device)
    if n == logits.shape[-1]:  # the common case (each drafted token of a walk): one fill
        return logits.masked_fill(~keep, float("-inf"))
    out = torch.full_like(logits, float("-inf"))
    out[..., :n] = torch.where(keep, logits[..., :n], out[..., :n])
    return out


def mask_rows_(logits: torch.Tensor, masks: Sequence[torch.Tensor]) -> None:
    """In place, for each row k of logits [R, V] that has a mask: `masked(logits[k], masks[k])`,
    all rows in one call (a verify block's rows are judged together)."""
    rows = min(logits.shape[0], len(masks))
    allowed = torch.stack(list(masks[:rows])).to(logits.device)
    if not bool(allowed.any(dim=1).all()):
        raise RequestError("the output constraint allows no next token")
    n = min(allowed.shape[-1], logits.shape[-1])
    part = logits[:rows]
    part[:, n:] = float("-inf")
    part[:, :n].masked_fill_(~allowed[:, :n], float("-inf"))


def propose(
    constraint: TokenConstraint, draft_logits: torch.Tensor,
    choose: Callable[[int, torch.Tensor], int] | None = None,
) -> tuple[list[int], list[torch.Tensor]]:
    """Grammatical drafts from drafter logits [n, V], advancing the matcher through them: at
    each row the argmax of the allowed tokens, or `choose(row index, masked logits)` (a DFlash2
    selector's walk; it must return an allowed token).

    Returns (drafts, masks): masks[k] is the allowed set after drafts[:k] (len(drafts) + 1 masks;
    the last judges the bonus row). Drafting stops early when the grammar terminates."""
    drafts: list[int] = []
    masks = [constraint.allowed()]
    for j, row in enumerate(draft_logits):
        if constraint.is_terminated():
            break
        allowed_logits = masked(row, masks[-1])
        token = int(allowed_logits.argmax()) if choose is None else choose(j, allowed_logits)
        if not constraint.accept(token):
            raise RequestError(f"the output constraint rejected token {token} it allowed")
        drafts.append(token)
        # after termination nothing more is committed: the last row's mask is never consulted
        done = constraint.is_terminated()
        masks.append(torch.ones_like(masks[0]) if done else constraint.allowed())
    return drafts, masks


def follow(
    constraint: TokenConstraint, tokens: list[int]
) -> tuple[list[int], list[torch.Tensor]]:
    """Given drafts (a caller's prediction): the longest grammatical prefix of `tokens`, the
    matcher advanced through it, and the masks as `propose` gives them."""
    drafts: list[int] = []
    masks = [constraint.allowed()]
    for token in tokens:
        allowed = masks[-1]
        if constraint.is_terminated() or token >= allowed.shape[0] or not bool(allowed[token]) \
                or not constraint.accept(token):
            break
        drafts.append(token)
        done = constraint.is_terminated()
        masks.append(torch.ones_like(masks[0]) if done else constraint.allowed())
    return drafts, masks


def settle(constraint: TokenConstraint, drafted: int, tokens: list[int]) -> int:
    """After verification: roll back from `drafted` advanced drafts to the `len(tokens) - 1`
    accepted ones, then accept the bonus. Returns how many of `tokens` to keep (a token after
    the grammar's termination is dropped)."""
    accepted = len(tokens) - 1
    constraint.rollback(drafted - accepted)
    for kept, token in enumerate(tokens[accepted:], accepted):
        if constraint.is_terminated():
            return kept
        if not constraint.accept(token):
            raise RequestError(f"the output constraint rejected token {token} it allowed")
    return len(tokens)
