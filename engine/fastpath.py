"""How the engine prepares its models for inference on the machine it runs on.

A small registry of model transformations, each with the condition it applies under (device,
dtype, what the CPU and the torch build offer). `Engine` runs `prepare` on its target and drafter
when it is made, so every front end (`Engine.from_dir`, `Runtime.load`, `agentflash generate`)
gets the fast path with no flag; `Engine(..., fast_path=False)` keeps the models as loaded.

Every transformation here keeps the numbers bit for bit: greedy output, speculative or not, is
the same with and without it (tests/test_packed.py, and the engine tests run through it).

- `onednn-packed-bf16` (CPU, bfloat16, oneDNN with bf16 support): every linear layer's weight is
  reordered once into oneDNN's blocked layout (engine.models.packed); the tied lm_head gets a
  packed copy of the embedding matrix (the embedding lookup keeps the plain one).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .models.dflash import DFlashDraftModel
from .models.packed import PackedLinear, can_pack, pack_linears, packing_available
from .models.qwen3 import CausalLM

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FastPath:
    name: str
    applies: Callable[[CausalLM], bool]
    apply: Callable[[CausalLM, DFlashDraftModel | None], None]


def _packs(model: CausalLM) -> bool:
    return can_pack(model.embed_tokens.weight)


def _pack(model: CausalLM, drafter: DFlashDraftModel | None) -> None:
    if model.lm_head is None:  # tied: the head packs a copy, the embedding keeps its matrix
        model.lm_head = PackedLinear(model.embed_tokens.weight, None)
    pack_linears(model)
    if drafter is not None:
        if drafter.context_kv_proj is None:
            drafter.context_kv_proj = nn.ModuleList(
                _kv_rows(layer.self_attn) for layer in drafter.layers)
        pack_linears(drafter)


def _kv_rows(attn: nn.Module) -> nn.Module:
    """A linear of the K and V rows of an attention layer's fused qkv_proj."""
    q_size = attn.split_sizes[0]
    bias = attn.qkv_proj.bias
    return PackedLinear(attn.qkv_proj.weight[q_size:],
                        None if bias is None else bias[q_size:])


FAST_PATHS: list[FastPath] = [FastPath("onednn-packed-bf16", _packs, _pack)]


def prepare(model: CausalLM, drafter: DFlashDraftModel | None = None) -> list[str]:
    """Apply, in place, every registered transformation that applies to `model` (and its
    drafter); returns their names. Models stay usable for inference only."""
    weight = model.embed_tokens.weight
    if weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and not packing_available():
        log.warning("oneDNN bfloat16 matmuls with prepacked weights are not available in this "
                    "torch build or on this CPU: linear layers run unpacked (slower)")
    applied = []
    with torch.inference_mode():
        for path in FAST_PATHS:
            if path.applies(model):
                path.apply(model, drafter)
                applied.append(path.name)
    return applied
