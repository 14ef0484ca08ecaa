"""Gated DeltaNet: the linear-attention layer of Qwen3.5, with its per-sequence recurrent state.

Per token t and value head, the layer keeps a matrix state S [Dk, Dv] and applies the gated delta
rule (decay, then a corrective write of v toward what S predicts for k, then a read with q):

    S <- exp(g_t) * S
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T
    o_t = S^T q_t

with q, k L2-normalised (q also scaled by Dk**-0.5), g_t = -exp(A_log) * softplus(a_t + dt_bias)
and beta_t = sigmoid(b_t). q/k/v come out of a depthwise causal conv1d (SiLU) whose window of the
last `kernel - 1` inputs is state too. Two forms of the rule: `delta_rule_step` (one token, many
sequences: decode) and `delta_rule_chunked` (one sequence, 64-token chunks solved in closed form:
prefill; on CUDA, flash-linear-attention's kernel and causal-conv1d's where installed, see
agentflash.kernels.linear_attention). Tokens are flattened as in engine.models.qwen3; `RecurrentStates` says which sequence
each run of tokens belongs to and holds the states the layer reads and overwrites in place.

A speculative verify block runs "stepwise": token by token in the recurrent form (each token's
arithmetic is a decode step's), its per-token inputs recorded (`StepInputs`), so that once the
drafts are judged `replay` gives the exact state after the accepted prefix from the state before
the block: a rejection rolls the layer back as the paged KV is rolled back.

Parameter names are Hugging Face's, except that in_proj_qkv / in_proj_z / in_proj_b / in_proj_a
are fused into `in_proj` (rows in that order); the loader concatenates them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from agentflash.kernels import linear_attention

from .layers import RMSNorm

CHUNK_SIZE = 64
L2_EPS = 1e-6  # inside the square root, as transformers' (and FLA's) l2norm


class LinearAttentionConfig(Protocol):
    """The shape fields the linear layers read (engine.models.qwen3_5.HybridConfig has them)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def rms_norm_eps(self) -> float: ...
    @property
    def linear_num_key_heads(self) -> int: ...
    @property
    def linear_num_value_heads(self) -> int: ...
    @property
    def linear_key_head_dim(self) -> int: ...
    @property
    def linear_value_head_dim(self) -> int: ...
    @property
    def linear_conv_kernel_dim(self) -> int: ...
    @property
    def num_linear_layers(self) -> int: ...


def conv_dim(config: LinearAttentionConfig) -> int:
    """Channels of the causal conv: q, k and v side by side."""
    return (2 * config.linear_num_key_heads * config.linear_key_head_dim
            + config.linear_num_value_heads * config.linear_value_head_dim)


@dataclass(frozen=True)
class StepInputs:
    """One linear layer's inputs for the tokens of a stepwise sequence, in order."""

    mixed: torch.Tensor   # [n, conv_dim] the causal conv's inputs (the model's dtype)
    q: torch.Tensor       # [n, Hv, Dk] float32, as delta_rule_step takes them
    k: torch.Tensor       # [n, Hv, Dk]
    v: torch.Tensor       # [n, Hv, Dv]
    g: torch.Tensor       # [n, Hv]
    beta: torch.Tensor    # [n, Hv]


def replay(window: torch.Tensor, state: torch.Tensor, inputs: StepInputs, count: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv window [C, K - 1] and recurrent state [Hv, Dk, Dv] after the first `count` tokens
    of `inputs`, from `window` and `state` before them: bit for bit what the stepwise forward
    held after its count-th token (the same steps on the same inputs)."""
    keep = window.shape[-1]
    full = torch.cat((window, inputs.mixed[:count].transpose(0, 1).to(window.dtype)), dim=-1)
    state = state[None]
    for t in range(count):
        _, state = delta_rule_step(inputs.q[t:t + 1], inputs.k[t:t + 1], inputs.v[t:t + 1],
                                   inputs.g[t:t + 1], inputs.beta[t:t + 1], state)
    return full[..., full.shape[-1] - keep:], state[0]


@dataclass
class RecurrentStates:
    """Per-sequence state of the linear-attention layers for one forward over sequences laid end to
    end. Sequence s owns row s of every tensor; layers overwrite the rows in place, so after the
    forward they hold the state after each sequence's last token of this forward."""

    lengths: list[int]                 # tokens of each sequence in this forward, in order
    conv: list[torch.Tensor]           # per linear layer (by ordinal among linear layers):
                                       # [S, conv_dim, kernel - 1], the last inputs, oldest first
    recurrent: list[torch.Tensor]      # per linear layer: [S, Hv, Dk, Dv] float32
    stepwise: frozenset[int] = frozenset()  # sequences run token by token, inputs recorded
    # The layout of the forward, derived once from `lengths` and shared by every layer:
    decode_seqs: torch.Tensor = field(init=False)    # [B] sequences with one token (recurrent form)
    decode_rows: torch.Tensor = field(init=False)    # [B] their token rows
    prefill: list[tuple[int, int, int]] = field(init=False)  # (sequence, first row, end row)
    steps: list[tuple[int, int, int]] = field(init=False)    # the stepwise ones, the same way
    # what each layer (by ordinal) recorded for each stepwise sequence
    inputs: dict[tuple[int, int], StepInputs] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if any(n < 1 for n in self.lengths):
            raise ValueError(f"sequence lengths must be >= 1, got {self.lengths}")
        if len(self.conv) != len(self.recurrent):
            raise ValueError("conv and recurrent states must cover the same layers")
        for conv, rec in zip(self.conv, self.recurrent):
            if conv.shape[0] != len(self.lengths) or rec.shape[0] != len(self.lengths):
                raise ValueError(f"states hold {conv.shape[0]} / {rec.shape[0]} sequences, "
                                 f"the forward {len(self.lengths)}")
            if rec.dtype != torch.float32:
                raise ValueError(f"recurrent states must be float32, got {rec.dtype}")
        device = self.conv[0].device if self.conv else torch.device("cpu")
        if any(not 0 <= s < len(self.lengths) for s in self.stepwise):
            raise ValueError(f"stepwise sequences {sorted(self.stepwise)} outside the forward")
        seqs, rows, self.prefill, self.steps = [], [], [], []
        start = 0
        for s, n in enumerate(self.lengths):
            if s in self.stepwise:
                self.steps.append((s, start, start + n))
            elif n == 1:
                seqs.append(s)
                rows.append(start)
            else:
                self.prefill.append((s, start, start + n))
            start += n
        self.decode_seqs = torch.tensor(seqs, dtype=torch.long, device=device)
        self.decode_rows = torch.tensor(rows, dtype=torch.long, device=device)

    @classmethod
    def zeros(
        cls, config: LinearAttentionConfig, lengths: Sequence[int],
        device: torch.device | str, dtype: torch.dtype,
    ) -> RecurrentStates:
        """Fresh states (sequences starting at position 0): conv windows in `dtype` (they hold
        layer inputs), recurrent states in float32."""
        s = len(lengths)
        conv_shape = (s, conv_dim(config), config.linear_conv_kernel_dim - 1)
        rec_shape = (s, config.linear_num_value_heads, config.linear_key_head_dim,
                     config.linear_value_head_dim)
        layers = range(config.num_linear_layers)
        return cls(list(lengths),
                   [torch.zeros(conv_shape, dtype=dtype, device=device) for _ in layers],
                   [torch.zeros(rec_shape, dtype=torch.float32, device=device) for _ in layers])


def causal_conv(
    x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d + SiLU of x [B, L, C] continuing after `window` [B, C, K - 1] (the
    previous inputs; zeros at a sequence's start). Returns the output [B, L, C] and the window
    after x. weight: [C, 1, K]. Computed in float32 and rounded once to the window's dtype (torch's
    bfloat16 depthwise conv1d on CPU runs one slow convolution per channel: 88% of a decode step);
    one token (a decode step) is one dot product per channel."""
    length = x.shape[1]
    full = torch.cat((window, x.transpose(1, 2).to(window.dtype)), dim=-1)   # [B, C, K - 1 + L]
    if length == 1:
        out = (full.float() * weight[:, 0].float()).sum(dim=-1, keepdim=True)
    else:
        out = F.conv1d(full.float(), weight.float(), groups=weight.shape[0])  # [B, C, L]
    return F.silu(out).to(window.dtype).transpose(1, 2), full[..., length:]


def l2_normalise(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def delta_rule_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H], state
    [B, H, Dk, Dv] (all float32). Returns the output [B, H, Dv] and the new state."""
    state = state * g.exp()[..., None, None]
    predicted = (k[..., None, :] @ state).squeeze(-2)                 # S^T k: [B, H, Dv]
    update = beta[..., None] * (v - predicted)
    state = state + k[..., :, None] * update[..., None, :]
    return (q[..., None, :] @ state).squeeze(-2), state


def delta_rule_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule over the L tokens of one sequence, `chunk_size` at a time: q, k [L, H, Dk],
    v [L, H, Dv], g, beta [L, H], state [H, Dk, Dv] (float32). Returns [L, H, Dv] and the state.

    Within a chunk, with G_t the cumulative sum of g from its start and S_0 the state before it,
    the values actually written, u_t = beta_t (v_t - (S_{t-1} decayed)^T k_t), satisfy the unit
    lower-triangular system (UT transform)

        u_t + beta_t sum_{j<t} exp(G_t - G_j) (k_t . k_j) u_j
            = beta_t v_t - beta_t exp(G_t) S_0^T k_t

    so U = W - Kc S_0 with W, Kc solved once for all chunks; then, sequentially per chunk,
    o_t = exp(G_t) S_0^T q_t + sum_{j<=t} exp(G_t - G_j) (q_t . k_j) u_j and
    S_C = exp(G_C) S_0 + sum_j exp(G_C - G_j) k_j u_j^T.
    Padding the last chunk with zeros (g = 0, beta = 0, k = 0) leaves outputs and state exact.
    """
    length = q.shape[0]
    pad = -length % chunk_size

    def chunks(x: torch.Tensor) -> torch.Tensor:   # [L, H, ...] -> [H, N, C, ...]
        x = F.pad(x.movedim(0, 1), (0, 0) * (x.dim() - 2) + (0, pad))
        return x.reshape(x.shape[0], -1, chunk_size, *x.shape[2:])

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    cum = g.cumsum(dim=-1)                                             # G: [H, N, C]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # decay[t, j] = exp(G_t - G_j) for j <= t, else 0 (masked before exp: G_t - G_j > 0 there)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    # The system's strictly lower part; solve_triangular reads only that (unit diagonal).
    system = (k @ k.transpose(-1, -2)) * decay * beta[..., :, None]
    w = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False,
                                      unitriangular=True)
    kc = torch.linalg.solve_triangular(system, k * (beta * cum.exp())[..., None], upper=False,
                                       unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay                         # [H, N, C, C]
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]                  # [H, N, 1, 1]
    out = torch.empty_like(v)
    for n in range(q.shape[1]):
        u = w[:, n] - kc[:, n] @ state
        out[:, n] = q_decayed[:, n] @ state + scores[:, n] @ u
        state = state * chunk_decay[:, n] + k_to_end[:, n].transpose(-1, -2) @ u
    out = out.reshape(out.shape[0], -1, out.shape[-1])[:, :length]
    return out.movedim(1, 0), state


class GatedDeltaNet(nn.Module):
    """The linear-attention token mixer; `ordinal` indexes its states in `RecurrentStates`."""

    def __init__(self, config: LinearAttentionConfig, ordinal: int) -> None:
        super().__init__()
        self.ordinal = ordinal
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads   # a multiple of num_k_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        key_dim = self.num_k_heads * self.head_k_dim
        value_dim = self.num_v_heads * self.head_v_dim
        channels = conv_dim(config)
        self.qkv_sizes = (key_dim, key_dim, value_dim)
        self.split_sizes = (channels, value_dim, self.num_v_heads, self.num_v_heads)  # qkv z b a
        self.in_proj = nn.Linear(config.hidden_size, sum(self.split_sizes), bias=False)
        kernel = config.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(channels, channels, kernel, groups=channels, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = RMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(value_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, states: RecurrentStates) -> torch.Tensor:
        n = x.shape[0]
        raw, z, b, a = self.in_proj(x).split(self.split_sizes, dim=-1)
        mixed = self._conv(raw, states.conv[self.ordinal], states)
        q, k, v = mixed.split(self.qkv_sizes, dim=-1)
        q = l2_normalise(q.float().view(n, self.num_k_heads, self.head_k_dim))
        q = q * self.head_k_dim**-0.5
        k = l2_normalise(k.float().view(n, self.num_k_heads, self.head_k_dim))
        groups = self.num_v_heads // self.num_k_heads   # value heads per q/k head, consecutive
        if groups > 1:
            q, k = q.repeat_interleave(groups, dim=1), k.repeat_interleave(groups, dim=1)
        v = v.float().view(n, self.num_v_heads, self.head_v_dim)
        beta = b.sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        out = self._delta_rule(q, k, v, g, beta, states.recurrent[self.ordinal], states)
        for s, first, end in states.steps:
            span = slice(first, end)
            states.inputs[(self.ordinal, s)] = StepInputs(raw[span], q[span], k[span], v[span],
                                                          g[span], beta[span])
        # gated RMSNorm per value head: norm, weight, then * silu(z) in float32
        z = z.reshape(n, self.num_v_heads, self.head_v_dim)
        out = (self.norm(out.to(x.dtype)) * F.silu(z.float())).to(x.dtype)
        return self.out_proj(out.reshape(n, -1))

    def _conv(self, mixed: torch.Tensor, window: torch.Tensor, states: RecurrentStates
              ) -> torch.Tensor:
        out = torch.empty_like(mixed)
        weight = self.conv1d.weight
        if len(states.decode_rows):
            rows, seqs = states.decode_rows, states.decode_seqs
            step, window[seqs] = causal_conv(mixed[rows, None], window[seqs], weight)
            out[rows] = step[:, 0]
        fused = linear_attention.conv_available(mixed.device)
        for s, first, end in states.prefill:
            if fused:
                out[first:end], window[s] = linear_attention.causal_conv(mixed[first:end],
                                                                         window[s], weight)
                continue
            chunk, last = causal_conv(mixed[None, first:end], window[s:s + 1], weight)
            out[first:end] = chunk[0]
            window[s] = last[0]
        for s, first, end in states.steps:  # one token at a time, as decode steps
            for t in range(first, end):
                step, window[s:s + 1] = causal_conv(mixed[None, t:t + 1], window[s:s + 1],
                                                    weight)
                out[t] = step[0, 0]
        return out

    def _delta_rule(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
        beta: torch.Tensor, state: torch.Tensor, states: RecurrentStates,
    ) -> torch.Tensor:
        out = torch.empty_like(v)
        if len(states.decode_rows):
            rows, seqs = states.decode_rows, states.decode_seqs
            out[rows], state[seqs] = delta_rule_step(q[rows], k[rows], v[rows], g[rows],
                                                     beta[rows], state[seqs])
        chunked = (linear_attention.chunk_delta_rule
                   if linear_attention.fla_available(q.device) else delta_rule_chunked)
        for s, first, end in states.prefill:
            span = slice(first, end)
            out[span], state[s] = chunked(q[span], k[span], v[span], g[span], beta[span],
                                          state[s])
        for s, first, end in states.steps:
            current = state[s:s + 1]
            for t in range(first, end):
                row = slice(t, t + 1)
                out[row], current = delta_rule_step(q[row], k[row], v[row], g[row], beta[row],
                                                    current)
            state[s] = current[0]
        return out
