"""Qwen3.5 (transformers' `qwen3_5`): a hybrid decoder of Gated DeltaNet and gated attention layers.

`layer_types` interleaves linear-attention layers (engine.models.gated_deltanet, state carried in
`RecurrentStates`) with full-attention layers (KV through an `AttentionBackend`, as in qwen3.py).
The full-attention layer is Qwen3's with three changes: q_proj also emits a per-head output gate
(rows interleaved per head: [query_h; gate_h]) and the attention output is multiplied by
sigmoid(gate) before o_proj; RoPE rotates only the first `rotary_dim` = head_dim *
partial_rotary_factor channels of each head; and every RMSNorm but the DeltaNet's gated one is
zero-centred (`x / rms(x) * (1 + w)`, in float32). Text-only positions: transformers' MRoPE uses
three position ids (t, h, w) and takes each frequency from one of them (`mrope_section`,
interleaved); for text all three are the token's position, so it is plain RoPE on rotary_dim.

Layer numbering: the backend's `attend(layer, ...)` gets the ordinal of the full-attention layer
among full-attention layers (a KV pool holds only those), and `RecurrentStates` lists the linear
layers by their ordinal among linear layers.

The mixture-of-experts variant (`Qwen3_5Moe*`, transformers' `qwen3_5_moe`) is the same model with
every layer's MLP a `SparseMoE` (engine.models.moe): routed experts plus a gated shared expert.

Both checkpoint layouts load, dense or MoE: `Qwen3_5[Moe]ForCausalLM` (`model.*`) and the text
model of `Qwen3_5[Moe]ForConditionalGeneration` (`model.language_model.*`; the vision tower
`model.visual.*` and the multi-token-prediction head `mtp.*` are skipped). Parameter names are
HF's without the prefix, with q/k/v, gate/up and the four DeltaNet input projections fused as the
loader below lists; experts stored one by one (`mlp.experts.{e}.gate_proj.weight`, as
transformers saves them) are stacked into the [E, ...] tensors, and stacked ones load as stored.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Container, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionBackend
from ..config import RopeConfig, generation_eos_ids, read_config_json
from ..errors import CheckpointError, UnsupportedModelError
from .gated_deltanet import GatedDeltaNet, RecurrentStates, conv_dim
from .layers import GatedMLP
from .moe import SparseMoE
from .checkpoint import assemble_state, load_dtype, read_safetensors_dir
from .qwen3 import CausalLM, ModelOutput
from .rope import RotaryEmbedding, apply_rope

log = logging.getLogger(__name__)

ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration",
                 "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
LINEAR, FULL = "linear_attention", "full_attention"
SKIPPED_PREFIXES = ("model.visual.", "mtp.")   # vision tower, multi-token-prediction head


@dataclass(frozen=True)
class HybridConfig:
    """Shape and numerics of a Qwen3.5 text model. Fields shared with `ModelConfig` keep its names
    and meaning; the linear_* fields shape the Gated DeltaNet layers; num_experts > 0 makes every
    MLP a mixture of experts (the moe_* and shared_expert_* fields; intermediate_size unused)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 0.25
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    torch_dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    num_experts: int = 0   # 0: dense MLPs
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        mlp = (("num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
               if self.num_experts else ("intermediate_size",))
        for name in ("vocab_size", "hidden_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_conv_kernel_dim", *mlp):
            if getattr(self, name) < 1:
                raise CheckpointError(
                    f"config field {name} must be >= 1, got {getattr(self, name)}")
        if self.num_experts_per_tok > self.num_experts > 0:
            raise CheckpointError(f"num_experts_per_tok {self.num_experts_per_tok} exceeds "
                                  f"num_experts {self.num_experts}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise CheckpointError(f"layer_types names {len(self.layer_types)} layers, "
                                  f"num_hidden_layers is {self.num_hidden_layers}")
        if unknown := set(self.layer_types) - {LINEAR, FULL}:
            raise UnsupportedModelError(f"layer types {sorted(unknown)} are not supported")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise CheckpointError(
                "linear_num_value_heads must be a multiple of linear_num_key_heads")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise CheckpointError(f"partial_rotary_factor {self.partial_rotary_factor} must give "
                                  f"an even rotary dimension in (0, head_dim]")

    @property
    def rotary_dim(self) -> int:
        """Channels of each head RoPE rotates (the first ones; the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def conv_dim(self) -> int:
        return conv_dim(self)

    @property
    def num_linear_layers(self) -> int:
        return self.layer_types.count(LINEAR)

    @property
    def num_full_layers(self) -> int:
        return self.layer_types.count(FULL)

    @property
    def num_kv_layers(self) -> int:
        """Layers whose K/V the paged pool holds: the full-attention ones."""
        return self.num_full_layers

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> HybridConfig:
        """Parse a config.json of either architecture (the text fields at the top level, or
        under "text_config" for Qwen3_5ForConditionalGeneration)."""
        archs = cfg.get("architectures") or []
        if not any(a in ARCHITECTURES for a in archs):
            raise UnsupportedModelError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {list(ARCHITECTURES)}")
        text = cfg.get("text_config") or cfg
        if text.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {text['hidden_act']!r} is not supported")
        if text.get("mlp_only_layers") or int(text.get("decoder_sparse_step", 1)) != 1:
            raise UnsupportedModelError("Qwen3.5 MoE with dense layers among the sparse ones "
                                        "(mlp_only_layers, decoder_sparse_step) is not supported")
        try:
            num_layers = int(text["num_hidden_layers"])
            layer_types = text.get("layer_types") or [
                FULL if (i + 1) % int(text.get("full_attention_interval", 4)) == 0 else LINEAR
                for i in range(num_layers)]
            rope_params = {**(text.get("rope_scaling") or {}),
                           **(text.get("rope_parameters") or {})}
            partial = rope_params.get("partial_rotary_factor",
                                      text.get("partial_rotary_factor", 0.25))
            heads = int(text["num_attention_heads"])
            # transformers ties the head to the embedding by the top-level config's flag
            tied = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
            eos = text.get("eos_token_id")
            if eos is None:
                eos = cfg.get("eos_token_id")
            experts = int(text.get("num_experts") or 0)
            moe = dict(num_experts=experts,
                       num_experts_per_tok=int(text["num_experts_per_tok"]),
                       moe_intermediate_size=int(text["moe_intermediate_size"]),
                       shared_expert_intermediate_size=int(
                           text["shared_expert_intermediate_size"])) if experts else {}
            return cls(
                vocab_size=int(text["vocab_size"]),
                hidden_size=int(text["hidden_size"]),
                intermediate_size=int(text["intermediate_size"] if not experts
                                      else text.get("intermediate_size") or 0),
                num_hidden_layers=num_layers,
                num_attention_heads=heads,
                num_key_value_heads=int(text.get("num_key_value_heads") or heads),
                head_dim=int(text.get("head_dim") or int(text["hidden_size"]) // heads),
                layer_types=tuple(str(t) for t in layer_types),
                linear_num_key_heads=int(text["linear_num_key_heads"]),
                linear_num_value_heads=int(text["linear_num_value_heads"]),
                linear_key_head_dim=int(text["linear_key_head_dim"]),
                linear_value_head_dim=int(text["linear_value_head_dim"]),
                linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
                partial_rotary_factor=float(partial),
                rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
                rope=RopeConfig.from_hf(text),
                max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
                tie_word_embeddings=bool(tied),
                attention_bias=bool(text.get("attention_bias", False)),
                torch_dtype=str(text.get("dtype") or cfg.get("dtype")
                                or cfg.get("torch_dtype") or "float32"),
                eos_token_ids=_token_ids(eos),
                **moe,
            )
        except KeyError as e:
            raise CheckpointError(f"config.json lacks required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"config.json has an invalid field: {e}") from None

    @classmethod
    def from_dir(cls, path: str | Path) -> HybridConfig:
        """The model of `path`/config.json, ending generation where `ModelConfig.from_dir` does
        (generation_config.json's eos_token_id first)."""
        config = cls.from_hf(read_config_json(path))
        eos = generation_eos_ids(path)
        return config if eos is None else replace(config, eos_token_ids=eos)


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(t) for t in value) if isinstance(value, list) else (int(value),)


class ZeroCentredRMSNorm(nn.Module):
    """y = (x / rms(x)) * (1 + weight), computed in float32 and cast back (weight starts at 0)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] channels of x [T, H, D]; the rest pass unchanged."""
    rot = cos.shape[-1]
    return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)


class GatedAttention(nn.Module):
    """Full causal attention with a sigmoid output gate per channel; `layer_idx` is this layer's
    ordinal among the full-attention layers (the backend's layer)."""

    def __init__(self, config: HybridConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.split_sizes = (2 * q_size, kv_size, kv_size)   # q_proj holds query and gate
        bias = config.attention_bias
        self.qkv_proj = nn.Linear(config.hidden_size, sum(self.split_sizes), bias=bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=bias)
        self.q_norm = ZeroCentredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        n = x.shape[0]
        query_gate, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q, gate = query_gate.view(n, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = apply_partial_rope(self.q_norm(q), cos, sin)
        k = apply_partial_rope(self.k_norm(k.view(n, self.num_kv_heads, self.head_dim)), cos, sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        out = attn.attend(self.layer_idx, q, k, v) * torch.sigmoid(gate)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class HybridDecoderLayer(nn.Module):
    """Pre-norm residual block: a token mixer (`linear_attn` or `self_attn`), then the MLP."""

    def __init__(self, config: HybridConfig, layer_type: str, ordinal: int) -> None:
        super().__init__()
        self.input_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.linear_attn: GatedDeltaNet | None = None
        self.self_attn: GatedAttention | None = None
        if layer_type == LINEAR:
            self.linear_attn = GatedDeltaNet(config, ordinal)
        else:
            self.self_attn = GatedAttention(config, ordinal)
        self.post_attention_layernorm = ZeroCentredRMSNorm(config.hidden_size,
                                                           config.rms_norm_eps)
        self.mlp: GatedMLP | SparseMoE
        if config.num_experts:
            self.mlp = SparseMoE(config.hidden_size, config.moe_intermediate_size,
                                 config.num_experts, config.num_experts_per_tok,
                                 config.shared_expert_intermediate_size)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bias=False)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend,
        states: RecurrentStates,
    ) -> torch.Tensor:
        x = self.input_layernorm(h)
        if self.linear_attn is not None:
            h = h + self.linear_attn(x, states)
        else:
            assert self.self_attn is not None
            h = h + self.self_attn(x, cos, sin, attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class HybridCausalLM(nn.Module):
    """Qwen3.5 text model on flattened tokens, with `CausalLM`'s surface plus `states`."""

    # Same embedding, head and properties as CausalLM: they only touch embed_tokens / lm_head.
    dtype = CausalLM.dtype
    device = CausalLM.device
    embed = CausalLM.embed
    logits = CausalLM.logits

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.config = config
        self.attention_scale = config.head_dim**-0.5
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        ordinals = {LINEAR: 0, FULL: 0}
        layers = []
        for layer_type in config.layer_types:
            layers.append(HybridDecoderLayer(config, layer_type, ordinals[layer_type]))
            ordinals[layer_type] += 1
        self.layers = nn.ModuleList(layers)
        self.norm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Module | None = None   # None: tied to embed_tokens (see CausalLM)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.rope, config.rotary_dim,
                                      config.max_position_embeddings)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        states: RecurrentStates,
        capture: Sequence[int] = (),
    ) -> ModelOutput:
        """Run T tokens (`input_ids`, `positions` [T]) through every layer; `states` covers the
        same sequences (sum(states.lengths) == T) and is advanced in place past their tokens.
        `capture` as in `CausalLM.forward`."""
        if sum(states.lengths) != input_ids.shape[0]:
            raise ValueError(f"states cover {sum(states.lengths)} tokens, the forward "
                             f"{input_ids.shape[0]}")
        num_layers = len(self.layers)
        if any(not 0 <= layer < num_layers for layer in capture):
            raise ValueError(f"capture layers {list(capture)} outside [0, {num_layers})")
        wanted = set(capture)
        saved: dict[int, torch.Tensor] = {}
        h = self.embed(input_ids)
        cos, sin = self.rotary.cos_sin(positions, h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, attn, states)
            if i in wanted:
                saved[i] = h
        captured = torch.cat([saved[layer] for layer in capture], dim=-1) if capture else None
        return ModelOutput(self.norm(h), captured)


# our fused module -> the HF modules whose weights it stacks by rows, in order
FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "in_proj": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
}


def _fused_rows(module: str, parent: str, config: HybridConfig) -> tuple[int, ...]:
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    heads_v = config.linear_num_value_heads
    inter = (config.shared_expert_intermediate_size if parent.endswith(".shared_expert")
             else config.intermediate_size)
    return {
        "qkv_proj": (2 * q, kv, kv),
        "gate_up_proj": (inter, inter),
        "in_proj": (config.conv_dim, heads_v * config.linear_value_head_dim, heads_v, heads_v),
    }[module]


def _hf_sources(key: str, shape: tuple[int, ...], config: HybridConfig, prefix: str,
                stored: Container[str]) -> list[tuple[str, tuple[int, ...]]]:
    """Stored names, with shapes, whose dim-0 concatenation (reshaped to `shape`) is our
    parameter `key`."""
    if key.startswith("lm_head."):
        return [(key, shape)]
    module, _, leaf = key.rpartition(".")
    if module.endswith(".experts") and prefix + key not in stored:   # one expert at a time
        parts = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
        rows = shape[1] // len(parts)
        return [(f"{prefix}{module}.{e}.{part}.weight", (rows, shape[2]))
                for e in range(shape[0]) for part in parts]
    parent, _, name = module.rpartition(".")
    if name not in FUSED:
        return [(prefix + key, shape)]
    return [(f"{prefix}{parent}.{part}.{leaf}", (rows, *shape[1:]))
            for part, rows in zip(FUSED[name], _fused_rows(name, parent, config))]


def load_qwen3_5(
    model_dir: str | Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> HybridCausalLM:
    """Load a Qwen3.5 checkpoint (either layout) onto `device` in `dtype` (None: the
    checkpoint's). Returns an eval-mode model without gradients."""
    root = Path(model_dir)
    config = HybridConfig.from_dir(root)
    dtype = load_dtype(dtype, config.torch_dtype)
    tensors = read_safetensors_dir(root)
    nested = any(name.startswith("model.language_model.") for name in tensors)
    prefix = "model.language_model." if nested else "model."
    skip = {name for name in tensors if name.startswith(SKIPPED_PREFIXES)}
    if skip:
        log.info("%s: skipped %d tensors outside the text model (%s)", root, len(skip),
                 ", ".join(p + "*" for p in SKIPPED_PREFIXES))
    if config.tie_word_embeddings:
        skip.add("lm_head.weight")
    with torch.device("meta"):
        model = HybridCausalLM(config)
    shapes = {key: tuple(p.shape) for key, p in model.state_dict().items()}
    sources = {key: _hf_sources(key, shape, config, prefix, tensors)
               for key, shape in shapes.items()}
    state = assemble_state(sources, tensors, dtype, torch.device(device), root,
                           "a Qwen3.5 text model with this config", skip)
    model.load_state_dict({key: t.view(shapes[key]) for key, t in state.items()}, assign=True)
    model.rotary.build(device)
    return model.eval().requires_grad_(False)

