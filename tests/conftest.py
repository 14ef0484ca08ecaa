"""Shared fixtures: tiny random Hugging Face checkpoints written to temporary directories."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


def make_hf_model(family: str = "qwen3", seed: int = 0, **overrides: Any):
    """A randomly initialised transformers model (float32, eval mode) of a tiny config."""
    import transformers

    kwargs = {**TINY, **overrides}
    if family == "qwen3":
        cfg = transformers.Qwen3Config(**kwargs)
        cls = transformers.Qwen3ForCausalLM
    elif family == "llama":
        cfg = transformers.LlamaConfig(**kwargs)
        cls = transformers.LlamaForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    # Random init leaves norms at 1 and makes logits nearly flat; perturb them so tests bite.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def save_hf_model(model, path: Path, **save_kwargs: Any) -> Path:
    model.save_pretrained(path, safe_serialization=True, **save_kwargs)
    return path


@pytest.fixture
def hf_checkpoint(tmp_path):
    """Factory: hf_checkpoint(family, **config_overrides) -> (directory, transformers model)."""

    def make(family: str = "qwen3", seed: int = 0, name: str = "model", **overrides: Any):
        model = make_hf_model(family, seed=seed, **overrides)
        return save_hf_model(model, tmp_path / name), model

    return make
