"""The sparse mixture-of-experts MLP of Qwen3.5-MoE (transformers' `Qwen3_5MoeSparseMoeBlock`).

A router (`gate`, one logit per expert) picks each token's top k experts by softmax probability,
computed in float32, and renormalises those k probabilities to sum to one; each chosen expert is a
SiLU-gated MLP, and their outputs are summed with those weights. A shared expert runs on every
token, scaled by sigmoid(`shared_expert_gate`(x)), and is added.

The experts' weights are stacked as transformers holds them in memory: `experts.gate_up_proj`
[E, 2 * inter, hidden] (each expert's gate rows, then its up rows) and `experts.down_proj`
[E, hidden, inter]. Tokens are grouped by expert, so each chosen expert runs one matmul pair over
its tokens and unchosen experts cost nothing. With `Experts.kernel` set (engine.cpu.fastpath does, in
bfloat16 on a CPU where agentflash's kernels run and torch would emulate bf16 matmuls) those
matmuls take the CPU kernel, whose rows do not depend on how many tokens an expert got.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from agentflash.kernels import cpu_ops

from .layers import GatedMLP


class Experts(nn.Module):
    """`num_experts` SiLU-gated MLPs with stacked weights, each run on the tokens routed to it."""

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.kernel = False   # matmuls through agentflash's CPU kernel (bfloat16 on CPU)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor:
        """sum_j weights[t, j] * expert_{experts[t, j]}(x[t]) for each token t of x [T, hidden];
        `experts` and `weights` are [T, k]."""
        top_k = experts.shape[1]
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)   # (token, slot) pairs grouped by expert
        tokens = order // top_k
        scale = weights.flatten()[order, None]
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        linear = cpu_ops.linear if self.kernel else F.linear
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            rows = slice(start, start + count)
            start += count
            gate, up = linear(x[tokens[rows]], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = linear(F.silu(gate) * up, self.down_proj[expert])
            out.index_add_(0, tokens[rows], y * scale[rows])
        return out


class SparseMoE(nn.Module):
    """Routed experts plus a sigmoid-gated shared expert, on flattened tokens [T, hidden]."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int,
                 shared_inter: int) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be in [1, num_experts={num_experts}]")
        self.top_k = top_k
        self.gate = nn.Linear(hidden, num_experts, bias=False)   # the router
        self.experts = Experts(num_experts, hidden, inter)
        self.shared_expert = GatedMLP(hidden, shared_inter, bias=False)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts [T, k] and their renormalised weights [T, k] (in x's dtype)."""
        logits = self.gate(x)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(logits.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.experts(x, experts, weights) + shared
