"""The DFlash drafter beside the target: the context K/V it keeps in the paged pool and its
block forward.

Every target forward captures the hidden states of the drafter's target layers and writes the
drafter's context K/V of the fed positions into the drafter's layers of the same pool (same
page ids and slots as the target's K/V), so a prefix-cache hit restores the drafter's warm
state with the target's. `draft` runs the block `[anchor, MASK x (B-1)]` of each verify item
over its cached context. `NoDrafter` stands in for an engine without one: it captures and
stores nothing.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Protocol

import torch

from .attention import PagedDraftAttention, index_tensor
from .batch import BatchItem
from .cpu.forward import DraftForward
from .kv.manager import KVManager
from .kv.pool import KVPool
from .models.dflash import DFlashDraftModel
from .models.qwen3 import CausalLM
from .sampler import top1


class Proposal(NamedTuple):
    """A drafter forward's drafts for N verify items, D positions each."""

    logits: torch.Tensor                # [N, D, V] float32
    hidden: torch.Tensor | None         # [N, D, H] after the final norm (a DFlash2 selector's)
    drafts: list[list[int]]             # [N][D]
    confidence: list[list[float]] | None  # [N][D] the drafter's probability of each, if asked
    q: list[tuple[torch.Tensor, torch.Tensor] | None]  # per item: sampled drafts' distribution
                                        # (BatchItem.q), None where chosen for certain


class DraftContext(Protocol):
    capture: tuple[int, ...]   # target layers whose hidden states the drafter reads

    def caches(self, caches: list[torch.Tensor]) -> list[torch.Tensor]:
        """The drafter's layers of one of the pool's cache lists (K or V)."""

    def store(self, captured: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
              ) -> None:
        """Write the drafter's context K/V of the fed positions from the captured states."""


class NoDrafter:
    capture: tuple[int, ...] = ()

    def caches(self, caches: list[torch.Tensor]) -> list[torch.Tensor]:
        return []

    def store(self, captured: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
              ) -> None:
        pass


class DrafterRunner:
    def __init__(self, drafter: DFlashDraftModel, model: CausalLM, pool: KVPool, kv: KVManager,
                 forward: DraftForward | None = None) -> None:
        cfg = drafter.config
        self.drafter = drafter
        self.model = model  # the target: embeddings and head
        self.pool = pool
        self.kv = kv
        self.forward = forward  # the fast path's block forward (engine.cpu), if any
        self.layers = pool.add_layers([(cfg.num_key_value_heads, cfg.head_dim)]
                                      * cfg.num_hidden_layers)
        self.capture = tuple(cfg.target_layer_ids)
        self.device = model.device

    def caches(self, caches: list[torch.Tensor]) -> list[torch.Tensor]:
        return [caches[i] for i in self.layers]

    def store(self, captured: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
              ) -> None:
        ctx = self.drafter.context_features(captured)
        for i, layer in enumerate(self.layers):
            self.drafter.store_context_kv(i, ctx, positions, slots, self.pool.k[layer],
                                          self.pool.v[layer])

    @torch.inference_mode()
    def propose(self, items: list[BatchItem], block_size: int, drafts: int,
                confidence: bool = False) -> Proposal:
        """`draft`, then each item's drafts: the argmax of each position (DFlash), or the
        candidate selector's walk (DFlash2: greedy where the request is greedy or constrained,
        else drawn with the request's generator, with q). confidence: also the drafter's
        probability of each draft (its softmax there; DFlash2: over the walk's candidates)."""
        logits, hidden = self.draft(items, block_size, drafts)
        selector = self.drafter.candidate_selector
        if selector is None:
            tokens, probs = top1(logits, with_prob=confidence)
            return Proposal(logits, hidden, tokens, probs, [None] * len(items))
        assert hidden is not None
        sampled = [not item.seq.params.greedy and item.seq.constraint is None for item in items]
        uniforms = torch.zeros(len(items), drafts, device=logits.device)
        for i, item in enumerate(items):
            if sampled[i]:
                uniforms[i] = torch.rand(drafts, generator=item.seq.generator,
                                         device=logits.device)
        temperature = torch.tensor([item.seq.params.temperature if s else 0.0
                                    for item, s in zip(items, sampled)], device=logits.device)
        walk = selector.walk(hidden, logits, self.anchors(items), temperature, uniforms)
        q = [(walk.q[i], walk.candidates[i]) if s else None for i, s in enumerate(sampled)]
        return Proposal(logits, hidden, walk.tokens.tolist(),
                        walk.confidence.tolist() if confidence else None, q)

    def chooser(self, proposal: Proposal, i: int, anchor: int
                ) -> Callable[[int, torch.Tensor], int] | None:
        """How item i's drafts are chosen under a grammar (engine.constraint.propose): None for
        the masked argmax, a DFlash2 drafter's greedy walk over the allowed candidates."""
        selector = self.drafter.candidate_selector
        if selector is None:
            return None
        assert proposal.hidden is not None
        return selector.chooser(proposal.hidden[i], proposal.logits[i], anchor)

    def anchors(self, items: list[BatchItem]) -> torch.Tensor:
        """[N] each item's last committed token (its block's first)."""
        return torch.tensor([item.seq.token_slice(item.seq.computed, item.seq.computed + 1)[0]
                             for item in items], device=self.device)

    @torch.inference_mode()
    def draft(self, items: list[BatchItem], block_size: int, drafts: int
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One drafter forward for the verify items: block [anchor, MASK x (B-1)] at positions
        start .. start+B-1 over each sequence's cached drafter context. Returns the drafter's logits
        [N, drafts, V] for the first `drafts` (<= B-1) draft positions: the head, and with the
        CPU kernels the drafter's last layer, run only on the positions some item verifies
        (with the CPU kernels the head is part of the drafter's forward); and their hidden
        states [N, drafts, H] after the final norm (None where the fast path's forward gives
        logits only)."""
        cfg = self.drafter.config
        ids, positions, page_tables, ctx_lens = [], [], [], []
        for item in items:
            seq = item.seq
            start = seq.computed
            ids.extend(seq.token_slice(start, start + 1) + [cfg.mask_token_id] * (block_size - 1))
            positions.extend(range(start, start + block_size))
            page_tables.append(seq.kv.pages)
            ctx_lens.append(start)
        meta = (self.caches(self.pool.k), self.caches(self.pool.v), page_tables,
                ctx_lens, block_size, self.kv.page_size, self.drafter)
        # the rows whose drafts are verified: 1 .. drafts of each block
        rows = [b * block_size + 1 + i for b in range(len(items)) for i in range(drafts)]
        flat = index_tensor([*ids, *positions, *rows], self.device)
        n = len(ids)
        block_ids, pos, wanted = flat[:n], flat[n:2 * n], flat[2 * n:]
        if self.forward is not None:
            out = self.forward(block_ids, pos, self.forward.attention(*meta), wanted)
            if self.forward.returns_logits:
                return out.view(len(items), drafts, -1), None
            hidden = out
        else:
            attn = PagedDraftAttention.build(*meta)
            hidden = self.drafter(self.drafter.embed_block(self.model, block_ids), pos, attn,
                                  block_size=block_size)
            hidden = hidden.index_select(0, wanted)
        hidden = hidden.view(len(items), drafts, -1)
        return self.drafter.logits(self.model, hidden), hidden
