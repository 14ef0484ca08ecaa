"""Training a DFlash drafter against a frozen target (recipe: shared/specs/dflash.md, "Training").

Data are `Example(input_ids, loss_mask)` with loss_mask 1 on response tokens (agentflash.training
.data reads and writes them; agentflash.training.regenerate makes them from prompts with the
target's own responses).

One step over a batch of sequences:
1. `sample_anchors` picks anchors a among response tokens whose next token is one too, and
   `build_batch` makes one block `[token at a, MASK x (B-1)]` at positions a .. a+B-1 per anchor.
2. The target runs ONCE over the sequences laid end to end (no grad, `DenseCausal`, capturing
   the drafter's target layers); the context features and each drafter layer's context K/V of
   every position are computed with grad (fc, hidden_norm and the k/v projections train).
3. The drafter runs every block in one forward through `AnchorBlockAttention`, whose mask
   (`anchor_block_mask`) lets block j see the context keys < a_j and its own block, never another
   block: what serving computes (`kernels.torch_ops.draft_attention` over the cached context).
4. `block_loss`: cross-entropy of block position k = 1..B-1 against the token at a+k, where that is
   in range and a response token, weighted exp(-(k-1)/gamma); the weighted mean is the loss.
   A DFlash2 drafter adds its selector's: at each position, the cross-entropy over the top-K
   candidates' scores given the true token before it (where the label is among them), which
   is what the greedy walk meets while its drafts are right; its hits are the walk's.

A fresh drafter and its published checkpoint format: agentflash.training.drafter_checkpoint.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F

from ..engine.attention import DenseCausal
from ..engine.models.dflash import DFlashDraftModel, LayerKind
from ..engine.models.qwen3 import CausalLM
from .data import Example

GAMMAS = {8: 4.0, 10: 5.0, 16: 7.0}  # the reference's loss decay per block size


def anchor_candidates(loss_mask: Sequence[int]) -> list[int]:
    """Positions that may anchor a block: response tokens whose next token is one too."""
    return [a for a in range(len(loss_mask) - 1) if loss_mask[a] and loss_mask[a + 1]]


def sample_anchors(
    loss_mask: Sequence[int], max_anchors: int, generator: torch.Generator
) -> list[int]:
    """Up to `max_anchors` distinct candidates, sorted (all of them when there are fewer)."""
    candidates = anchor_candidates(loss_mask)
    if len(candidates) <= max_anchors:
        return candidates
    picked = torch.randperm(len(candidates), generator=generator)[:max_anchors]
    return sorted(candidates[i] for i in picked.tolist())


class AnchorBatch(NamedTuple):
    """Sequences laid end to end for the target, and their anchor blocks for the drafter."""

    input_ids: torch.Tensor        # [T] every sequence's tokens, one after another
    positions: torch.Tensor        # [T] each token's position in its sequence
    seq_lens: list[int]
    anchors: list[list[int]]       # per sequence, sorted; blocks follow this order
    block_ids: torch.Tensor        # [M, B] [token at a, MASK x (B-1)]
    block_positions: torch.Tensor  # [M, B] a .. a + B - 1
    labels: torch.Tensor           # [M, B-1] token at a + k for k = 1..B-1 (0 where not counted)
    label_mask: torch.Tensor       # [M, B-1] a + k is in range and a response token


def build_batch(
    examples: Sequence[Example], anchors: Sequence[Sequence[int]], block_size: int,
    mask_token_id: int, device: torch.device | str = "cpu",
) -> AnchorBatch:
    offsets = torch.arange(block_size)
    blocks, positions, labels, counted = [], [], [], []
    for example, seq_anchors in zip(examples, anchors):
        tokens = torch.tensor(example.input_ids)
        response = torch.tensor(example.loss_mask, dtype=torch.bool)
        a = torch.tensor(seq_anchors, dtype=torch.long)
        pos = a[:, None] + offsets                         # [m, B]
        inside = pos < len(tokens)
        at = pos.clamp(max=len(tokens) - 1)
        block = torch.full_like(pos, mask_token_id)
        block[:, 0] = tokens[a]
        blocks.append(block)
        positions.append(pos)
        labels.append(torch.where(inside, tokens[at], 0)[:, 1:])
        counted.append((inside & response[at])[:, 1:])
    lens = [len(e.input_ids) for e in examples]
    return AnchorBatch(
        input_ids=torch.tensor([t for e in examples for t in e.input_ids], device=device),
        positions=torch.cat([torch.arange(n) for n in lens]).to(device),
        seq_lens=lens,
        anchors=[list(a) for a in anchors],
        block_ids=torch.cat(blocks).to(device),
        block_positions=torch.cat(positions).to(device),
        labels=torch.cat(labels).to(device),
        label_mask=torch.cat(counted).to(device),
    )


def anchor_block_mask(
    seq_lens: Sequence[int], anchors: Sequence[Sequence[int]], block_size: int, kind: LayerKind
) -> torch.Tensor:
    """[S, Q, L + Q] bool: which keys each block query of each sequence sees.

    Layout per sequence s, Q = most blocks * B, L = longest sequence (padding at the ends):
        queries  [ blocks of s in anchor order, B rows each | padding ]
        keys     [ context 0 .. L-1 | the same block rows as the queries ]
    Query i of block j (position a_j + i) sees context keys p < a_j and the keys of block j only;
    a causal kind adds key position <= query position, a window |query - key| < window.
    Padding queries see their own (padding) key only, so no row is empty.
    """
    b, n_seq, length = block_size, len(seq_lens), max(seq_lens)
    n_blocks = torch.tensor([len(a) for a in anchors])
    q_len = int(n_blocks.max()) * b
    anchor = torch.zeros(n_seq, q_len // b, dtype=torch.long)
    for s, seq_anchors in enumerate(anchors):
        anchor[s, : len(seq_anchors)] = torch.tensor(seq_anchors, dtype=torch.long)
    row = torch.arange(q_len)
    block, offset = row // b, row % b
    q_valid = row < n_blocks[:, None] * b                                   # [S, Q]
    q_anchor = anchor[:, block]                                             # [S, Q]
    ctx_pos = torch.arange(length)
    ctx = ctx_pos < q_anchor[:, :, None]                                    # [S, Q, L]
    own = (block[:, None] == block[None, :]).expand(n_seq, q_len, q_len)    # [S, Q, Q]
    gap = offset[:, None] - offset[None, :]                  # query - key position, same block
    if kind.causal:
        own = own & (gap >= 0)                               # context keys are all earlier
    if kind.window is not None:
        ctx = ctx & (q_anchor[:, :, None] + offset[:, None] - ctx_pos < kind.window)
        own = own & (gap.abs() < kind.window)
    mask = torch.cat([ctx, own], dim=2) & q_valid[:, :, None]
    mask[:, row, length + row] |= ~q_valid
    return mask


def _pad_index(lens: Sequence[int], width: int) -> torch.Tensor:
    """[len(lens), width] row of item n's i-th element in their concatenation; padding points
    at sum(lens), one past the end (callers append a zero row there)."""
    n = torch.tensor(list(lens))
    i = torch.arange(width)
    return torch.where(i < n[:, None], (torch.cumsum(n, 0) - n)[:, None] + i, int(n.sum()))


class AnchorBlockAttention:
    """The drafter's attention in training: every block of every sequence at once (one SDPA
    call per layer, sequences as the batch dimension, `anchor_block_mask` per layer kind).
    `context_kv[layer]` is that layer's (k, v) [T, Hkv, D] of all positions of `batch`."""

    def __init__(
        self, context_kv: Sequence[tuple[torch.Tensor, torch.Tensor]], batch: AnchorBatch,
        kinds: Sequence[LayerKind], scale: float,
    ) -> None:
        device = batch.input_ids.device
        b = batch.block_ids.shape[1]
        n_tokens = [len(a) * b for a in batch.anchors]
        self.context_kv, self.kinds, self.scale = context_kv, kinds, scale
        self.ctx_index = _pad_index(batch.seq_lens, max(batch.seq_lens)).to(device)
        self.q_index = _pad_index(n_tokens, max(n_tokens)).to(device)
        self.q_rows = (self.q_index < sum(n_tokens)).flatten()
        self.masks = {
            kind: anchor_block_mask(batch.seq_lens, batch.anchors, b, kind)[:, None].to(device)
            for kind in set(kinds)
        }

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_ctx, v_ctx = self.context_kv[layer]
        keys = torch.cat([_gather(k_ctx, self.ctx_index), _gather(k, self.q_index)], dim=1)
        values = torch.cat([_gather(v_ctx, self.ctx_index), _gather(v, self.q_index)], dim=1)
        out = F.scaled_dot_product_attention(
            _gather(q, self.q_index).transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=self.masks[self.kinds[layer]], scale=self.scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )  # [S, Hq, Q, D]
        return out.transpose(1, 2).flatten(0, 1)[self.q_rows]


def _gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])[index]


def draft_hidden(target: CausalLM, drafter: DFlashDraftModel, batch: AnchorBatch) -> torch.Tensor:
    """The drafter's final hidden states [M, B, H] for every block of `batch` (target frozen)."""
    with torch.no_grad():
        attn = DenseCausal(batch.seq_lens, target.attention_scale)
        captured = target(
            batch.input_ids, batch.positions, attn, drafter.config.target_layer_ids
        ).captured
    ctx = drafter.context_features(captured)
    layers = range(len(drafter.layers))
    kv = [drafter.context_kv(i, ctx, batch.positions) for i in layers]
    attn = AnchorBlockAttention(
        kv, batch, [drafter.layer_kind(i) for i in layers], drafter.attention_scale
    )
    ids = batch.block_ids
    block = None if drafter.config.v2 is None else ids.shape[1]  # DFlash2: convolved per block
    h = drafter(drafter.embed_block(target, ids.flatten()), batch.block_positions.flatten(), attn,
                block_size=block)
    return h.view(*ids.shape, -1)


def default_gamma(block_size: int) -> float:
    """The reference's decay for B = 8, 10, 16; piecewise linear between and beyond (>= 1)."""
    (b0, g0), (b1, g1), (b2, g2) = sorted(GAMMAS.items())
    if block_size > b1:
        b0, g0, b1, g1 = b1, g1, b2, g2
    return max(1.0, g0 + (block_size - b0) * (g1 - g0) / (b1 - b0))


def position_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """Loss weights [B-1] of block positions k = 1..B-1: exp(-(k-1) / gamma)."""
    gamma = default_gamma(block_size) if gamma is None else gamma
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / gamma)


class LossOutput(NamedTuple):
    loss: torch.Tensor        # weighted mean cross-entropy (scalar, with grad)
    correct: torch.Tensor     # [B-1] argmax hits per block position k = 1..B-1
    counted: torch.Tensor     # [B-1] labels counted per position
    accepted: torch.Tensor    # [F] leading hits of each block whose B-1 labels all count
    leading: torch.Tensor     # [M] leading hits of every block, up to its first uncounted label


def block_loss(
    target: CausalLM, drafter: DFlashDraftModel, hidden: torch.Tensor, batch: AnchorBatch,
    weights: torch.Tensor,
) -> LossOutput:
    """Position-weighted cross-entropy of the blocks' drafts (logits only where labels count)."""
    counted = batch.label_mask
    rows = hidden[:, 1:][counted]
    logits = drafter.logits(target, rows)                          # [n, V] float32
    labels = batch.labels[counted]
    w = weights.to(logits.device).expand_as(counted)[counted]
    loss = (F.cross_entropy(logits, labels, reduction="none") * w).sum() / w.sum()
    chosen = logits.argmax(-1)
    selector = drafter.candidate_selector
    if selector is not None:
        previous = torch.cat([batch.block_ids[:, :1], batch.labels[:, :-1]], 1)[counted]
        unary, candidates, projected = selector.candidates(rows, logits)
        scores = unary + torch.einsum("nr,nkr->nk", selector.predecessor_codebook[previous]
                                      * projected, selector.successor_codebook[candidates])
        found = candidates == labels[:, None]
        inside = found.any(1)
        if bool(inside.any()):
            picked = F.cross_entropy(scores[inside], found[inside].float().argmax(1),
                                     reduction="none")
            loss = loss + (picked * w[inside]).sum() / w.sum()
        chosen = candidates.gather(1, scores.argmax(1, keepdim=True))[:, 0]
    with torch.no_grad():
        hits = torch.zeros_like(counted)
        hits[counted] = chosen == labels
        leading = hits.long().cumprod(1).sum(1)
        accepted = leading[counted.all(1)]
    return LossOutput(loss, hits.sum(0), counted.sum(0), accepted, leading)


class Scores(NamedTuple):
    loss: float                   # weighted cross-entropy, mean over batches
    accuracy: tuple[float, ...]   # argmax accuracy at block positions k = 1..B-1
    tau: float                    # 1 + mean leading hits of full blocks, over all anchors
    decode_tau: float | None = None  # tokens per verify step of a greedy decode (`decode_walk`)


class Tally:
    """Accumulates LossOutputs into Scores."""

    def __init__(self) -> None:
        self.loss, self.batches, self.blocks, self.accepted = 0.0, 0, 0, 0
        self.correct: torch.Tensor | None = None
        self.counted: torch.Tensor | None = None

    def add(self, out: LossOutput) -> None:
        self.loss += float(out.loss.detach())
        self.batches += 1
        correct, counted = out.correct.cpu(), out.counted.cpu()
        self.correct = correct if self.correct is None else self.correct + correct
        self.counted = counted if self.counted is None else self.counted + counted
        self.blocks += len(out.accepted)
        self.accepted += int(out.accepted.sum())

    def scores(self) -> Scores:
        assert self.correct is not None and self.counted is not None, "nothing tallied"
        accuracy = self.correct / self.counted.clamp(min=1)
        return Scores(self.loss / self.batches, tuple(round(float(a), 4) for a in accuracy),
                      1.0 + self.accepted / max(1, self.blocks))


@torch.no_grad()
def evaluate(
    target: CausalLM, drafter: DFlashDraftModel, examples: Sequence[Example],
    batch_size: int = 8, gamma: float | None = None,
) -> Scores:
    """Scores of the drafter on every anchor of `examples` (deterministic)."""
    cfg = drafter.config
    weights = position_weights(cfg.block_size, gamma)
    usable = [e for e in examples if anchor_candidates(e.loss_mask)]
    tally = Tally()
    tokens = steps = 0
    for i in range(0, len(usable), batch_size):
        chunk = usable[i : i + batch_size]
        anchors = [anchor_candidates(e.loss_mask) for e in chunk]
        batch = build_batch(chunk, anchors, cfg.block_size, cfg.mask_token_id, target.device)
        with _autocast(target, drafter):
            out = block_loss(target, drafter, draft_hidden(target, drafter, batch), batch,
                             weights)
        tally.add(out)
        leading, first = out.leading.tolist(), 0  # blocks: per example, in anchor order
        for example, seq_anchors in zip(chunk, anchors):
            last = first + len(seq_anchors)
            walked = decode_walk(example.loss_mask, dict(zip(seq_anchors, leading[first:last])))
            tokens, steps, first = tokens + walked[0], steps + walked[1], last
    return tally.scores()._replace(decode_tau=tokens / max(1, steps))


def decode_walk(loss_mask: Sequence[int], leading: dict[int, int]) -> tuple[int, int]:
    """(tokens, verify steps) of greedy speculative decoding replayed over a response the target
    generated itself, from the leading hits of the block at each anchor: the first response
    token comes from prefill; each step anchors at the last committed token and commits its
    leading hits plus the target's token after them; the next step anchors on that token.

    This is the acceptance length the engine measures. The mean over all anchors (`Scores.tau`)
    is higher: a decode spends few steps on easy stretches and many on hard ones, while every
    anchor counts once in the mean."""
    last = len(loss_mask) - 1
    a = list(loss_mask).index(1)
    tokens = steps = 0
    while a in leading:
        n = min(leading[a] + 1, last - a)
        tokens, steps, a = tokens + n, steps + 1, a + n
    return tokens, steps


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings; the defaults are the reference recipe's."""

    steps: int = 1000
    batch_size: int = 8             # sequences per step (one target forward)
    max_anchors: int = 512          # blocks per sequence at most
    lr: float = 6e-4
    warmup: float = 0.04            # fraction of the steps warming up linearly; then cosine to 0
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float | None = None      # loss decay; None: default_gamma(block_size)
    seed: int = 0
    log_every: int = 10
    max_seconds: float | None = None  # stop early after this much wall time

    def __post_init__(self) -> None:
        if min(self.steps, self.batch_size, self.max_anchors, self.log_every) < 1:
            raise ValueError("steps, batch_size, max_anchors and log_every must be >= 1")
        if self.lr <= 0 or self.grad_clip <= 0 or not 0 <= self.warmup < 1:
            raise ValueError("lr and grad_clip must be positive and warmup in [0, 1)")


class TrainLog(NamedTuple):
    step: int
    lr: float
    seconds: float
    scores: Scores     # over the steps since the previous log


def lr_factor(step: int, config: TrainConfig) -> float:
    """Multiplier of the peak lr at `step`: linear warmup, then cosine decay to 0."""
    warm = max(1, round(config.warmup * config.steps))
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, config.steps - warm)))


def train(
    target: CausalLM, drafter: DFlashDraftModel, examples: Sequence[Example],
    config: TrainConfig, log: Callable[[TrainLog], None] = lambda record: None,
) -> TrainLog:
    """Train all of `drafter`'s weights in place on `examples` against the frozen `target`;
    calls `log` every `log_every` steps and at the end, and returns the last record."""
    cfg = drafter.config
    usable = [e for e in examples if anchor_candidates(e.loss_mask)]
    if not usable:
        raise ValueError("no example has two consecutive response tokens to anchor a block on")
    longest = max(len(e.input_ids) for e in usable) + cfg.block_size - 1
    if longest > min(cfg.max_position_embeddings, target.config.max_position_embeddings):
        raise ValueError(f"sequences plus a block reach position {longest}, past the models'")
    if any(not 0 <= t < cfg.vocab_size for e in usable for t in e.input_ids):
        raise ValueError(f"token ids outside the vocabulary [0, {cfg.vocab_size})")
    generator = torch.Generator().manual_seed(config.seed)
    weights = position_weights(cfg.block_size, config.gamma)
    drafter.train().requires_grad_(True)
    optimizer = torch.optim.AdamW(drafter.parameters(), config.lr,
                                  weight_decay=config.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, config))
    order: list[int] = []
    tally, start, record = Tally(), time.perf_counter(), None
    for step in range(1, config.steps + 1):
        if len(order) < config.batch_size:
            order += torch.randperm(len(usable), generator=generator).tolist()
        chosen = [usable[i] for i in order[: config.batch_size]]
        del order[: config.batch_size]
        anchors = [sample_anchors(e.loss_mask, config.max_anchors, generator) for e in chosen]
        batch = build_batch(chosen, anchors, cfg.block_size, cfg.mask_token_id, target.device)
        with _autocast(target, drafter):
            out = block_loss(target, drafter, draft_hidden(target, drafter, batch), batch, weights)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), config.grad_clip)
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        schedule.step()
        tally.add(out)
        seconds = time.perf_counter() - start
        out_of_time = config.max_seconds is not None and seconds >= config.max_seconds
        if step % config.log_every == 0 or step == config.steps or out_of_time:
            record = TrainLog(step, lr, seconds, tally.scores())
            log(record)
            tally = Tally()
        if out_of_time:
            break
    drafter.eval().requires_grad_(False)
    assert record is not None
    return record


def _autocast(target: CausalLM, drafter: DFlashDraftModel) -> torch.autocast:
    """Mixed precision in the target's dtype when it is not the drafter's (float32) one."""
    return torch.autocast(target.device.type, dtype=target.dtype,
                          enabled=target.dtype != drafter.dtype)
