"""Load a Hugging Face checkpoint directory: Qwen3/Llama into `CausalLM`, Qwen3.5 (either
layout) into `HybridCausalLM` (engine.models.qwen3_5 loads those).

A checkpoint is `config.json` plus safetensors weights (engine.models.checkpoint). The model is
built on the `meta` device, HF tensors are renamed (dropping the `model.` prefix) and fused
(q/k/v into `qkv_proj`, gate/up into `gate_up_proj`), checked against the shapes the config
implies, cast and moved, then assigned with `load_state_dict(assign=True)`. Every failure is a `CheckpointError`
(or `UnsupportedModelError`) that names the file or tensor at fault.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch

from ..config import ModelConfig, read_config_json
from ..errors import CheckpointError
from .checkpoint import assemble_state, load_dtype, read_safetensors_dir
from .qwen3 import CausalLM
from .qwen3_5 import ARCHITECTURES as HYBRID_ARCHITECTURES
from .qwen3_5 import HybridCausalLM, load_qwen3_5


def load_model(
    path: str | Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> CausalLM | HybridCausalLM:
    """Load the checkpoint at `path` onto `device` in `dtype` (None: the checkpoint's own dtype,
    float32 if it names none we support). Returns an eval-mode model without gradients."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"model directory {root} does not exist")
    if set(read_config_json(root).get("architectures") or []) & set(HYBRID_ARCHITECTURES):
        return load_qwen3_5(root, dtype, device)
    config = ModelConfig.from_dir(root)
    dtype = load_dtype(dtype, config.torch_dtype)
    tensors = read_safetensors_dir(root)
    with torch.device("meta"):
        model = CausalLM(config)
    state = _convert(model, tensors, dtype, torch.device(device), root)
    model.load_state_dict(state, assign=True)
    model.rotary.build(device)
    return model.eval().requires_grad_(False)


def _convert(
    model: CausalLM,
    tensors: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    root: Path,
) -> dict[str, torch.Tensor]:
    """Our state dict from HF tensors, after checking names and shapes against the config."""
    config = model.config
    sources = {
        key: _hf_sources(key, tuple(p.shape), config) for key, p in model.state_dict().items()
    }
    # tied: the embedding is the head, as in transformers
    skip = {"lm_head.weight"} if config.tie_word_embeddings else set()
    return assemble_state(
        sources, tensors, dtype, device, root, f"a {config.family} model with this config", skip
    )


def _hf_sources(
    key: str, shape: tuple[int, ...], config: ModelConfig
) -> list[tuple[str, tuple[int, ...]]]:
    """HF tensor names, with their shapes, whose dim-0 concatenation is our parameter `key`."""
    return [(_hf_name(name), part) for name, part in unfused_sources(key, shape, config)]


def unfused_sources(
    key: str, shape: tuple[int, ...], config: ModelConfig
) -> list[tuple[str, tuple[int, ...]]]:
    """Checkpoint names (ours, unfused: no `model.` prefix), with their shapes, whose dim-0
    concatenation is our parameter `key`: q/k/v for `qkv_proj`, gate/up for `gate_up_proj`."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    inter = config.intermediate_size
    fused = {
        "qkv_proj": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
        "gate_up_proj": (("gate_proj", inter), ("up_proj", inter)),
    }
    module, _, leaf = key.rpartition(".")
    parent, _, name = module.rpartition(".")
    if name not in fused:
        return [(key, shape)]
    return [(f"{parent}.{part}.{leaf}", (rows, *shape[1:])) for part, rows in fused[name]]


def _hf_name(key: str) -> str:
    return key if key.startswith("lm_head.") else f"model.{key}"


