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

One transformation changes the numbers and so runs only when asked for (`quantize="int4"`):
- `int4-weights` (CPU, bfloat16): the target's decoder linears become group-wise int4
  (engine.models.quantized); the lm_head, the embedding and the drafter stay bfloat16 (the
  drafter runs on 16 rows a forward, where the int4 kernel is slower than packed bf16). Greedy
  speculative output equals the quantized target's plain output, bit for bit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .models.dflash import DFlashDraftModel
from .models.packed import PackedLinear, pack_linears, packing_available
from .models.quantized import int4_available, quantize_linears_int4
from .models.qwen3 import CausalLM

log = logging.getLogger(__name__)


QUANTIZATIONS = ("int4",)


@dataclass(frozen=True)
class FastPath:
    name: str
    applies: Callable[[CausalLM, str | None], bool]   # (model, quantize)
    apply: Callable[[CausalLM, DFlashDraftModel | None], None]


def _cpu_bf16(model: CausalLM) -> bool:
    weight = model.embed_tokens.weight
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16


def _int4(model: CausalLM, drafter: DFlashDraftModel | None) -> None:
    quantize_linears_int4(model.layers)


def _packs(model: CausalLM, quantize: str | None) -> bool:
    return _cpu_bf16(model) and packing_available()


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


FAST_PATHS: list[FastPath] = [  # in order: int4 first, packing takes what int4 left
    FastPath("int4-weights", lambda model, quantize: quantize == "int4", _int4),
    FastPath("onednn-packed-bf16", _packs, _pack),
]


def prepare(model: CausalLM, drafter: DFlashDraftModel | None = None,
            quantize: str | None = None) -> list[str]:
    """Apply, in place, every registered transformation that applies to `model` (and its
    drafter); returns their names. Models stay usable for inference only. quantize="int4"
    asks for int4 weights (CPU, bfloat16 only: ValueError elsewhere)."""
    if quantize is not None:
        if quantize not in QUANTIZATIONS:
            raise ValueError(f"quantize={quantize!r}: choose from {QUANTIZATIONS} or None")
        if not _cpu_bf16(model) or not int4_available():
            weight = model.embed_tokens.weight
            raise ValueError(f"quantize={quantize!r} needs a bfloat16 model on CPU and torch's "
                             f"CPU int4 kernel; this one is {weight.dtype} on {weight.device}")
    if _cpu_bf16(model) and not packing_available():
        log.warning("oneDNN bfloat16 matmuls with prepacked weights are not available in this "
                    "torch build or on this CPU: linear layers run unpacked (slower)")
    applied = []
    with torch.inference_mode():
        for path in FAST_PATHS:
            if path.applies(model, quantize):
                path.apply(model, drafter)
                applied.append(path.name)
    return applied
