"""What a DFlash2 drafter adds to a DFlash one: dynamic convolutions and a candidate selector.

(Format and forward: docs/engine.md, "DFlash2 drafters"; the drafter model composing these is
engine.models.dflash.DFlashDraftModel.)

- `GroupedDynamicConv`: a causal convolution over each block's tokens only (zero before the
  anchor), depthwise, whose kernel at token t is a learned `base_kernel` plus a projection of
  the sublayer's normalised input at t, one dynamic weight per group of `conv_group_size`
  channels. Each sublayer of a `DFlash2Layer` convolves its input (kernel 0) and its output
  (kernel 1), both kernels computed from the same normalised input.
- `CandidateSelector`: the drafts are not each position's argmax but a walk from the anchor
  over each position's top-K tokens, scoring a candidate by its logit plus a low-rank pair term
  between it and the token chosen before it, read through the hidden state:
  `<predecessor_codebook[prev] * hidden_projection(h_t), successor_codebook[cand]>`. Greedy
  walks take the best score; sampled ones draw from softmax(score / T) over the K, and that is
  the draft distribution q the target's rejection sampling uses.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
from torch import nn

from ..attention import AttentionBackend
from ..config import ModelConfig
from .dflash_config import DFlash2Extras
from .qwen3 import DecoderLayer


class GroupedDynamicConv(nn.Module):
    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups,
                                           bias=False)

    def dynamic(self, x: torch.Tensor) -> torch.Tensor:
        """Both convolutions' dynamic weights [T, 2, k, groups] from the normalised input x [T, H]."""
        return self.kernel_projection(x).view(x.shape[0], 2, self.kernel_size, self.groups)

    def convolve(self, x: torch.Tensor, dynamic: torch.Tensor, which: int, block_size: int
                 ) -> torch.Tensor:
        """Convolution `which` (0: the sublayer's input, 1: its output) of x [N*B, H], N blocks
        of B tokens, with the dynamic weights [N*B, k, groups]: out[t] = sum over o < k of
        (base[o] + dynamic[t, o]) * x[t - o] within t's block."""
        total, hidden = x.shape
        blocks = x.view(total // block_size, block_size, self.groups, hidden // self.groups)
        weights = dynamic.view(*blocks.shape[:2], self.kernel_size, self.groups, 1)
        base = self.base_kernel[which].to(x.dtype).view(self.kernel_size, self.groups, -1)
        out = torch.zeros_like(blocks)
        for o in range(min(self.kernel_size, block_size)):
            shifted = blocks[:, :block_size - o]
            out[:, o:] += (base[o] + weights[:, o:, o]) * shifted
        return out.view(total, hidden)


class DFlash2Layer(DecoderLayer):
    """A DFlash drafter layer (the target's Qwen3 decoder layer) with each sublayer's input and
    output convolved over the block."""

    def __init__(self, config: ModelConfig, layer_idx: int, extras: DFlash2Extras) -> None:
        super().__init__(config, layer_idx)
        size, group = extras.conv_kernel_size, extras.conv_group_size
        self.attention_conv = GroupedDynamicConv(config.hidden_size, size, group)
        self.mlp_conv = GroupedDynamicConv(config.hidden_size, size, group)

    def forward(  # type: ignore[override]
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend,
        block_size: int,
    ) -> torch.Tensor:
        """The layer's output for N blocks of `block_size` tokens h [N*B, H]."""
        h = h + self._sublayer(self.attention_conv, self.input_layernorm(h), block_size,
                               lambda x: self.self_attn(x, cos, sin, attn))
        return h + self._sublayer(self.mlp_conv, self.post_attention_layernorm(h), block_size,
                                  self.mlp)

    @staticmethod
    def _sublayer(conv: GroupedDynamicConv, x: torch.Tensor, block_size: int,
                  body: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        dynamic = conv.dynamic(x)
        x = conv.convolve(x, dynamic[:, 0], 0, block_size)
        return conv.convolve(body(x), dynamic[:, 1], 1, block_size)


class Walk(NamedTuple):
    """A batch of selector walks over D draft positions."""

    tokens: torch.Tensor       # [N, D] the drafts
    confidence: torch.Tensor   # [N, D] float32: softmax(score) of each draft over its K (T = 1)
    q: torch.Tensor            # [N, D, K] float32: the draft distribution over the candidates
    candidates: torch.Tensor   # [N, D, K] the candidates (q's token ids)


class CandidateSelector(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, extras: DFlash2Extras) -> None:
        super().__init__()
        rank = extras.selector_rank
        self.top_k = extras.selector_top_k
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))

    def candidates(self, hidden: torch.Tensor, logits: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(unary logits [..., K], candidates [..., K], projected hidden [..., r]), float32."""
        unary, candidates = torch.topk(logits.float(), self.top_k, dim=-1)
        return unary, candidates, self.hidden_projection(hidden).float()

    def pair_scores(self, previous: torch.Tensor, projected: torch.Tensor,
                    candidates: torch.Tensor) -> torch.Tensor:
        """The pair term [N, K] of candidates [N, K] after tokens `previous` [N], at one position
        whose projected hidden state is `projected` [N, r]."""
        context = self.predecessor_codebook[previous].float() * projected
        return torch.einsum("nr,nkr->nk", context, self.successor_codebook[candidates].float())

    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor,
             temperature: torch.Tensor, uniforms: torch.Tensor) -> Walk:
        """Walks from `anchors` [N] over positions' hidden states [N, D, H] and logits [N, D, V].
        Row n takes the best score where temperature[n] == 0, else draws from softmax(score / T)
        by inversion with uniforms [N, D]. Every score a walk may need (each candidate after
        each candidate before it) comes from one batched product; the walk itself reads them
        on the host, D steps of K numbers."""
        unary, candidates, projected = self.candidates(hidden, logits)
        n, d, k = unary.shape
        before = torch.cat([anchors[:, None, None].expand(n, 1, k), candidates[:, :-1]], 1)
        context = self.predecessor_codebook[before].float() * projected[:, :, None]
        scores = unary[:, :, None] + torch.einsum(
            "ndar,ndbr->ndab", context, self.successor_codebook[candidates].float())
        table, heat, draws = scores.tolist(), temperature.tolist(), uniforms.tolist()
        picks, confidence, qs = [], [], []
        for row, t, us in zip(table, heat, draws):
            at, rows = 0, ([], [], [])
            for j in range(d):
                score = row[j][at]
                top = max(score)
                weights = [math.exp(x - top) for x in score]
                at = score.index(top) if t <= 0 else _drawn(score, t, us[j])
                rows[0].append(at)
                rows[1].append(weights[at] / sum(weights))
                rows[2].append(_one_hot(at, k) if t <= 0 else _softmax(score, t))
            picks.append(rows[0])
            confidence.append(rows[1])
            qs.append(rows[2])
        index = torch.tensor(picks, device=candidates.device).view(n, d, 1)
        return Walk(candidates.gather(2, index)[..., 0], torch.tensor(confidence).view(n, d),
                    torch.tensor(qs, device=candidates.device).view(n, d, k), candidates)

    def chooser(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: int
                ) -> Callable[[int, torch.Tensor], int]:
        """A greedy walk for one sequence (hidden [D, H], logits [D, V]) under a grammar: called
        with each position and its logits masked by the grammar, it takes the best-scoring
        candidate the grammar allows, or the masked argmax where it allows none of them."""
        unary, candidates, projected = self.candidates(hidden, logits)
        previous = torch.tensor([anchor], device=candidates.device)

        def choose(j: int, masked: torch.Tensor) -> int:
            nonlocal previous
            allowed = torch.isfinite(masked[candidates[j]])
            if bool(allowed.any()):
                scores = unary[j] + self.pair_scores(previous, projected[j:j + 1],
                                                     candidates[j:j + 1])[0]
                index = int(scores.masked_fill(~allowed, float("-inf")).argmax())
                token = int(candidates[j, index])
            else:
                token = int(masked.argmax())
            previous = torch.tensor([token], device=candidates.device)
            return token

        return choose


def _softmax(scores: list[float], temperature: float) -> list[float]:
    top = max(scores)
    weights = [math.exp((x - top) / temperature) for x in scores]
    total = sum(weights)
    return [w / total for w in weights]


def _drawn(scores: list[float], temperature: float, u: float) -> int:
    """The candidate softmax(scores / T) draws for the uniform u (inversion)."""
    q = _softmax(scores, temperature)
    target, mass = u * sum(q), 0.0
    for i, weight in enumerate(q):
        mass += weight
        if mass > target:
            return i
    return max(i for i, weight in enumerate(q) if weight > 0)


def _one_hot(index: int, size: int) -> list[float]:
    return [1.0 if i == index else 0.0 for i in range(size)]
