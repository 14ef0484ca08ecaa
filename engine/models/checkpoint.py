"""Reading a Hugging Face checkpoint directory's tensors: `model.safetensors` or the shards of
`model.safetensors.index.json` (its `weight_map`: tensor name -> shard file), lazily, and
assembling a model's state dict from them with every name and shape checked (`assemble_state`).
Shared by the model loaders (engine.models.loader, qwen3_5, dflash); every failure is a
`CheckpointError` that names the file or tensor at fault.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import AbstractSet, Any, Iterator, Mapping

import torch
from safetensors import SafetensorError, safe_open

from ..errors import CheckpointError

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
# Buffers some exporters saved alongside the weights; they carry nothing we load.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_dtype(dtype: torch.dtype | None, stored: str = "float32") -> torch.dtype:
    """The dtype to load in: `dtype`, or (None) the checkpoint's `stored` one (float32 if it
    names none we support); ValueError for a dtype we do not load."""
    if dtype is None:
        dtype = DTYPES.get(stored, torch.float32)
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype {dtype} is not supported (supported: {sorted(DTYPES)})")
    return dtype


class SafetensorsDir(Mapping[str, torch.Tensor]):
    """Lazy name -> tensor view of a directory's safetensors weights (read from disk on access)."""

    def __init__(self, path: str | Path) -> None:
        root = Path(path)
        if not root.is_dir():
            raise CheckpointError(f"model directory {root} does not exist")
        if (root / WEIGHTS).is_file():
            handle = _open(root / WEIGHTS)
            self._handles = {WEIGHTS: handle}
            self._where = {name: WEIGHTS for name in handle.keys()}
        elif (root / INDEX).is_file():
            self._where = _read_weight_map(root / INDEX)
            self._handles = {}
            for shard in sorted(set(self._where.values())):
                if not (root / shard).is_file():
                    raise CheckpointError(
                        f"{root / INDEX} references shard {shard!r}, which is missing"
                    )
                self._handles[shard] = _open(root / shard)
            stored = {shard: set(handle.keys()) for shard, handle in self._handles.items()}
            for name, shard in self._where.items():
                if name not in stored[shard]:
                    raise CheckpointError(
                        f"{root / INDEX} maps {name!r} to {shard}, which lacks it"
                    )
        else:
            raise CheckpointError(f"{root} holds no weights: expected {WEIGHTS} or {INDEX}")

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._handles[self._where[name]].get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def read_safetensors_dir(path: str | Path) -> Mapping[str, torch.Tensor]:
    """All tensors of a checkpoint directory by name, lazily loaded on CPU in the stored dtype."""
    return SafetensorsDir(path)


def assemble_state(
    sources: Mapping[str, list[tuple[str, tuple[int, ...]]]],
    tensors: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    root: Path,
    model_desc: str,
    skip: AbstractSet[str] = frozenset(),
    why: Mapping[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """State dict whose `key` is the dim-0 concatenation of the stored tensors `sources[key]`
    (name, expected shape), cast and moved. Every expected tensor must be stored with its shape
    and every stored one (except `skip` and ignored buffers) expected, or CheckpointError;
    `why[name]` explains a tensor's expected shape in that error."""
    expected = {name for parts in sources.values() for name, _ in parts}
    present = {name for name in tensors if not name.endswith(IGNORED_SUFFIXES)} - skip
    if missing := expected - present:
        raise CheckpointError(
            f"{root} lacks {len(missing)} tensor(s) the config requires: {_few(missing)}"
        )
    if unexpected := present - expected:
        raise CheckpointError(
            f"{root} has {len(unexpected)} tensor(s) {model_desc} does not use: "
            f"{_few(unexpected)}"
        )
    state: dict[str, torch.Tensor] = {}
    for key, parts in sources.items():
        loaded = []
        for name, shape in parts:
            tensor = tensors[name]
            if tuple(tensor.shape) != shape:
                reason = f" ({why[name]})" if why and name in why else ""
                raise CheckpointError(
                    f"{root}: tensor {name!r} has shape {tuple(tensor.shape)} but config.json "
                    f"implies {shape}{reason}"
                )
            loaded.append(tensor.to(device=device, dtype=dtype))
        state[key] = loaded[0] if len(loaded) == 1 else torch.cat(loaded)
    return state


def _open(file: Path) -> Any:
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(
            f"cannot read {file} (corrupt or truncated safetensors?): {e}"
        ) from None


def _read_weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"cannot read weight_map from {index}: {e!r}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names")
    return weight_map


def _few(names: set[str], limit: int = 8) -> str:
    shown = sorted(names)[:limit]
    return ", ".join(shown) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
