"""Token constraints inside the (speculative) decode loop: the protocol and the two walks.

A `TokenConstraint` is a per-sequence state machine over token ids (a grammar matcher: JSON
schema, tool-call format). The engine never imports a grammar library; the agent layer adapts
one (agentflash/structured.py adapts xgrammar) to this protocol. Allowed sets travel packed (32
tokens a word, as the matcher fills them) and become -inf penalties once a step for the sampled
rows; a greedy row's masked argmax is read off the bits (`masked_choice`).

Speculation and constraints meet in these places:
- `propose`: before the verify forward, the matcher advances through the drafter's proposals
  (a row masked only where the grammar refuses its own argmax), so every draft is grammatical;
  for sampled rows each verify row gets the mask of the state it is judged in (row k: after
  anchor + d_1..d_k).
- `follow`: the same for drafts the caller supplied (a prediction, context drafts), cut where
  the grammar would not allow them.
- `settle` (at commit, sampled rows, judged masked): the matcher rolls back the rejected drafts
  and accepts the bonus token.
- `settle_greedy` (at commit, greedy rows, judged unmasked): the same, masking only the row
  whose own argmax the grammar refuses: one allowed set a step where the target keeps to the
  grammar, not one a row.

Every committed token is the masked target's choice at its state, exactly as in token-by-token
constrained decoding, so constrained greedy output is identical with and without speculation.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch

from agentflash.kernels import cpu_ops
from .errors import RequestError
from .sampler import top1


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


def masked_choice(row: torch.Tensor, allowed: torch.Tensor) -> int:
    """The greedy token of logits [V] among those the packed mask allows: `masked(row,
    allowed).argmax()`, on CPU by the kernels' `masked_top1` once they are loaded (no masked
    copy of the row)."""
    if row.device.type == "cpu" and cpu_ops.loaded():
        token = int(cpu_ops.masked_top1(row.float().unsqueeze(0), allowed.unsqueeze(0))[0])
        if token < 0:
            raise nothing_allowed()
        return token
    return int(masked(row, allowed).argmax())


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


Masks = list[torch.Tensor | None]
"""A verify block's allowed sets, one a state: masks[k] after the first k drafts (None where
it was not filled)."""


def propose(
    constraint: TokenConstraint, draft_logits: torch.Tensor, own: Sequence[int],
    choose: Callable[[int, torch.Tensor], int] | None = None, masks: bool = True,
) -> tuple[list[int], Masks]:
    """Grammatical drafts from drafter logits [n, V], advancing the matcher through them: at
    each row the argmax of the allowed tokens (`own[j]`, the row's own argmax, where the
    matcher accepts it: the same token, without masking the row), or `choose(row index, masked
    logits)` (a DFlash2 selector's walk; it must return an allowed token).

    Returns (drafts, masks): masks[k] is the packed allowed set after drafts[:k] (len(drafts) +
    1 masks; the last judges the bonus row). With masks=False (greedy rows, judged by
    `settle_greedy`) a state's mask is filled only where a row's own argmax is refused (and
    handed on: the target's row there may need it), else None. Drafting stops early when the
    grammar terminates."""
    drafts: list[int] = []
    out: Masks = []
    # every state's mask is filled where rows are masked or a selector chooses among them
    first = constraint.allowed() if masks or choose is not None else None
    allowed = first
    for j, row in enumerate(draft_logits):
        if constraint.is_terminated():
            break
        if choose is None:
            token = own[j]
            accepted = constraint.accept(token)
            if not accepted:
                allowed = constraint.allowed() if allowed is None else allowed
                token = masked_choice(row, allowed)
        else:
            assert allowed is not None
            token, accepted = choose(j, masked(row, allowed)), False
        if not accepted and not constraint.accept(token):
            raise RequestError(f"the output constraint rejected token {token} it allowed")
        drafts.append(token)
        out.append(allowed)
        allowed = _state_mask(constraint, first) if first is not None else None
    out.append(allowed)
    return drafts, out


def follow(constraint: TokenConstraint, tokens: list[int], masks: bool = True
           ) -> tuple[list[int], Masks]:
    """Given drafts (a caller's prediction): the longest grammatical prefix of `tokens`, the
    matcher advanced through it, and the masks as `propose` gives them (all None with
    masks=False)."""
    drafts: list[int] = []
    out: Masks = [constraint.allowed() if masks else None]
    for token in tokens:
        if constraint.is_terminated() or not constraint.accept(token):
            break
        drafts.append(token)
        out.append(_state_mask(constraint, out[0]) if masks else None)
    return drafts, out


def _state_mask(constraint: TokenConstraint, like: torch.Tensor) -> torch.Tensor:
    """The allowed set of the matcher's state; all tokens once it terminated (nothing more is
    committed there: that row's mask is never consulted)."""
    if constraint.is_terminated():
        return torch.full_like(like, ALL)
    return constraint.allowed()


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


def settle_greedy(constraint: TokenConstraint, drafts: list[int], accepted: int, bonus: int,
                  rows: torch.Tensor, masks: Masks | None = None) -> tuple[int, list[int]]:
    """Greedy verification under a grammar without a mask per row: `accepted` and `bonus` are
    the verdict of the unmasked rows [len(drafts) + 1, V] (the matcher advanced through all
    `drafts`). A row whose own argmax the grammar allows has it as its masked argmax too (the
    first of the maxima either way), and a draft is allowed in its state, so only the row after
    the accepted drafts may need its mask: where the grammar refuses its argmax, the row's
    masked argmax is the bonus, or, if that is the next draft, the draft is accepted and
    verification goes on (`masks`: the states' allowed sets the draft walk filled, used where
    known). Leaves the matcher after the committed tokens. Returns (drafts accepted, tokens to
    commit); a token after the grammar's termination is dropped."""
    constraint.rollback(len(drafts) - accepted)
    j, token = accepted, bonus
    while not constraint.is_terminated():
        if constraint.accept(token):
            return j, drafts[:j] + [token]
        known = masks[j] if masks is not None else None
        token = masked_choice(rows[j], constraint.allowed() if known is None else known)
        if j == len(drafts) or token != drafts[j]:
            if not constraint.accept(token):
                raise RequestError(f"the output constraint rejected token {token} it allowed")
            return j, drafts[:j] + [token]
        # the masked row agrees with the next draft: accept it and judge on
        constraint.accept(token)
        j += 1
        ahead, _ = top1(rows[j:])
        k = 0
        while j < len(drafts) and drafts[j] == ahead[k] and not constraint.is_terminated():
            constraint.accept(drafts[j])
            j, k = j + 1, k + 1
        token = ahead[k]
    return j, drafts[:j]
