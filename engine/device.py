"""Device and default dtype resolution.

On CUDA the default compute dtype is bfloat16. On CPU it is bfloat16 only where the processor
has native bf16 matrix instructions (AMX or AVX512-BF16); elsewhere bf16 matmuls are emulated
and float32 is faster (measured: tools/bench_dtype.py).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
    "float64": torch.float64, "fp64": torch.float64,
}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return dev


@functools.cache
def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        if device.type == "cuda" or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(DTYPES)}") from None


def training_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """The target's dtype in the drafter tools (training, regeneration): `dtype` if given, else
    bfloat16 on CUDA and float32 on CPU, whatever its bf16 support, so that the regenerated
    replies and the target's hidden states are the same on every CPU."""
    return resolve_dtype(dtype or ("bfloat16" if device.type == "cuda" else "float32"), device)
