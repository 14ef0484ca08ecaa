"""Sampling parameters and token selection: greedy, temperature, top-k, top-p, seeded.

`target_probs` is the one place where logits become the distribution a request samples from;
plain decoding and speculative verification both use it, so they sample the same distribution.
`top1` is the greedy choice (and the drafter's probability of its drafts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentflash.kernels import cpu_ops

from .errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks tokens and when it stops."""

    temperature: float = 0.0          # 0: greedy
    top_k: int = 0                    # 0: off
    top_p: float = 1.0                # 1: off
    seed: int | None = None
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()        # stop strings (need a detokenizer on the engine)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Distribution [..., V] (float32) after temperature, top-k and top-p; for sampling only."""
    logits = logits.float() / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest set whose mass reaches top_p (the token crossing it is kept)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def top1(logits: torch.Tensor, with_prob: bool = False) -> tuple[list, list | None]:
    """Each row's greedy token of logits [..., V] (the first of equal maxima, as torch.argmax)
    and, with_prob, its softmax probability, as nested lists shaped like logits[..., 0]. On CPU
    through the kernel once an engine loaded the CPU kernels (kernels.cpu_ops.top1: a few
    microseconds where torch's argmax and logsumexp take tens, every step), else torch."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and cpu_ops.loaded():
        flat = logits if logits.dim() == 2 else logits.reshape(-1, logits.shape[-1])
        index, prob = cpu_ops.top1(flat, with_prob)
        if logits.dim() != 2:
            index = index.view(logits.shape[:-1])
            prob = prob.view(logits.shape[:-1]) if with_prob else prob
    else:
        top = logits.max(-1)
        index = top.indices
        prob = (top.values - logits.logsumexp(-1)).exp() if with_prob else None
    return index.tolist(), prob.tolist() if with_prob else None


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen
