"""A fresh DFlash drafter for a target (`init_drafter`), a DFlash2 drafter grown from a DFlash one
(`grow_to_v2`), and the published checkpoint format they are written in (`save_drafter`,
`drafter_config_json`), which `load_drafter` reads back unchanged."""

from __future__ import annotations

import json
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors.torch import save_file

from ..engine.config import ModelConfig
from ..engine.models.checkpoint import DTYPES, WEIGHTS
from ..engine.models.dflash import DFlashDraftModel
from ..engine.models.dflash2 import GroupedDynamicConv
from ..engine.models.dflash_config import (ARCHITECTURE, ARCHITECTURE_V2, DFlash2Extras,
                                           DFlashConfig, check_compatible,
                                           default_target_layer_ids)
from ..engine.models.loader import unfused_sources

INIT_STD = 0.02                      # transformers' initializer_range for Qwen3


def init_drafter(
    target: ModelConfig, block_size: int = 16, num_layers: int = 1,
    target_layer_ids: Sequence[int] | None = None, mask_token_id: int | None = None,
    seed: int = 0, v2: DFlash2Extras | None = None,
) -> DFlashDraftModel:
    """A fresh float32 drafter (CPU) for a target: the target's layer shapes, rope and vocabulary;
    the spec's default target layers (clamped) and MASK = vocab - 1 unless given; linear
    weights N(0, 0.02) and norms 1, as transformers initialises Qwen3. v2: a DFlash2 drafter,
    its convolutions starting as the identity (`_start_v2`)."""
    depth = target.num_hidden_layers
    config = DFlashConfig(
        block_size=block_size,
        mask_token_id=target.vocab_size - 1 if mask_token_id is None else mask_token_id,
        target_layer_ids=tuple(target_layer_ids or _default_layer_ids(depth, num_layers)),
        num_target_layers=depth,
        vocab_size=target.vocab_size,
        hidden_size=target.hidden_size,
        intermediate_size=target.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=target.num_attention_heads,
        num_key_value_heads=target.num_key_value_heads,
        head_dim=target.head_dim,
        rms_norm_eps=target.rms_norm_eps,
        attention_bias=target.attention_bias,
        rope=target.rope,
        max_position_embeddings=target.max_position_embeddings,
        v2=v2,
    )
    check_compatible(config, target)
    with torch.device("meta"):
        model = DFlashDraftModel(config)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, INIT_STD, generator=generator)
        _start_v2(model)
    model.rotary.build("cpu")
    return model


def grow_to_v2(drafter: DFlashDraftModel, extras: DFlash2Extras, seed: int = 0
               ) -> DFlashDraftModel:
    """A float32 DFlash2 drafter (on the drafter's device) holding a DFlash drafter's weights,
    with convolutions that start as the identity and a selector whose pair term starts near
    zero: it drafts what the DFlash drafter drafts until training moves it."""
    if drafter.config.v2 is not None:
        raise ValueError("the drafter is a DFlash2 drafter already")
    with torch.device("meta"):
        model = DFlashDraftModel(replace(drafter.config, v2=extras))
    model.to_empty(device=drafter.device)
    generator = torch.Generator().manual_seed(seed)
    own = drafter.state_dict()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in own:
                param.copy_(own[name])
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * INIT_STD)
        _start_v2(model)
    model.rotary.build(drafter.device)
    return model.float()


def _start_v2(model: DFlashDraftModel) -> None:
    """Each convolution the identity (base kernel 1 at offset 0, no dynamic part)."""
    for module in model.modules():
        if isinstance(module, GroupedDynamicConv):
            module.base_kernel.zero_()
            module.base_kernel[:, 0] = 1.0
            module.kernel_projection.weight.zero_()


def _default_layer_ids(depth: int, num_layers: int) -> list[int]:
    """The spec's default target layers, clamped into [0, depth) for targets under 4 layers."""
    return [min(max(i, 0), depth - 1) for i in default_target_layer_ids(depth, num_layers)]


def drafter_config_json(config: DFlashConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The published config.json of a drafter (DFlashConfig.from_hf reads it back equal)."""
    rope, window = config.rope, config.sliding_window
    dflash: dict[str, Any] = {
        "mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids),
    }
    extras = {"input_embedding_scale": 1.0, "output_multiplier": 1.0,
              "final_logit_softcapping": None}
    dflash.update({k: getattr(config, k) for k, v in extras.items() if getattr(config, k) != v})
    if config.v2 is not None:
        dflash.update(asdict(config.v2))
    scaling = None
    if rope.rope_type != "default":
        scaling = {f.name: getattr(rope, f.name) for f in fields(rope)
                   if f.name != "theta" and getattr(rope, f.name) is not None}
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURE if config.v2 is None else ARCHITECTURE_V2],
        "model_type": "qwen3",
        "block_size": config.block_size,
        "num_target_layers": config.num_target_layers,
        "dflash_config": dflash,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": rope.theta,
        "rope_scaling": scaling,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": config.attention_bias,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "layer_types": list(config.layer_types),
        "use_sliding_window": window is not None,
        "sliding_window": window,
        "tie_word_embeddings": False,
        "dtype": {v: k for k, v in DTYPES.items()}[dtype],
    }
    if config.is_causal is not None:
        cfg["is_causal"] = config.is_causal
    return cfg


def save_drafter(
    model: DFlashDraftModel, path: str | Path, dtype: torch.dtype | None = None
) -> Path:
    """Write `model` to the directory `path` in the published format (config.json and
    model.safetensors with q/k/v and gate/up unfused), in `dtype` (default: the model's)."""
    dtype = model.dtype if dtype is None else dtype
    tensors = {}
    for key, value in model.state_dict().items():
        parts = unfused_sources(key, tuple(value.shape), model.config.decoder)
        pieces = value.split([shape[0] for _, shape in parts])
        for (name, _), piece in zip(parts, pieces):
            tensors[name] = piece.detach().to("cpu", dtype).contiguous()
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    config = drafter_config_json(model.config, dtype)
    (root / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, root / WEIGHTS, metadata={"format": "pt"})
    return root
