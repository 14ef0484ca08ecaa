"""Every Triton kernel compiled ahead of time for real GPUs, on any machine (no GPU needed).

    python -m agentflash.kernels.aot --arch 80,90,100 [--json]

Each kernel the engine dispatches on CUDA is launched through its own Python wrapper (the code the
engine calls) on meta tensors laid out as the engine lays them out, for the attention shapes of
`MODELS` (Qwen3-8B and Qwen3-0.6B with the DFlash drafter of block 16) in bfloat16 and float32;
the launch is recorded instead of run, specialized by Triton's own binder (pointer dtypes and
alignment, integer divisibility, constexprs) and compiled by `triton.compile` for each
architecture, to cubin. One line per (kernel, specialization, architecture): ok, registers per
thread, spilled bytes, shared memory, checked against the architecture's limits; the exit status
is 1 when any compile fails or exceeds a limit. A jitted helper (`@triton.jit` without a launch
of its own) is listed with the kernels that inline it, ok where they all compiled.

The page size never reaches a kernel as a constant (keys are addressed through slot lists), so
it adds no specialization. Needs triton's JIT internals of 3.x (`create_function_from_signature`,
`JITFunction._pack_args`) and must run without TRITON_INTERPRET=1 (the interpreter replaces the
jitted functions).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import Callable, Iterator

import torch

ARCHS = (80, 90, 100)
# Per-block shared memory a kernel may opt into (CUDA programming guide, compute capabilities).
MAX_SHARED = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024,
              120: 99 * 1024}
MAX_REGS_PER_THREAD = 255
REGS_PER_SM = 64 * 1024
MODULES = ("triton_attention", "triton_accept", "triton_context_kv")


@dataclass(frozen=True)
class Shape:
    """The attention geometry of a target and its drafter, what the kernels are specialized on."""

    name: str
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    block_size: int = 16     # the drafter's block: verify queries, draft queries per sequence
    top_k: int = 8           # a DFlash2 selector's candidates (draft distribution q)


MODELS = (
    Shape("Qwen3-8B", heads=32, kv_heads=8, head_dim=128, vocab=151936),
    Shape("Qwen3-0.6B", heads=16, kv_heads=8, head_dim=128, vocab=151936),
)
DTYPES = (torch.bfloat16, torch.float32)


@dataclass
class Launch:
    """One recorded kernel launch: what the wrapper passed, with the case that made it."""

    kernel: object           # triton JITFunction
    args: tuple
    kwargs: dict
    case: str
    model: str = ""


@dataclass
class Line:
    kernel: str
    case: str
    arch: int
    ok: bool
    registers: int | None = None
    spill_bytes: int | None = None
    shared_bytes: int | None = None
    num_warps: int | None = None
    error: str = ""
    models: list[str] = field(default_factory=list)
    inlines: list[str] = field(default_factory=list)   # jitted helpers compiled into it

    def text(self) -> str:
        head = f"sm_{self.arch:<4} {self.kernel:<26} {self.case:<44}"
        if not self.ok:
            return f"{head} FAIL {self.error}"
        if self.registers is None:  # a helper
            return f"{head} ok   (inlined into {', '.join(self.inlines)})"
        return (f"{head} ok   regs {self.registers:>3}  spills {self.spill_bytes:>4} B  "
                f"shared {self.shared_bytes:>6} B  warps {self.num_warps}")


def _modules() -> list[ModuleType]:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("agentflash.kernels.aot compiles for GPUs: run it without "
                           "TRITON_INTERPRET=1 (the interpreter replaces the jitted kernels)")
    import importlib

    return [importlib.import_module(f"{__package__}.{m}") for m in MODULES]


def jitted(modules: list[ModuleType]) -> dict[str, object]:
    """Every `@triton.jit` function the modules define, by name."""
    from triton.runtime.jit import JITFunction

    return {name: v for m in modules for name, v in vars(m).items()
            if isinstance(v, JITFunction) and v.fn.__module__ == m.__name__}


@contextlib.contextmanager
def recording(kernels: list[object], then: Callable[[Launch], None]) -> Iterator[None]:
    """Launches of `kernels` call `then(Launch)` instead of running (their wrappers still run)."""
    def recorder(fn):
        def run(*args, grid, warmup, **kwargs):
            then(Launch(fn, args, kwargs, case=""))
        return run

    for fn in kernels:
        fn.run = recorder(fn)
    try:
        yield
    finally:
        for fn in kernels:
            del fn.run


def _cases(shape: Shape, dtype: torch.dtype) -> Iterator[tuple[str, Callable[[], None]]]:
    """Each wrapper called as the engine calls it (layouts of engine.attention and the models:
    q a head slice of the rotated q/k heads, v a slice of the fused qkv), on meta tensors."""
    from . import triton_accept, triton_attention, triton_context_kv

    meta = {"device": "meta"}
    h, kvh, d = shape.heads, shape.kv_heads, shape.head_dim
    tag = str(dtype).removeprefix("torch.")

    def qkv(tokens: int):
        qk = torch.empty(tokens, h + kvh, d, dtype=dtype, **meta)
        fused = torch.empty(tokens, h + 2 * kvh, d, dtype=dtype, **meta)
        return qk[:, :h], qk[:, h:], fused[:, h + kvh:]

    cache = torch.empty(4096, kvh, d, dtype=dtype, **meta)
    for q_len, what in ((1, "decode"), (shape.block_size, "verify"), (512, "prefill")):
        batch = 8 if q_len < 512 else 1
        keys = 1024

        def paged(q_len=q_len, batch=batch, keys=keys):
            q, _, _ = qkv(batch * q_len)
            triton_attention.paged_attention(
                q, cache, cache, torch.empty(batch, keys, dtype=torch.long, **meta),
                torch.empty(batch, q_len, dtype=torch.long, **meta),
                torch.empty(batch * q_len, dtype=torch.long, **meta) if batch > 1 else None,
                torch.empty(batch, 1, q_len, keys, dtype=torch.bool, **meta), d ** -0.5)
        yield f"{what} q={q_len} {tag}", paged

    n, b = 8, shape.block_size
    for causal, window, what in ((False, None, "full"), (True, 2048, "sliding"),
                                 (False, 2048, "windowed")):
        def draft(causal=causal, window=window):
            q, k, v = qkv(n * b)
            ctx = torch.empty(n, 1024, kvh, d, dtype=dtype, **meta)
            triton_attention.draft_attention(
                q.view(n, b, h, d), ctx, ctx, torch.empty(n, dtype=torch.long, **meta),
                k.view(n, b, kvh, d), v.view(n, b, kvh, d), d ** -0.5, causal, window)
        yield f"draft {what} B={b} {tag}", draft

    def context_kv():
        _, k, v = qkv(256)
        half = torch.empty(40960, d // 2, dtype=torch.float32, **meta)
        triton_context_kv.store_context_kv(
            k, v, torch.empty(d, dtype=dtype, **meta), 1e-6, half, half,
            torch.empty(256, dtype=torch.long, **meta), torch.empty(256, dtype=torch.long, **meta),
            cache, cache)
    yield f"context kv {tag}", context_kv

    if dtype != torch.float32:
        return  # verification reads float32 logits and probabilities whatever the model's dtype
    rows = torch.empty(n * b, shape.vocab, dtype=torch.float32, **meta)
    idx = {"dtype": torch.long, **meta}

    def greedy():
        triton_accept.accept_greedy(rows, torch.empty(n, **idx), torch.empty(n, **idx),
                                    torch.empty(n, b - 1, **idx))
    yield "accept greedy", greedy

    for top in (None, shape.top_k):
        def sample(top=top):
            q = None if top is None else torch.empty(n, b - 1, top, dtype=torch.float32, **meta)
            ids = None if top is None else torch.empty(n, b - 1, top, **idx)
            triton_accept.accept_sample(
                rows, torch.empty(n, **idx), torch.empty(n, **idx), torch.empty(n, b - 1, **idx),
                torch.empty(n, b, dtype=torch.float32, **meta), q, ids)
        yield "accept sample" + ("" if top is None else f" q K={top}"), sample


def launches(shapes: tuple[Shape, ...] = MODELS,
             dtypes: tuple[torch.dtype, ...] = DTYPES) -> list[Launch]:
    """Every kernel launch the engine makes for these shapes and dtypes (recorded, not run)."""
    modules = _modules()
    out: list[Launch] = []
    kernels = list(jitted(modules).values())
    with recording(kernels, out.append):
        for shape in shapes:
            for dtype in dtypes:
                for case, call in _cases(shape, dtype):
                    start = len(out)
                    call()
                    for launch in out[start:]:
                        launch.case, launch.model = case, shape.name
    return out


def _specialize(launch: Launch, backend) -> tuple:
    """Triton's binder over the recorded arguments: (options, signature, constexprs, attrs)."""
    from triton import knobs
    from triton.runtime.jit import create_function_from_signature

    fn = launch.kernel
    kwargs = dict(launch.kwargs)
    kwargs.update(debug=False, instrumentation_mode=knobs.compilation.instrumentation_mode,
                  fpsan_homomorphic_casts=knobs.compilation.fpsan_homomorphic_casts)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    return specialization, fn._pack_args(backend, kwargs, bound, specialization, options)


def code_key(launch: Launch) -> tuple:
    """What shapes the compiled code of a launch: kernel, pointer dtypes and constexprs (not the
    alignment and divisibility of integers, which the binder adds per value)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    specialization, _ = _specialize(launch, make_backend(GPUTarget("cuda", 90, 32)))
    parts = []
    for param, (kind, value) in zip(launch.kernel.params, specialization):
        if kind == "constexpr" and param.is_constexpr:
            parts.append((param.name, value))
        elif kind.startswith("*"):
            parts.append((param.name, kind))
    return (launch.kernel.__name__, tuple(parts))


_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def resources(cubin: bytes) -> tuple[int, int, int]:
    """(registers per thread, local memory bytes per thread, static shared bytes) of a cubin's
    kernel, as cuobjdump (shipped with triton) reads them. Triton kernels use local memory only
    for what ptxas spills."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", path],
                             capture_output=True, text=True, check=True).stdout
    found = _USAGE.search(out)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no resource usage: {out[-300:]!r}")
    regs, stack, shared, local = map(int, found.groups())
    return regs, max(stack, local), shared


def compile_launch(launch: Launch, arch: int) -> Line:
    """`launch` compiled to cubin for sm_`arch`, its resources checked against the limits."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    line = Line(launch.kernel.__name__, launch.case, arch, False)
    target = GPUTarget("cuda", arch, 32)
    try:
        _, (options, signature, constexprs, attrs) = _specialize(launch, make_backend(target))
        compiled = triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs),
                                  target=target, options=options.__dict__)
        line.registers, line.spill_bytes, static = resources(compiled.asm["cubin"])
    except Exception as e:  # a compile error is a result here, reported on its line
        line.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''}"
        return line
    line.shared_bytes = int(compiled.metadata.shared) + static
    line.num_warps = int(compiled.metadata.num_warps)
    threads = 32 * line.num_warps
    problems = []
    if line.registers > MAX_REGS_PER_THREAD or line.registers * threads > REGS_PER_SM:
        problems.append(f"{line.registers} registers x {threads} threads over the limit")
    if line.shared_bytes > MAX_SHARED.get(arch, 48 * 1024):
        problems.append(f"{line.shared_bytes} B shared over {MAX_SHARED.get(arch)} B")
    if line.spill_bytes:
        problems.append(f"{line.spill_bytes} B of registers spilled")
    line.ok = not problems
    line.error = "; ".join(problems)
    return line


def _callees(fn, table: dict[str, object]) -> set[str]:
    """The jitted helpers `fn` calls, transitively (names it reads that are jitted functions)."""
    found: set[str] = set()
    todo = [fn]
    while todo:
        for name in todo.pop().fn.__code__.co_names:
            if name in table and name not in found:
                found.add(name)
                todo.append(table[name])
    return found


def run(archs: tuple[int, ...] = ARCHS, shapes: tuple[Shape, ...] = MODELS) -> list[Line]:
    """Compile every distinct launch for every architecture; then a line per helper."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    table = jitted(_modules())
    backend = make_backend(GPUTarget("cuda", archs[0], 32))
    distinct: dict[tuple, Launch] = {}
    models: dict[tuple, list[str]] = {}
    for launch in launches(shapes):
        spec, _ = _specialize(launch, backend)
        key = (launch.kernel.__name__, repr(spec))
        first = distinct.setdefault(key, launch)
        if launch.case not in first.case.split(", "):
            first.case += f", {launch.case}"
        models.setdefault(key, [])
        if launch.model not in models[key]:
            models[key].append(launch.model)
    lines: list[Line] = []
    for arch in archs:
        for key, launch in distinct.items():
            line = compile_launch(launch, arch)
            line.models = models[key]
            line.inlines = sorted(_callees(launch.kernel, table))
            lines.append(line)
        launched = {launch.kernel.__name__ for launch in distinct.values()}
        for name in sorted(set(table) - launched):
            callers = sorted({ln.kernel for ln in lines if ln.arch == arch and name in ln.inlines})
            ok = bool(callers) and all(ln.ok for ln in lines
                                       if ln.arch == arch and ln.kernel in callers)
            error = "" if ok else ("a kernel inlining it failed" if callers
                                   else "never launched nor inlined")
            lines.append(Line(name, "helper", arch, ok, inlines=callers, error=error))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agentflash.kernels.aot",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default=",".join(map(str, ARCHS)),
                        help="compute capabilities, comma-separated (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args(argv)
    archs = tuple(int(a) for a in args.arch.split(",") if a.strip())
    try:
        lines = run(archs)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in lines:
        print(json.dumps(asdict(line)) if args.json else line.text(), flush=True)
    failed = [ln for ln in lines if not ln.ok]
    if not args.json:
        print(f"{len(lines) - len(failed)} of {len(lines)} ok "
              f"({len({ln.kernel for ln in lines})} kernels, sm_{', sm_'.join(map(str, archs))})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
