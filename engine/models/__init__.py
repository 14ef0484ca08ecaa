"""Target models in plain torch (Qwen3 and Llama families), the DFlash drafter, and their loaders."""

from __future__ import annotations

from .dflash import DFlashConfig, DFlashDraftModel, load_drafter
from .loader import load_model, read_safetensors_dir
from .qwen3 import CausalLM, ModelOutput

__all__ = [
    "CausalLM", "DFlashConfig", "DFlashDraftModel", "ModelOutput", "load_drafter", "load_model",
    "read_safetensors_dir",
]
