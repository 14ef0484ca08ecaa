"""Target models in plain torch (Qwen3 and Llama families, the hybrid Qwen3.5), the DFlash drafter,
and their loaders."""

from __future__ import annotations

from .checkpoint import read_safetensors_dir
from .dflash import DFlashConfig, DFlashDraftModel, load_drafter
from .loader import load_model
from .qwen3 import CausalLM, ModelOutput
from .qwen3_5 import HybridCausalLM

__all__ = [
    "CausalLM", "DFlashConfig", "DFlashDraftModel", "HybridCausalLM", "ModelOutput",
    "load_drafter", "load_model", "read_safetensors_dir",
]
