"""agentflash's CPU kernels for decode rows and verify blocks (kernels/cpu/, ops in the
`torch.ops.agentflash` namespace), for bfloat16 weights and activations:

- `linear(x, weight, bias, residual)`: y = x W^T + b (+ residual) in bfloat16 for few rows
  (common/linear_op.cpp). At one row it costs a fraction of oneDNN's call, and it reads W in
  its plain layout.
- `linear_panels(x, panels, n, bias, residual)`: the same on W packed ahead by
  `pack_panels(weight)` (bfloat16, the same bytes), any number of rows as a float32 matrix
  product (avx512/linear_panels.cpp): where `prefer_float32()`, what every linear of a model on
  the kernels takes, decode rows and prefill chunks alike.
- `linear_int8(x, qweight, scale, bias)`: the same for int8 weights with a float32 scale per
  output row (half the bytes of bfloat16): int8 turned into bfloat16 in registers (AVX512-BF16)
  or into float32 (AVX2).
- `linear_int8(..., dynamic=True)` (the op `linear_int8_dynamic`): int8 weights times x's rows quantized on the
  fly to 16-bit integers, summed exactly in int32 (AVX512-VNNI's `vpdpwssd`, else
  `vpmaddwd`): 1.3-2.9x the float32 kernel on a drafter's 1-15 rows with
  its weights in cache, about the same speed at 1-2 rows from memory; a drafter's
  numbers only decide what it proposes.
- `paged_attention(q, k_cache, v_cache, page_table, page_size, token_seq, token_keys, scale)`:
  each query over its sequence's keys in the paged pool, read in place through its page table
  (common/attention_op.cpp): no gathered copy of the context, no batched-matmul calls. In
  float32 where that is the faster (`prefer_float32`), else by the set's bfloat16 dot
  products.
- `top1(logits, with_prob)`: each row's argmax and the softmax probability there, for a step's
  float32 logits (common/top1.cpp): a few microseconds where torch's reductions take tens;
  `masked_top1(logits, allowed)`: each row's argmax among the tokens a packed grammar mask
  allows.
- `set_engine_thread(threads)`: the calling thread's kernels split their work over `threads`
  threads by claiming chunks (common/parallel.cpp) instead of OpenMP's fixed shares, and its
  torch ops run on it alone: on a busy machine a forward slows in proportion to the cores taken
  from it instead of waiting out the OS's time slices.
- `run_program(program, inputs)`: one forward of an AOTInductor package loaded as
  `torch.classes.agentflash.Program(path)` (common/program_op.cpp), with the GIL released (torch's
  Python loader keeps it through the forward), so other threads run meanwhile.

Each has one implementation per instruction set (`ISAS`, the first the CPU has is built; its
files are kernels/cpu/<set>/, one op each, compiled with common/'s):
AMX (AVX512-BF16's kernels, with bfloat16 linears and attention by AMX tile dot products: a
16-row verify block for little more than one row), AVX512-BF16 (`vdpbf16ps` on bfloat16 pairs), AVX512 without bf16 and AVX2 + FMA (bfloat16
widened to float32 in registers, 16 or 8 lanes: CPUs without native bf16, where torch's bf16
matmul is emulated and slow). All
compute every output row the same way whatever else shares the call, so a verify block's rows
are bitwise the decode steps' rows (what greedy speculative decoding needs to equal plain
decoding); the sets' numbers differ from each other in the last bits. The library is built
from source with torch's C++ extension loader the first time a process needs it (~20 s on 2
cores; needs a C++ compiler), cached under $AGENTFLASH_CACHE_DIR (else ~/.cache/agentflash) by
the sources' digest (kernels.disk_cache: a build killed midway is redone, never loaded), and
loaded in milliseconds afterwards. `available()` says whether the ops
run here; where they do not (no AVX2, no compiler, $AGENTFLASH_CPU_KERNELS=0) callers keep the
torch path. $AGENTFLASH_CPU_ISA=avx2 (or avx512) builds that set on a CPU that has a better
one, and $AGENTFLASH_CPU_EXTRAS=0 builds it without the optional instructions this CPU adds to
it (AVX512-VNNI): both to test, where the tests run, the code other CPUs run.
The ops are traceable (fake implementations give their shapes), so `torch.export` keeps each as
one node and AOTInductor calls it from a compiled program (engine.cpu.compiled).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from . import disk_cache

log = logging.getLogger(__name__)

_loaded = False  # load() succeeded in this process

_DIR = Path(__file__).with_name("cpu")  # common/ (every set's), then one folder per set
COMMON = "common"


@dataclass(frozen=True)
class Isa:
    """One instruction set the kernels are written for: its files are kernels/cpu/<name>/, one
    op each (and, with a `base`, the base sets' files it has none of its own for)."""

    name: str
    cpu_flags: tuple[str, ...]   # what /proc/cpuinfo must list
    flags: tuple[str, ...]       # compiler flags (CPU_CAPABILITY picks ATen's vector headers)
    extras: tuple[tuple[str, str], ...] = ()  # (CPU flag, compiler flag): added where it has it
    base: str | None = None      # the set whose files it shares


ISAS = (  # in order of preference
    # AVX512-BF16 with AMX tiles (Sapphire Rapids and later Xeons): bfloat16 linears by tiles
    Isa("amx", ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "fma", "amx_tile",
                "amx_bf16"),
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma",
         "-mamx-tile", "-mamx-bf16", "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"),
        (("avx512_vnni", "-mavx512vnni"),), base="avx512-bf16"),
    Isa("avx512-bf16", ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "fma"),
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma",
         "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"),
        (("avx512_vnni", "-mavx512vnni"),), base="avx512"),
    # AVX512 without native bf16 (Skylake-SP to Ice Lake)
    Isa("avx512", ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"),
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma",
         "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"),
        (("avx512_vnni", "-mavx512vnni"),)),
    Isa("avx2", ("avx2", "fma"),
        ("-mavx2", "-mfma", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2")),
)


def _lineage(chosen: Isa) -> list[str]:
    """The set's folder, then its base's, its base's base's, ..."""
    names = [chosen.name]
    while (base := next(c for c in ISAS if c.name == names[-1]).base) is not None:
        names.append(base)
    return names


def own_sources(chosen: Isa) -> list[Path]:
    """The set's own implementation files: its folder's, then its bases' (nearest first) that
    it has no file of the same name for."""
    own: list[Path] = []
    for folder in _lineage(chosen):
        names = {path.name for path in own}
        own += [path for path in sorted((_DIR / folder).glob("*.cpp")) if path.name not in names]
    return own


def source_paths(chosen: Isa) -> list[Path]:
    """The files one instruction set's library is compiled from: common/ and its own."""
    return sorted((_DIR / COMMON).glob("*.cpp")) + own_sources(chosen)


def _headers(chosen: Isa) -> list[Path]:
    folders = [COMMON, *_lineage(chosen)]
    return [path for folder in folders for path in sorted((_DIR / folder).glob("*.h"))]


def build_flags(chosen: Isa) -> tuple[str, ...]:
    """The compiler flags of one instruction set's library on this CPU: its own, and those of
    its extras the CPU has (none with $AGENTFLASH_CPU_EXTRAS=0)."""
    if not env_switch("AGENTFLASH_CPU_EXTRAS"):
        return chosen.flags
    flags = _cpu_flags()
    return chosen.flags + tuple(flag for cpu, flag in chosen.extras if cpu in flags)


def env_switch(name: str) -> bool:
    """An on/off environment variable of agentflash's, on unless set to 0, false, no or off."""
    return os.environ.get(name, "1").lower() not in ("0", "false", "no", "off")


def _cpuinfo(field: str) -> str:
    """The first value of `field` in /proc/cpuinfo ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == field:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cpu_flags() -> frozenset[str]:
    return frozenset(_cpuinfo("flags").split())


def isas_here() -> list[str]:
    """The names of `ISAS` this CPU has, in order of preference."""
    flags = _cpu_flags()
    return [candidate.name for candidate in ISAS if set(candidate.cpu_flags) <= flags]


@functools.cache
def isa() -> Isa | None:
    """The instruction set the kernels are built for here: the first of `ISAS` the CPU has
    ($AGENTFLASH_CPU_ISA names one to take instead, if the CPU has it), or None."""
    wanted = os.environ.get("AGENTFLASH_CPU_ISA")
    here = isas_here()
    for candidate in ISAS:
        if (wanted is None or candidate.name == wanted) and candidate.name in here:
            return candidate
    return None


@functools.cache
def source_digest() -> str:
    """The library's identity: its instruction set, sources and build flags (part of compiled
    programs' keys)."""
    chosen = isa()
    h = hashlib.blake2b(repr((chosen, chosen and build_flags(chosen))).encode(), digest_size=8)
    for path in (source_paths(chosen) + _headers(chosen) if chosen
                 else sorted((_DIR / COMMON).iterdir())):
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()


def enabled() -> bool:
    """$AGENTFLASH_CPU_KERNELS=0 keeps the torch path everywhere (for comparisons)."""
    return env_switch("AGENTFLASH_CPU_KERNELS")


@functools.cache
def load() -> str | None:
    """Build (the first time on a machine) and load the library. None when the ops are
    ready, else why they are not."""
    if not enabled():
        return "turned off by AGENTFLASH_CPU_KERNELS=0"
    chosen = isa()
    if chosen is None:
        wanted = os.environ.get("AGENTFLASH_CPU_ISA")
        return (f"this CPU lacks {wanted} (AGENTFLASH_CPU_ISA)" if wanted
                else "this CPU has neither AVX512-BF16 nor AVX2 with FMA")
    try:
        from torch.utils import cpp_extension

        if shutil.which("ninja") is None:  # the pip package's binary, when not on PATH
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        name = f"agentflash_cpu_{chosen.name.replace('-', '_')}_{source_digest()}"
        build = disk_cache.root() / "kernels" / name
        library = build / f"{name}.so"
        complete = build / "complete"  # written once the library built and loaded
        with disk_cache.locked(build.with_name(f"{name}.lock"),
                               f"building agentflash's CPU kernels in {build}"):
            if complete.exists():
                torch.ops.load_library(str(library))
            else:
                # what a killed build left (torch's own lock file among it) goes
                shutil.rmtree(build, ignore_errors=True)
                build.mkdir(parents=True)
                log.warning("building agentflash's CPU kernels for %s (once per machine, about "
                            "30 s on 2 cores) in %s", chosen.name, build)
                cpp_extension.load(name=name, sources=[str(p) for p in source_paths(chosen)],
                                   extra_cflags=["-O3", "-fopenmp", *build_flags(chosen)],
                                   extra_include_paths=[str(_DIR)], extra_ldflags=["-fopenmp"],
                                   build_directory=str(build), is_python_module=False)
                complete.touch()
        # its symbols global: compiled programs call the ops' C shims (common/shims.cpp) by name
        ctypes.CDLL(str(library), mode=os.RTLD_NOW | os.RTLD_GLOBAL | os.RTLD_NOLOAD)
    except Exception as error:  # no compiler, no ninja, a failed build
        return f"{type(error).__name__}: {(str(error).strip() or '?').splitlines()[-1][:300]}"
    _register_fakes()
    torch.ops.agentflash.set_float32_attention(_prefers_float32())
    global _loaded
    _loaded = True
    return None


@functools.cache
def available() -> bool:
    """Whether the ops run here (the reason they do not is logged once). Call it before
    exporting or loading a program that uses them."""
    why = load()
    if why is not None:
        log.info("agentflash's CPU kernels are not used: %s", why)
    return why is None


MANY_ROWS_ISAS = ("amx", "avx512-bf16")  # the sets `fast_many_rows` holds for, eager or not
COMPILED_MANY_ROWS_ISAS = (*MANY_ROWS_ISAS, "avx2")  # and those it holds for compiled forwards


@functools.cache
def fast_many_rows(compiled: bool = False) -> bool:
    """Whether a forward on these kernels (compiled ahead of time, or eager) takes a prefill
    chunk's hundreds of rows faster than the eager model on oneDNN. Eager or compiled: the sets
    with native bfloat16 dot products (amx's tiles, or avx512-bf16's `vdpbf16ps`: on 2 cores
    their linears reach 90% of oneDNN's matmul rate or more at 64-512 rows of
    agentflash-11m's). Compiled only: avx2, whose kernels widen bfloat16 to float32 and reach
    80-88% of oneDNN's float32 matmul at 512 rows (120-122 against 139-150 GFLOP/s on a 2-core
    EPYC), where the program makes up the rest: its fused elementwise code, the GIL released
    for the whole forward, a step's decode rows in the same forward (docs/performance.md).
    AVX512's kernels (without bf16) are not measured at many rows: there prefill chunks run on
    oneDNN. Where `prefer_float32()`, a forward's linears take `linear_panels`' float32
    product, not the dot products."""
    chosen = isa()
    names = COMPILED_MANY_ROWS_ISAS if compiled else MANY_ROWS_ISAS
    return available() and chosen is not None and chosen.name in names


def _prefers_float32() -> bool:
    """`prefer_float32()` before the library is loaded (what `load` tells it)."""
    chosen = isa()
    return chosen is not None and (chosen.name == "avx512" or (
        chosen.name == "avx512-bf16" and _cpuinfo("vendor_id") == "GenuineIntel"))


def prefer_float32() -> bool:
    """Whether the kernels here take float32 products: every `KernelLinear` through
    `linear_panels` (decode rows, verify blocks, and prefill chunks where the kernels' forward
    takes them: `fast_many_rows`), and attention in float32 (avx512/attention_float32.cpp; set
    once as the library loads). With AVX512 without bf16 (float32 is all it has), and on Intel
    CPUs with AVX512-BF16 and no AMX, where float32 multiply-adds outrun `vdpbf16ps` (half their
    rate on a 2-core Xeon): there the panels take 0.6-0.9x the `vdpbf16ps` tiles' time for the
    11m step's linears at 8-32 rows (about the same at 1-4), reach 225-266 GFLOP/s at 512 rows
    (the tiles 121-144), and attention in float32 takes 0.65-0.85x the `vdpbf16ps` kernel's time
    from 1 to 200 queries after 300-1,500 keys (docs/performance.md). Not on AMD's (a 2-core
    EPYC's `vdpbf16ps` tiles: ~370 GFLOP/s at 512 rows, above oneDNN's float32 there), nor with
    AMX (its tiles) or AVX2 (no panels; its attention widens to float32 anyway)."""
    return available() and _prefers_float32()


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """bfloat16 weight [N, K] in `linear_panels`' layout: [ceil(N / 48), ceil(K / 2), 48, 2],
    panel p's [k // 2, c, k % 2] = weight[48 p + c, k], zeros past N and K (the same bytes as
    the weight, give or take the padding)."""
    n, k = weight.shape
    padded = torch.zeros((n + 47) // 48 * 48, (k + 1) // 2 * 2, dtype=torch.bfloat16)
    padded[:n, :k] = weight
    return padded.view(-1, 48, padded.shape[1] // 2, 2).permute(0, 2, 1, 3).contiguous()


def tile_linears() -> bool:
    """Whether the kernels' bfloat16 linears run on AMX tiles here: faster than the int8
    kernel (`linear_int8`, dynamic) at every row count measured (agentflash-11m's drafter
    shapes, 8 to 512 rows: 0.2-0.6x its time; docs/performance.md), where with the other sets
    the int8 kernel reads half the bytes and wins."""
    chosen = isa()
    return available() and chosen is not None and chosen.name == "amx"


def set_engine_thread(threads: int) -> None:
    """Make the calling thread an engine thread: the kernels it calls split their work over
    `threads` threads (it and `threads - 1` workers of the kernels' own pool, which claim chunks
    of a call one at a time, so the call never waits for a thread the OS has not run) and its
    other torch ops run on it alone (OpenMP's thread count for this thread is 1), where every
    forward runs through the kernels. threads <= 0 undoes it. Needs `available()`."""
    torch.ops.agentflash.set_engine_thread(threads)


def loaded() -> bool:
    """Whether the ops are loaded in this process already (never builds them: for callers that
    are faster with them but must not pay a first build, `available()`, for them)."""
    return _loaded


def aoti_shims() -> dict[torch._ops.OpOverload, list[str]]:
    """The ops' C shims (common/shims.cpp) as AOTInductor's `aot_inductor.custom_ops_to_c_shims`
    declares them: a compiled program calls these functions directly, not through its proxy
    executor. Empty unless the library is loaded here."""
    if not _loaded:
        return {}
    ops = torch.ops.agentflash
    h, opt = "AtenTensorHandle", "AtenTensorHandle*"
    return {
        ops.linear_bf16.default: [
            f"AOTITorchError aoti_torch_cpu_linear_bf16({h} x, {h} weight, {opt} bias, "
            f"{opt} residual, {opt} ret0)"],
        ops.linear_panels.default: [
            f"AOTITorchError aoti_torch_cpu_linear_panels({h} x, {h} panels, int64_t n, "
            f"{opt} bias, {opt} residual, {opt} ret0)"],
        ops.linear_int8.default: [
            f"AOTITorchError aoti_torch_cpu_linear_int8({h} x, {h} qweight, {h} scale, "
            f"{opt} bias, {opt} residual, {opt} ret0)"],
        ops.linear_int8_dynamic.default: [
            f"AOTITorchError aoti_torch_cpu_linear_int8_dynamic({h} x, {h} qweight, {h} scale, "
            f"{opt} bias, {opt} residual, {opt} ret0)"],
        ops.paged_attention_bf16.default: [
            f"AOTITorchError aoti_torch_cpu_paged_attention_bf16({h} q, {h} k_cache, "
            f"{h} v_cache, {h} page_table, int64_t page_size, {h} token_seq, {h} token_keys, "
            f"double scale, {opt} k_new, {opt} v_new, {opt} cached, {opt} ret0)"],
    }


def attends(head_dim: int) -> bool:
    """Whether `paged_attention` takes heads of this size (a multiple of 32 up to 256)."""
    return head_dim % 32 == 0 and 0 < head_dim <= 256


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) (+ residual [..., N], added before the one
    rounding to bfloat16), bfloat16."""
    if x.dim() == 2:
        return torch.ops.agentflash.linear_bf16(x, weight, bias, residual)
    flat = None if residual is None else residual.reshape(-1, weight.shape[0])
    out = torch.ops.agentflash.linear_bf16(x.reshape(-1, x.shape[-1]), weight, bias, flat)
    return out.view(*x.shape[:-1], weight.shape[0])


def linear_panels(x: torch.Tensor, panels: torch.Tensor, n: int,
                  bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` on a weight of n rows packed by `pack_panels`: each output one float32 FMA
    chain over K in order (x and W widened exactly), plus the bias and the residual, rounded
    once to bfloat16, whatever the row count. Only where `prefer_float32()`."""
    if x.dim() == 2:
        return torch.ops.agentflash.linear_panels(x, panels, n, bias, residual)
    flat = None if residual is None else residual.reshape(-1, n)
    out = torch.ops.agentflash.linear_panels(x.reshape(-1, x.shape[-1]), panels, n, bias, flat)
    return out.view(*x.shape[:-1], n)


def linear_int8(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None, dynamic: bool = False) -> torch.Tensor:
    """x [..., K] @ (qweight [N, K] int8 * scale [N, 1] float32)^T (+ bias [N]), bfloat16: the
    products summed in float32, scaled per output, rounded once. dynamic (the op
    `linear_int8_dynamic`): each row of x first quantized to 16-bit integers (round(x * Q /
    max |x|), Q up to 32767 as K allows) and the products summed exactly in int32: close to
    the float32 numbers, not equal (for a drafter, whose numbers only choose its proposals).
    Either way each row's output depends on that row alone."""
    op = torch.ops.agentflash.linear_int8_dynamic if dynamic else torch.ops.agentflash.linear_int8
    flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    out = op(flat, qweight, scale, bias)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], qweight.shape[0])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    page_table: torch.Tensor, page_size: int, token_seq: torch.Tensor,
                    token_keys: torch.Tensor, scale: float, k_new: torch.Tensor | None = None,
                    v_new: torch.Tensor | None = None,
                    cached: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of queries q [T, Hq, D] over caches [S, Hkv, D]: query t sees the first
    token_keys[t] keys of sequence token_seq[t], key j in page page_table[seq, j // page_size]
    ([B, P]) at offset j % page_size. With k_new, v_new [B * R, Hkv, D] and cached [B]: keys
    from cached[b] on of sequence b are its R rows b * R .. b * R + R - 1 of k_new / v_new
    instead, in order (a drafter block's own K/V; its queries may be any of the block's rows).
    Returns [T, Hq, D]
    (bfloat16; head_dim a multiple of 32 up to 256)."""
    return torch.ops.agentflash.paged_attention_bf16(q, k_cache, v_cache, page_table, page_size,
                                                     token_seq, token_keys, scale, k_new, v_new,
                                                     cached)


def top1(logits: torch.Tensor, with_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax [R] (int64; the first of equal maxima, or the first NaN, as
    torch.argmax) of float32 logits [R, V] and, with_prob, the softmax probability there [R]
    (float32; else empty)."""
    return torch.ops.agentflash.top1(logits, with_prob)


def masked_top1(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Each row's argmax [R] (int64) of float32 logits [R, V] among the tokens its packed mask
    in allowed [R, W] (int32, token i at bit i % 32 of word i // 32) allows, as torch.argmax
    over the row with -inf added elsewhere; -1 where the mask allows nothing."""
    return torch.ops.agentflash.masked_top1(logits, allowed)


def _register_fakes() -> None:
    @torch.library.register_fake("agentflash::linear_bf16")
    def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        return x.new_empty(x.shape[0], weight.shape[0])

    @torch.library.register_fake("agentflash::linear_panels")
    def _linear_panels(x: torch.Tensor, panels: torch.Tensor, n: int,
                       bias: torch.Tensor | None = None,
                       residual: torch.Tensor | None = None) -> torch.Tensor:
        return x.new_empty(x.shape[0], n)

    def _linear_int8(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None = None,
                     residual: torch.Tensor | None = None) -> torch.Tensor:
        return x.new_empty(x.shape[0], qweight.shape[0])

    for op in ("agentflash::linear_int8", "agentflash::linear_int8_dynamic"):
        torch.library.register_fake(op)(_linear_int8)

    @torch.library.register_fake("agentflash::paged_attention_bf16")
    def _attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   page_table: torch.Tensor, page_size: int, token_seq: torch.Tensor,
                   token_keys: torch.Tensor, scale: float, k_new: torch.Tensor | None = None,
                   v_new: torch.Tensor | None = None,
                   cached: torch.Tensor | None = None) -> torch.Tensor:
        return torch.empty_like(q)
