"""The target model: Qwen3 and Llama decoder-only transformers in plain torch.

Qwen3 is Llama plus a per-head RMSNorm on q and k before RoPE (`ModelConfig.qk_norm`). Tokens are
flattened (no batch dimension): a forward takes T tokens of any number of sequences laid end to
end, their absolute positions, and an `AttentionBackend` that knows which keys each query sees.

Parameter names mirror Hugging Face's without the `model.` prefix, except that q/k/v and gate/up
projections are fused (`self_attn.qkv_proj`, `mlp.gate_up_proj`); the loader concatenates them.
Build on the `meta` device and load with `load_state_dict(..., assign=True)`, then call
`rotary.build(device)` (the loader does all of this).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionBackend
from ..config import ModelConfig
from .layers import GatedMLP, RMSNorm
from .rope import RotaryEmbedding, apply_rope


class ModelOutput(NamedTuple):
    hidden: torch.Tensor             # [T, H] after the final norm
    captured: torch.Tensor | None    # [T, len(capture) * H] residual stream after the layers asked


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.split_sizes = (q_size, kv_size, kv_size)
        bias = config.attention_bias
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=bias)
        # Qwen3 normalises each head of q and k before RoPE; Llama does not.
        self.q_norm: nn.Module = nn.Identity()
        self.k_norm: nn.Module = nn.Identity()
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend,
        rows: torch.Tensor | None = None, expand: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The attention output of every token of x, or only of the tokens `rows` (indices into
        x): keys and values come from every token either way. expand: x holds only distinct
        inputs, token i's is x[expand[i]] (projected and normalised once, rotated per token)."""
        n, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(n, heads + 2 * kv_heads, self.head_dim)
        qk, v = qkv.split((heads + kv_heads, kv_heads), dim=1)
        # q and k heads are normalised and rotated in one call each (both act on every head
        # alone, so this is bitwise the two separate calls, with half the kernel launches)
        if isinstance(self.q_norm, RMSNorm):
            qk = self.q_norm.norm(qk, torch.cat((self.q_norm.weight.expand(heads, -1),
                                                 self.k_norm.weight.expand(kv_heads, -1))))
        if expand is not None:
            qk, v = qk.index_select(0, expand), v.index_select(0, expand)
        q, k = apply_rope(qk, cos, sin).split((heads, kv_heads), dim=1)
        if rows is not None:
            q = q.index_select(0, rows)
        out = attn.attend(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(q.shape[0], self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend,
        rows: torch.Tensor | None = None, expand: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layer's output for every token of h, or only for the tokens `rows` (a drafter
        block's rows whose drafts are verified: the other tokens still give their keys and
        values; `attn` then takes queries of those rows). expand: h holds only the distinct
        inputs, token i's being h[expand[i]] (a drafter block's mask tokens: Attention)."""
        a = self.self_attn(self.input_layernorm(h), cos, sin, attn, rows, expand)
        if expand is not None:
            h = h.index_select(0, expand if rows is None else expand.index_select(0, rows))
        elif rows is not None:
            h = h.index_select(0, rows)
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h))


class CausalLM(nn.Module):
    """Decoder-only LM on flattened tokens: `forward` ends at the final norm, `logits` projects."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.attention_scale = config.head_dim**-0.5
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Tied checkpoints have no lm_head: `logits` multiplies by the embedding matrix instead,
        # so nothing needs re-tying after `load_state_dict(assign=True)`. (An inference
        # transformation may set a head of its own: engine.cpu.fastpath packs one on CPU.)
        self.lm_head: nn.Module | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def logits(self, hidden: torch.Tensor, head: nn.Module | None = None) -> torch.Tensor:
        """float32 logits [..., vocab] (the matmul runs in the model dtype, as in HF). Leading
        dimensions are flattened first: on a strided 3-d view (the drafter's block rows) linear
        would broadcast the head into a batched matmul several times slower on CPU. head: a
        copy of the head to project with instead (a drafter's int8 one, engine.cpu.fastpath)."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        head = head if head is not None else self.lm_head
        flat = F.linear(flat, self.embed_tokens.weight) if head is None else head(flat)
        return flat.view(*hidden.shape[:-1], flat.shape[-1]).float()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        capture: Sequence[int] = (),
    ) -> ModelOutput:
        """Run T tokens (`input_ids`, `positions` [T]) through every layer.

        `captured` concatenates, in the order given, the residual stream after decoder layer l
        for each l in `capture`: HF's `output_hidden_states[l + 1]`, except for the last layer,
        where it is the state *before* the final norm (HF reports the normed one there).
        Positions must be below `config.max_position_embeddings`.
        """
        num_layers = len(self.layers)
        if any(not 0 <= layer < num_layers for layer in capture):
            raise ValueError(f"capture layers {list(capture)} outside [0, {num_layers})")
        wanted = set(capture)
        saved: dict[int, torch.Tensor] = {}
        h = self.embed(input_ids)
        cos, sin = self.rotary.cos_sin(positions, h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, attn)
            if i in wanted:
                saved[i] = h  # layers never write in place, so a reference is enough
        captured = torch.cat([saved[layer] for layer in capture], dim=-1) if capture else None
        return ModelOutput(self.norm(h), captured)
