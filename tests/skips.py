"""Every reason a test may skip, in one place, and whether the machine's kind explains it.

A test that needs something says so with one of these (`@CUDA.mark`, or `CHROMIUM.need()` inside
the test); where the machine lacks it, the test skips. Under CI ($CI set; .ci/run sets it) a
skip must be one the machine's kind explains: no CUDA on a CPU machine, a CPU whose bf16
matmuls differ by row count. Any other skip (a tool CI installs that is missing, CPU kernels
that failed to build on a CPU that has their instructions, a bare pytest.skip) fails the test
there (conftest.py's pytest_runtest_makereport), so that a group of tests never goes quiet
unseen.
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

from agentflash.engine.cpu.packed import packing_available
from agentflash.kernels import cpu_ops

CHROMIUM_BINARY = "/usr/bin/chromium"  # tools/check_report.py's
VLLM_ENV = Path(os.environ.get("AGENTFLASH_VLLM_ENV",
                               Path.home() / ".cache" / "agentflash-peers" / "vllm-env"))


@dataclass(frozen=True)
class Need:
    """Something a test needs: `met()` whether this machine has it; `excused()` whether its
    absence is a property of the machine's kind (a skip CI allows)."""

    reason: str
    met: Callable[[], bool]
    excused: Callable[[], bool]

    @property
    def mark(self) -> pytest.MarkDecorator:
        return pytest.mark.skipif(not self.met(), reason=self.reason)

    def need(self) -> None:
        """Skip the calling test where the machine lacks it."""
        if not self.met():
            pytest.skip(self.reason)


def _x86() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


def _kernels_cannot_run() -> bool:
    """The CPU kernels do not run here by the machine's nature or the user's choice: no AVX2
    with FMA, no C++ compiler, or $AGENTFLASH_CPU_KERNELS=0."""
    return (cpu_ops.isa() is None or shutil.which("c++") is None or not cpu_ops.enabled())


@functools.cache
def bf16_gemm_rows_are_independent() -> bool:
    """Whether this CPU's bfloat16 matmul gives rows the same bits in a call of any row count
    up to 16 as in a call of 16, on the embedded model's layer shapes (oneDNN's kernels do with
    native bf16 and held to AVX2; held to AVX512 without BF16, a few elements differ)."""
    g = torch.Generator().manual_seed(0)
    for fan_in, fan_out in ((384, 640), (384, 2048), (1024, 384)):
        w = torch.randn(fan_out, fan_in, generator=g).to(torch.bfloat16)
        x = torch.randn(16, fan_in, generator=g).to(torch.bfloat16)
        block = torch.nn.functional.linear(x, w)
        if not all(torch.equal(torch.nn.functional.linear(x[:m], w), block[:m])
                   for m in range(1, 16)):
            return False
    return True


def _always() -> bool:
    return True


def _never() -> bool:
    return False


CUDA = Need("needs CUDA", torch.cuda.is_available, _always)

CPU_KERNELS = Need("needs agentflash's CPU kernels (kernels.cpu_ops)", cpu_ops.available,
                   _kernels_cannot_run)

X86_COMPILER = Need("needs an x86 CPU and a C++ compiler",
                    lambda: _x86() and shutil.which("c++") is not None, lambda: not _x86())

ONEDNN_BF16 = Need("needs native oneDNN bf16 matmuls (this torch build or CPU has none)",
                   packing_available, _always)

ROW_INVARIANT_ONEDNN_BF16 = Need(
    "needs oneDNN bf16 matmuls whose rows do not depend on the call's row count (AVX512 "
    "without BF16 has not)", bf16_gemm_rows_are_independent, _always)

EMULATED_BF16_WITH_KERNELS = Need(
    "needs a CPU whose bf16 matmuls torch emulates, with the CPU kernels (which then run every "
    "linear)", lambda: not packing_available() and cpu_ops.available(),
    lambda: packing_available() or _kernels_cannot_run())

ROW_INVARIANT_BF16 = Need(
    "needs a bf16 decode path whose rows do not depend on the forward's shape (the CPU kernels, "
    "or oneDNN with row-invariant bf16 matmuls)",
    lambda: cpu_ops.available() or bf16_gemm_rows_are_independent(), _kernels_cannot_run)

PREFILL_THROUGH_KERNELS = Need(
    "needs the compiled forward on the CPU kernels to take prefill chunks (the amx, "
    "avx512-bf16 and avx2 builds: DecodeForward.takes_prefill)",
    lambda: cpu_ops.fast_many_rows(compiled=True),
    lambda: _kernels_cannot_run()
    or getattr(cpu_ops.isa(), "name", None) not in cpu_ops.COMPILED_MANY_ROWS_ISAS)

CHROMIUM = Need(f"needs {CHROMIUM_BINARY} (tools/setup.sh installs it, as root)",
                lambda: shutil.which(CHROMIUM_BINARY) is not None, _never)

VLLM = Need(f"needs vLLM's side environment at {VLLM_ENV} (bash tools/setup_vllm.sh)",
            lambda: (VLLM_ENV / ".ready").exists(), _never)

LINEAR_CUDA = Need("needs CUDA and the linear-cuda extra (flash-linear-attention, "
                   "causal-conv1d)", lambda: _linear_cuda(), lambda: not torch.cuda.is_available())


def _linear_cuda() -> bool:
    if not torch.cuda.is_available():
        return False
    from agentflash.kernels import linear_attention

    cuda = torch.device("cuda")
    return linear_attention.fla_available(cuda) and linear_attention.conv_available(cuda)


def other_cpu_builds() -> list[tuple[str, bool]]:
    """(instruction set, with this CPU's extras) of the CPU kernels' builds this CPU runs
    besides the one chosen for it: the sets below the best it has, and the chosen set without
    the extras it adds (AVX512-VNNI)."""
    chosen = cpu_ops.isa()
    if chosen is None:
        return []
    builds = [(name, True) for name in cpu_ops.isas_here() if name != chosen.name]
    if cpu_ops.build_flags(chosen) != chosen.flags:
        builds.append((chosen.name, False))
    return builds


OTHER_CPU_BUILDS = Need("this CPU runs only the build of the CPU kernels chosen for it",
                        lambda: bool(other_cpu_builds()), _always)


NEEDS = (CUDA, CPU_KERNELS, X86_COMPILER, ONEDNN_BF16, ROW_INVARIANT_ONEDNN_BF16,
         EMULATED_BF16_WITH_KERNELS, ROW_INVARIANT_BF16, PREFILL_THROUGH_KERNELS, CHROMIUM, VLLM,
         LINEAR_CUDA, OTHER_CPU_BUILDS)


def excused(reason: str) -> bool:
    """Whether a skip for `reason` is one this machine's kind explains (CI allows it)."""
    return any(need.reason == reason and need.excused() for need in NEEDS)
