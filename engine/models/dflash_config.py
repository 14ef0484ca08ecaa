"""Configuration of a DFlash drafter, parsed from its published `config.json`, and its target check.

A drafter's config.json is a Qwen3 config (`architectures: ["DFlashDraftModel"]`) plus
`block_size`, `num_target_layers` and `dflash_config: {mask_token_id, target_layer_ids}`.
A DFlash2 drafter (`architectures: ["DFlash2DraftModel"]`) adds to `dflash_config` its
convolutions' `conv_kernel_size` and `conv_group_size` and its candidate selector's
`selector_rank` and `selector_top_k` (`DFlashConfig.v2`).
As in the reference code, the DFlash values are looked up in `dflash_config` first and at the
top level second, and the Qwen3 fields keep transformers' `Qwen3Config` semantics: a window
exists only with `use_sliding_window: true`, and absent `layer_types` mark the layers from
`max_window_layers` on as sliding when it does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..config import ModelConfig, RopeConfig
from ..errors import CheckpointError, DrafterMismatchError, UnsupportedModelError

ARCHITECTURE = "DFlashDraftModel"
ARCHITECTURE_V2 = "DFlash2DraftModel"
LAYER_TYPES = ("full_attention", "sliding_attention")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """Target layers tapped when the config names none: the middle one for a one-layer drafter,
    else evenly spread over [1, num_target_layers - 3] (Python's round, as the reference)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    return tuple(
        int(round(start + i * (end - start) / (num_draft_layers - 1)))
        for i in range(num_draft_layers)
    )


@dataclass(frozen=True)
class DFlash2Extras:
    """What a DFlash2 drafter adds: a grouped dynamic causal convolution before and after each
    sublayer (kernel width `conv_kernel_size`, one dynamic weight per `conv_group_size`
    channels) and a candidate selector (low-rank pair scores of rank `selector_rank` over each
    position's `selector_top_k` likeliest tokens)."""

    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int


@dataclass(frozen=True)
class DFlashConfig:
    """What a DFlash drafter needs: its block geometry, the target layers it reads, its own
    Qwen3-style layer shapes and the optional numerics extras the reference code honours."""

    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None       # None: the checkpoint does not say (not checked)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 32768
    layer_types: tuple[str, ...] = ()   # () means every layer is "full_attention"
    sliding_window: int | None = None   # the window of sliding layers (None: unbounded)
    is_causal: bool | None = None       # overrides causality of every layer when set
    input_embedding_scale: float = 1.0  # multiplies the block's token embeddings
    output_multiplier: float = 1.0      # multiplies the logits
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    v2: DFlash2Extras | None = None     # a DFlash2 drafter's extras (None: DFlash)

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_hidden_layers)
        if self.block_size < 2:
            raise CheckpointError(f"block_size must be >= 2 (got {self.block_size})")
        if self.mask_token_id < 0:
            raise CheckpointError(f"mask_token_id must be >= 0 (got {self.mask_token_id})")
        if not self.target_layer_ids or min(self.target_layer_ids) < 0:
            raise CheckpointError(
                f"target_layer_ids must be non-empty and >= 0 (got {list(self.target_layer_ids)})"
            )
        if self.num_target_layers is not None and self.num_target_layers < 1:
            raise CheckpointError(f"num_target_layers must be >= 1 (got {self.num_target_layers})")
        if len(self.layer_types) != self.num_hidden_layers:
            raise CheckpointError(
                f"layer_types has {len(self.layer_types)} entries for "
                f"{self.num_hidden_layers} layers"
            )
        if unknown := set(self.layer_types) - set(LAYER_TYPES):
            raise UnsupportedModelError(
                f"drafter layer types {sorted(unknown)} are not supported "
                f"(supported: {LAYER_TYPES})"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise CheckpointError(f"sliding_window must be >= 1 (got {self.sliding_window})")
        if self.final_logit_softcapping is not None and self.final_logit_softcapping <= 0:
            raise CheckpointError("final_logit_softcapping must be positive (or absent)")
        if self.v2 is not None:
            self._check_v2(self.v2)
        _ = self.decoder  # validates the layer shapes

    def _check_v2(self, v2: DFlash2Extras) -> None:
        if v2.conv_kernel_size < 1:
            raise CheckpointError(f"conv_kernel_size must be >= 1 (got {v2.conv_kernel_size})")
        if v2.conv_group_size < 1 or self.hidden_size % v2.conv_group_size:
            raise CheckpointError(
                f"conv_group_size {v2.conv_group_size} must divide hidden_size {self.hidden_size}"
            )
        if v2.selector_rank < 1:
            raise CheckpointError(f"selector_rank must be >= 1 (got {v2.selector_rank})")
        if not 1 <= v2.selector_top_k <= self.vocab_size:
            raise CheckpointError(
                f"selector_top_k must be in [1, vocab_size {self.vocab_size}] "
                f"(got {v2.selector_top_k})"
            )

    @property
    def decoder(self) -> ModelConfig:
        """The drafter's decoder layers as a Qwen3 target config (they share the layer code)."""
        return ModelConfig(
            family="qwen3",
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope=self.rope,
            max_position_embeddings=self.max_position_embeddings,
            attention_bias=self.attention_bias,
        )

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> DFlashConfig:
        version = _check_architecture(cfg)
        extra = cfg.get("dflash_config") or {}
        if not isinstance(extra, dict):
            raise CheckpointError("config.json: dflash_config must be a JSON object")

        def value(name: str, default: Any = None) -> Any:
            return extra.get(name, cfg.get(name, default))

        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {cfg['hidden_act']!r} is not supported")
        if value("mask_token_id") is None:
            raise CheckpointError("config.json lacks dflash_config.mask_token_id")
        try:
            layers = int(cfg["num_hidden_layers"])
            heads = int(cfg["num_attention_heads"])
            num_target = value("num_target_layers")
            num_target = None if num_target is None else int(num_target)
            ids = value("target_layer_ids")
            if ids is None:
                if num_target is None:
                    raise CheckpointError(
                        "config.json names neither dflash_config.target_layer_ids nor "
                        "num_target_layers, so the target layers to read are unknown"
                    )
                ids = default_target_layer_ids(num_target, layers)
            window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window") else None
            layer_types = cfg.get("layer_types") or [
                "sliding_attention"
                if window is not None and i >= int(cfg.get("max_window_layers", 28))
                else "full_attention"
                for i in range(layers)
            ]
            softcap = value("final_logit_softcapping")
            is_causal = cfg.get("is_causal")
            v2 = None
            if version == 2:
                missing = [name for name in V2_FIELDS if value(name) is None]
                if missing:
                    raise CheckpointError(f"config.json lacks dflash_config fields {missing} "
                                          f"that a {ARCHITECTURE_V2} needs")
                v2 = DFlash2Extras(*(int(value(name)) for name in V2_FIELDS))
            return cls(
                block_size=int(value("block_size", 16)),
                mask_token_id=int(value("mask_token_id")),
                target_layer_ids=tuple(int(i) for i in ids),
                num_target_layers=num_target,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=int(cfg["hidden_size"]),
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or 128),  # Qwen3Config's default
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                attention_bias=bool(cfg.get("attention_bias", False)),
                rope=RopeConfig.from_hf(cfg),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
                layer_types=tuple(str(t) for t in layer_types),
                sliding_window=None if window is None else int(window),
                is_causal=None if is_causal is None else bool(is_causal),
                input_embedding_scale=float(value("input_embedding_scale", 1.0)),
                output_multiplier=float(value("output_multiplier", 1.0)),
                # the reference applies the cap only when it is positive
                final_logit_softcapping=(
                    float(softcap) if softcap is not None and float(softcap) > 0 else None
                ),
                v2=v2,
            )
        except KeyError as e:
            raise CheckpointError(f"config.json lacks required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"config.json has an invalid field: {e}") from None


V2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def _check_architecture(cfg: dict[str, Any]) -> int:
    """1 for a DFlash drafter, 2 for a DFlash2 one."""
    archs = cfg.get("architectures") or []
    if ARCHITECTURE in archs:
        return 1
    if ARCHITECTURE_V2 in archs:
        return 2
    raise UnsupportedModelError(
        f"{archs or cfg.get('model_type')!r} is not a DFlash drafter: expected "
        f"architectures [{ARCHITECTURE!r}] or [{ARCHITECTURE_V2!r}]"
    )


def check_compatible(draft: DFlashConfig, target: ModelConfig) -> None:
    """Raise DrafterMismatchError unless the drafter was built for a target shaped like this."""
    problems = []
    if draft.hidden_size != target.hidden_size:
        problems.append(
            f"hidden_size {draft.hidden_size} != the target's {target.hidden_size}"
        )
    if draft.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {draft.vocab_size} != the target's {target.vocab_size}")
    depth = target.num_hidden_layers
    if draft.num_target_layers is not None and draft.num_target_layers != depth:
        problems.append(f"num_target_layers {draft.num_target_layers} != the target's {depth}")
    if outside := [i for i in draft.target_layer_ids if i >= depth]:
        problems.append(f"target_layer_ids {outside} outside the target's layers [0, {depth})")
    if draft.mask_token_id >= target.vocab_size:
        problems.append(
            f"mask_token_id {draft.mask_token_id} outside the target's vocabulary "
            f"[0, {target.vocab_size})"
        )
    if problems:
        raise DrafterMismatchError(
            "the drafter does not fit this target model: " + "; ".join(problems)
        )
