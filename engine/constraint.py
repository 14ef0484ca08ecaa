"""Token constraints inside the (speculative) decode loop: the protocol and the two walks.

A `TokenConstraint` is a per-sequence state machine over token ids (a grammar matcher: JSON
schema, tool-call format). The engine never imports a grammar library; the agent layer adapts
one (agentflash/structured.py adapts xgrammar) to this protocol. Allowed sets travel packed (32
tokens a word, as the matcher fills them) and become -inf penalties once a step, for all its rows.

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
        """The tokens allowed next, packed: int32 [ceil(vocab / 32)], token i at bit i % 32 of
        word i // 32 (xgrammar's token bitmask, as vLLM and SGLang take it; `pack` makes one
        from a bool mask). Tokens past the mask are disallowed."""
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


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """A bool mask [V] as `TokenConstraint.allowed` returns it: int32 [ceil(V / 32)]."""
    bits = torch.zeros(-(-allowed.shape[-1] // 32) * 32, dtype=torch.int64)
    bits[: allowed.shape[-1]] = allowed.to(torch.int64)
    words = (bits.view(-1, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


ALL = -1
"""A packed word that allows all of its 32 tokens."""

# each byte's eight tokens (least significant bit first) as what a mask adds to their logits
_PENALTY = torch.where(((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool(),
                       0.0, float("-inf"))


def penalty(packed: torch.Tensor, vocab: int) -> torch.Tensor:
    """Packed masks [N, W] as float [N, vocab]: 0 where allowed, -inf elsewhere (past the
    masks too), by a byte-table lookup: adding it masks logits."""
    out = _PENALTY.index_select(0, packed.contiguous().view(torch.uint8).flatten().int())
    out = out.view(packed.shape[0], -1)[:, :vocab]
    if out.shape[1] < vocab:
        out = torch.cat([out, out.new_full((out.shape[0], vocab - out.shape[1]),
                                           float("-inf"))], dim=1)
    return out


def nothing_allowed() -> RequestError:
    """The error of a request whose grammar allows no next token."""
    return RequestError("the output constraint allows no next token")


def masked(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Logits [V] with the tokens the packed mask disallows at -inf (tokens past it, e.g. a
    model's padded vocabulary, are disallowed)."""
    if not bool(allowed.any()):
        raise nothing_allowed()
    return logits + penalty(allowed.unsqueeze(0), logits.shape[-1])[0].to(logits)


def mask_rows_(logits: torch.Tensor, blocks: Sequence[tuple[int, Sequence[torch.Tensor]]]
               ) -> list[int]:
    """In place, for each (first, masks) of `blocks`: row first + k of logits [R, V] as
    `masked` makes it with masks[k], every block's rows in one call (a step's verify blocks
    and decode rows are judged together). Returns the blocks with a row whose mask allows
    nothing (a grammar failed: the request's error)."""
    index: list[int] = []
    packed: list[torch.Tensor] = []
    owner: list[int] = []
    for b, (first, masks) in enumerate(blocks):
        index.extend(range(first, first + len(masks)))
        packed.extend(masks)
        owner.extend([b] * len(masks))
    if not index:
        return []
    stacked = torch.stack(packed)
    add = penalty(stacked, logits.shape[-1]).to(logits)
    logits.index_add_(0, torch.tensor(index, device=logits.device), add)
    some = stacked.any(dim=1)
    if bool(some.all()):
        return []
    return sorted({owner[k] for k in (~some).nonzero().flatten().tolist()})


def propose(
    constraint: TokenConstraint, draft_logits: torch.Tensor,
    choose: Callable[[int, torch.Tensor], int] | None = None,
) -> tuple[list[int], list[torch.Tensor]]:
    """Grammatical drafts from drafter logits [n, V], advancing the matcher through them: at
    each row the argmax of the allowed tokens (the row's own argmax where the matcher accepts
    it: the same token, without masking the row), or `choose(row index, masked logits)` (a
    DFlash2 selector's walk; it must return an allowed token).

    Returns (drafts, masks): masks[k] is the packed allowed set after drafts[:k] (len(drafts) +
    1 masks; the last judges the bonus row). Drafting stops early when the grammar
    terminates."""
    drafts: list[int] = []
    masks = [constraint.allowed()]
    for j, row in enumerate(draft_logits):
        if constraint.is_terminated():
            break
        if choose is None:
            token = int(row.argmax())
            accepted = constraint.accept(token)
            if not accepted:
                token = int(masked(row, masks[-1]).argmax())
        else:
            token, accepted = choose(j, masked(row, masks[-1])), False
        if not accepted and not constraint.accept(token):
            raise RequestError(f"the output constraint rejected token {token} it allowed")
        drafts.append(token)
        # after termination nothing more is committed: the last row's mask is never consulted
        done = constraint.is_terminated()
        masks.append(torch.full_like(masks[0], ALL) if done else constraint.allowed())
    return drafts, masks


def follow(
    constraint: TokenConstraint, tokens: list[int]
) -> tuple[list[int], list[torch.Tensor]]:
    """Given drafts (a caller's prediction): the longest grammatical prefix of `tokens`, the
    matcher advanced through it, and the masks as `propose` gives them."""
    drafts: list[int] = []
    masks = [constraint.allowed()]
    for token in tokens:
        if constraint.is_terminated() or not constraint.accept(token):
            break
        drafts.append(token)
        done = constraint.is_terminated()
        masks.append(torch.full_like(masks[0], ALL) if done else constraint.allowed())
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
