"""Device and default dtype resolution.

On CUDA the default compute dtype is bfloat16. On CPU it is bfloat16 where the processor has
native bf16 matrix instructions (AMX or AVX512-BF16), or where agentflash's CPU kernels run
(kernels.cpu_ops: AVX2 with FMA; bf16 weights widened in registers: half the bytes a decode step
reads, and the engine's fast path takes every matmul off torch's emulated bf16 path); elsewhere
float32, since torch emulates bf16 matmuls there at a fraction of its float32 speed (measured:
tools/bench_dtype.py, docs/performance.md).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from agentflash.kernels import cpu_ops

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


def cpu_prefers_bf16() -> bool:
    """bfloat16 is the faster compute dtype on this CPU: it has native bf16 instructions, or
    agentflash's CPU kernels run here (built on first call, ~30 s once per machine)."""
    return cpu_has_native_bf16() or cpu_ops.available()


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        if device.type == "cuda" or cpu_prefers_bf16():
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
