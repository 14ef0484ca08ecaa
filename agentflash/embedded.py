"""The default model shipped inside the package; how a model argument becomes a directory.

The embedded checkpoint is a standard Hugging Face directory (config.json, model.safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json) at
`agentflash/checkpoints/agentflash-11m/`, installed as package data. Like any model directory it
may carry its DFlash drafter in the subdirectory `drafter/` (config.json + model.safetensors);
"the model's drafter" is that subdirectory when it exists (`model_drafter_dir`).
"""

from __future__ import annotations

from pathlib import Path

from agentflash.engine.errors import CheckpointError
from agentflash.engine.models.dflash import bundled_drafter_dir

__all__ = [
    "CHECKPOINTS_DIR", "EMBEDDED_MODEL", "embedded_model_dir", "model_drafter_dir",
    "resolve_model",
]

EMBEDDED_MODEL = "agentflash-11m"
CHECKPOINTS_DIR = Path(__file__).resolve().parent / "checkpoints"
"""Where the package's checkpoints live (one subdirectory per model)."""

model_drafter_dir = bundled_drafter_dir
"""`model_drafter_dir(model_dir) -> Path | None`: the `drafter/` subdirectory of a model
directory when it holds a config.json, else None (the engine's `bundled_drafter_dir`)."""


def embedded_model_dir() -> Path:
    """The directory of the embedded default model. Raises CheckpointError when it (or its
    config.json) is missing, e.g. in a broken install or a checkout without the weights."""
    path = CHECKPOINTS_DIR / EMBEDDED_MODEL
    if not (path / "config.json").is_file():
        what = "directory" if not path.is_dir() else "config.json"
        raise CheckpointError(
            f"the embedded model {EMBEDDED_MODEL!r} is not installed ({what} missing under "
            f"{path}); reinstall agentflash or pass a model directory explicitly"
        )
    return path


def resolve_model(model: str | Path | None) -> Path:
    """The directory to load for a model argument: None means the embedded default model;
    anything else is taken as a path (its contents are checked when it is loaded)."""
    return embedded_model_dir() if model is None else Path(model)
