"""agentflash's CPU kernels for decode rows and verify blocks, on CPUs with AVX512-BF16
(kernels/cpu/*.cpp, ops in the `torch.ops.agentflash` namespace):

- `linear(x, weight, bias, residual)`: y = x W^T + b (+ residual) in bfloat16 for few rows
  (linear_bf16.cpp). At one row it costs a fraction of oneDNN's call, and it reads W in its
  plain layout.
- `paged_attention(q, k_cache, v_cache, page_table, page_size, token_seq, token_keys, scale)`:
  each query over its sequence's keys in the paged pool, read in place through its page table
  (attention_bf16.cpp): no gathered copy of the context, no batched-matmul calls.

Both compute every output row the same way whatever else shares the call, so a verify block's
rows are bitwise the decode steps' rows (what greedy speculative decoding needs to equal plain
decoding). The library is built from source with torch's C++ extension loader the first time a
process needs it (~20 s on 2 cores; needs a C++ compiler), cached under $AGENTFLASH_CACHE_DIR
(else ~/.cache/agentflash) by the sources' digest, and loaded in milliseconds afterwards.
`available()` says whether the ops run here; where they do not (no AVX512-BF16, no compiler,
$AGENTFLASH_CPU_KERNELS=0) callers keep the torch path. The ops are traceable (fake
implementations give their shapes), so `torch.export` keeps each as one node and AOTInductor calls
it from a compiled program (engine.compiled).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_DIR = Path(__file__).with_name("cpu")
SOURCES = (_DIR / "linear_bf16.cpp", _DIR / "attention_bf16.cpp")
HEADERS = (_DIR / "simd.h",)
FLAGS = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
         "-mavx512bf16", "-mfma", "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"]


def cache_root() -> Path:
    """agentflash's on-disk cache: $AGENTFLASH_CACHE_DIR, else the user cache directory."""
    root = os.environ.get("AGENTFLASH_CACHE_DIR")
    if root is None:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                            "agentflash")
    return Path(root)


@functools.cache
def source_digest() -> str:
    """The library's identity: its sources and build flags (part of compiled programs' keys)."""
    h = hashlib.blake2b(repr(FLAGS).encode(), digest_size=8)
    for path in SOURCES + HEADERS:
        h.update(path.read_bytes())
    return h.hexdigest()


def enabled() -> bool:
    """$AGENTFLASH_CPU_KERNELS=0 keeps the torch path everywhere (for comparisons)."""
    return os.environ.get("AGENTFLASH_CPU_KERNELS", "1").lower() not in ("0", "false", "no",
                                                                         "off")


def cpu_has_avx512_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx512_bf16" in line for line in f)
    except OSError:
        return False


@functools.cache
def load() -> str | None:
    """Build (the first time on a machine) and load the library. None when the ops are
    ready, else why they are not."""
    if not enabled():
        return "turned off by AGENTFLASH_CPU_KERNELS=0"
    if not cpu_has_avx512_bf16():
        return "this CPU has no AVX512-BF16"
    try:
        from torch.utils import cpp_extension

        if shutil.which("ninja") is None:  # the pip package's binary, when not on PATH
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        name = f"agentflash_cpu_{source_digest()}"
        build = cache_root() / "kernels" / name
        build.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(name=name, sources=[str(p) for p in SOURCES], extra_cflags=FLAGS,
                           extra_include_paths=[str(_DIR)], extra_ldflags=["-fopenmp"],
                           build_directory=str(build), is_python_module=False)
    except Exception as error:  # no compiler, no ninja, a failed build
        return f"{type(error).__name__}: {(str(error).strip() or '?').splitlines()[-1][:300]}"
    _register_fakes()
    return None


@functools.cache
def available() -> bool:
    """Whether the ops run here (the reason they do not is logged once). Call it before
    exporting or loading a program that uses them."""
    why = load()
    if why is not None:
        log.info("agentflash's AVX512-BF16 CPU kernels are not used: %s", why)
    return why is None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) (+ residual [..., N], added before the one
    rounding to bfloat16), bfloat16."""
    if x.dim() == 2:
        return torch.ops.agentflash.linear_bf16(x, weight, bias, residual)
    flat = None if residual is None else residual.reshape(-1, weight.shape[0])
    out = torch.ops.agentflash.linear_bf16(x.reshape(-1, x.shape[-1]), weight, bias, flat)
    return out.view(*x.shape[:-1], weight.shape[0])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    page_table: torch.Tensor, page_size: int, token_seq: torch.Tensor,
                    token_keys: torch.Tensor, scale: float, k_new: torch.Tensor | None = None,
                    v_new: torch.Tensor | None = None,
                    cached: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of queries q [T, Hq, D] over caches [S, Hkv, D]: query t sees the first
    token_keys[t] keys of sequence token_seq[t], key j in page page_table[seq, j // page_size]
    ([B, P]) at offset j % page_size. With k_new, v_new [T, Hkv, D] and cached [B]: keys from
    cached[seq] on are the rows of the query's run (its consecutive queries of that sequence)
    in k_new / v_new instead, in order (a drafter block's own K/V). Returns [T, Hq, D]
    (bfloat16; head_dim a multiple of 32 up to 256)."""
    return torch.ops.agentflash.paged_attention_bf16(q, k_cache, v_cache, page_table, page_size,
                                                     token_seq, token_keys, scale, k_new, v_new,
                                                     cached)


def _register_fakes() -> None:
    @torch.library.register_fake("agentflash::linear_bf16")
    def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        return x.new_empty(x.shape[0], weight.shape[0])

    @torch.library.register_fake("agentflash::paged_attention_bf16")
    def _attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   page_table: torch.Tensor, page_size: int, token_seq: torch.Tensor,
                   token_keys: torch.Tensor, scale: float, k_new: torch.Tensor | None = None,
                   v_new: torch.Tensor | None = None,
                   cached: torch.Tensor | None = None) -> torch.Tensor:
        return torch.empty_like(q)
