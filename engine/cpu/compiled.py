"""The decode/verify forward and the drafter's forward compiled ahead of time (AOTInductor).

At agentflash-11m an eager decode step is mostly Python and dispatch: ~2,000 aten calls around 25
small matmuls (docs/performance.md). `CompiledForward` exports the target's whole forward
(embedding, every layer with its paged attention and K/V store, the final norm; with a drafter,
the drafter's context K/V of the fed positions stored too) once with `torch.export`, over dynamic
token, sequence, query and key-chunk counts, and compiles it with AOTInductor (freezing: weights
prepacked for oneDNN; fused norm / RoPE / SiLU / softmax kernels; a C++ wrapper).
`CompiledDraft` does the same for the DFlash drafter's block forward. Packages are cached on disk
under a key of everything they depend on (weights, configs, block size, torch version, CPU
capability, thread count, this package's model code), so a compile (35 s for the 11m target on
2 cores, 55 s with the drafter's context store, 13 s for its drafter) happens once per machine and
a later engine loads it in milliseconds.

The target program runs forwards whose sequences each bring at most `INVARIANT_MAX_QUERIES` new
tokens (decode rows and verify blocks) and, on the CPU kernels, any number (prefill chunks too,
where the kernels take them: `DecodeForward.takes_prefill`); it returns the outputs of the rows
asked for (a prefill chunk's last). One program serves every such shape, so a row's result does
not depend on how many rows share the forward: a verify block's rows are bitwise the plain
decode steps' rows (tests/test_compiled.py), and greedy speculative output equals plain output
on this path as on the eager one. The compiled numbers are not the eager ones bit for bit
(Inductor fuses casts), so the engine takes every decode and verify row
through it once it has it. (The drafter's numbers only decide which drafts are proposed.)
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import os
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from agentflash.kernels import cpu_ops, disk_cache, torch_ops

from .. import attention as paged_attention_module
from ..attention import PagedAttention, PagedDraftAttention
from ..models import dflash, layers, qwen3, rope
from ..models.dflash import DFlashDraftModel
from ..models.qwen3 import CausalLM
from . import attention as attention_module
from . import forward as forward_module
from . import kernel_linear, quantized
from .attention import KernelAttention, KernelDraftAttention
from .forward import (DecodeForward, DraftForward, DraftStep, StepArgs, TargetStep,
                      draft_metadata, step_args)

log = logging.getLogger(__name__)

INDUCTOR_OPTIONS = {"freezing": True}
"""freezing: weights become constants, prepacked for oneDNN. (emulate_precision_casts, which
rounds fused kernels' intermediates to bfloat16 as eager does, was measured to break the equality
of batched decode rows and verify blocks: tests/test_embedded.py failed with it.)"""

SERIAL_FUSED = {"cpp.threads": 1}
"""Added where a program runs the CPU kernels: Inductor's fused elementwise kernels (norms,
RoPE, SiLU, the K/V stores) run on the calling thread, without an OpenMP region each. Every op
whose work grows with the weights or the context is then a kernel that splits over all threads;
what is left works on a step's rows, a few hundred to a few thousand elements, less work than
opening a region and waiting at its barrier: one sequence's decode and DFlash run faster, and
many sequences decoding together no slower (docs/performance.md).
Without the kernels the program gathers each layer's context itself, so its kernels keep
their threads."""


def inductor_options(kernels: bool) -> dict:
    """What a program is compiled with (part of its cache key)."""
    return {**INDUCTOR_OPTIONS, **(SERIAL_FUSED if kernels else {})}

_SOURCES = (torch_ops, paged_attention_module, attention_module, forward_module, cpu_ops, dflash,
            kernel_linear, layers, quantized, qwen3, rope, sys.modules[__name__])
"""Modules whose code the compiled program is made of: their source is part of the cache key."""


def cache_dir() -> Path:
    """Where compiled programs live: $AGENTFLASH_CACHE_DIR/compiled, else the user cache."""
    return disk_cache.root() / "compiled"


def compile_enabled() -> bool:
    """$AGENTFLASH_COMPILE=0 turns the compiled step off where an engine is not told."""
    return cpu_ops.env_switch("AGENTFLASH_COMPILE")


DEFAULT_MAX_BYTES = 2 << 30
"""Where an engine is not told, models with more weight bytes than this are not compiled: the
package embeds its own copy of the weights (1.2 GB and ~2.5 min of compiling at 0.6B, for a
faster decode step: 18.7 against 14.2 tok/s eager on the AVX512 Xeon, docs/performance.md)."""


def applies(model: CausalLM) -> bool:
    """CPU, bfloat16 (the row-invariant attention path) and a torch with AOTInductor."""
    weight = model.embed_tokens.weight
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and hasattr(torch._inductor, "aoti_compile_and_package"))


def weight_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def use_kernels(model: CausalLM, kernels: bool | None = None) -> bool:
    """Whether programs compute their linear layers and attention with agentflash's CPU
    kernels (kernels.cpu_ops: faster than oneDNN at a few rows) rather than oneDNN's matmul and
    the torch attention: where they run and take the model's heads, unless `kernels` is
    False."""
    return (kernels is not False and cpu_ops.available()
            and cpu_ops.attends(model.config.head_dim))


class CompiledProgram:
    """A loaded AOTInductor package: built on first use, then loaded from the disk cache."""

    def __init__(self, run_flat: Callable[[list[torch.Tensor]], list[torch.Tensor]], path: Path,
                 compiled: bool, seconds: float, kernels: bool) -> None:
        self.run_flat = run_flat  # the inputs' tensors in order -> the outputs as a list
        self.path = path
        self.compiled = compiled   # False: loaded from the disk cache
        self.seconds = seconds     # compiling (or loading) it
        self.kernels = kernels     # its linears and attention run agentflash's CPU kernels

    @classmethod
    def load_or_build(cls, name: str, key: str, make: Callable[[], tuple],
                      directory: Path | None = None, kernels: bool = False) -> CompiledProgram:
        """`make()` gives (module, example inputs, dynamic shapes) to export when the package
        `name-key.pt2` is not in the cache yet."""
        t0 = time.perf_counter()
        path = (directory or cache_dir()) / f"{name}-{key}.pt2"
        compiled = not path.exists()
        if compiled:  # one process compiles it; another that wants it too waits, then loads it
            with disk_cache.locked(path.with_suffix(".lock"), f"compiling the {name} ({path})"):
                compiled = not path.exists()
                if compiled:
                    log.warning("compiling the %s for this CPU (once; cached in %s)", name,
                                path.parent)
                    _compile(make, path, kernels)
                    _prune(path.parent)
        if not compiled:
            path.touch()  # recently used: pruned last
        run_flat = _flat_entry(path)
        seconds = time.perf_counter() - t0
        log.info("%s %s in %.1f s: %s", name, "compiled" if compiled else "loaded", seconds, path)
        return cls(run_flat, path, compiled, seconds, kernels)


def _flat_entry(path: Path) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    """The package's flat entry point (the package's own __call__ parses its tree specs and
    flattens the inputs on every call: ~0.15 ms, a tenth of an 11m decode step). Through the
    CPU kernels' `run_program` op where the library is loaded: torch's Python loader holds the
    GIL for the whole forward, the op releases it, so other threads (a server's event loop)
    run meanwhile."""
    if cpu_ops.available():
        program = torch.classes.agentflash.Program(str(path))
        return functools.partial(torch.ops.agentflash.run_program, program)
    return torch._inductor.aoti_load_package(str(path)).loader.boxed_run


class CompiledForward(DecodeForward):
    """`TargetStep` compiled ahead of time: the target's decode/verify forward."""

    kind = "compiled"

    def __init__(self, program: CompiledProgram) -> None:
        super().__init__(program.kernels)
        self.program = program

    @classmethod
    def build(cls, model: CausalLM, drafter: DFlashDraftModel | None = None,
              page_size: int = 16, directory: Path | None = None,
              kernels: bool | None = None) -> CompiledForward:
        """Load the program for `model` (and `drafter`'s context store) from the cache,
        compiling it first when it is not there. The models must hold plain `nn.Linear`
        layers (before engine.cpu.fastpath packs them: freezing packs its own copy). kernels:
        linears and attention through the CPU kernels (`use_kernels`; None: where they run)."""
        kernels = use_kernels(model, kernels)
        key = cache_key(model, drafter, _linears(kernels))
        return cls(CompiledProgram.load_or_build(
            "step", key, lambda: _step_export(model, drafter, page_size, kernels), directory,
            kernels))

    def __call__(self, args: StepArgs, k_caches: Sequence[torch.Tensor],
                 v_caches: Sequence[torch.Tensor], draft_k_caches: Sequence[torch.Tensor] = (),
                 draft_v_caches: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        return self.program.run_flat([
            args.ids, args.positions, args.rows, args.slot_mapping, *args.attention, *k_caches,
            *v_caches, *draft_k_caches, *draft_v_caches])[0]


class CompiledDraft(DraftForward):
    """`DraftStep` compiled ahead of time, for one block size."""

    kind = "compiled"

    def __init__(self, program: CompiledProgram, kernel_attention: bool,
                 returns_logits: bool) -> None:
        super().__init__(kernel_attention, returns_logits)
        self.program = program

    @classmethod
    def build(cls, model: CausalLM, drafter: DFlashDraftModel, block_size: int,
              page_size: int = 16, directory: Path | None = None,
              kernels: bool | None = None) -> CompiledDraft:
        kernels = use_kernels(model, kernels)
        key = cache_key(model, drafter, block_size, page_size, _linears(kernels))
        return cls(CompiledProgram.load_or_build(
            "draft", key, lambda: _draft_export(model, drafter, block_size, page_size, kernels),
            directory, kernels), kernels and KernelDraftAttention.supports(drafter),
            DraftStep.computes_head(drafter, kernels))

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor,
                 attn: KernelDraftAttention | PagedDraftAttention,
                 rows: torch.Tensor) -> torch.Tensor:
        return self.program.run_flat([ids, positions, rows, *draft_metadata(attn),
                                      *attn.k_caches, *attn.v_caches])[0]


def _linears(kernels: bool) -> str:
    """What computes a program's linears and attention, for its cache key (the kernels'
    sources included)."""
    if not kernels:
        return "onednn"
    isa = cpu_ops.isa()
    products = "float32" if cpu_ops.prefer_float32() else "native"
    return f"{isa.name if isa else '?'}-{products}-{cpu_ops.source_digest()}"


@functools.cache
def _source_digest() -> bytes:
    """The model code's source as first read (once: the loaded code, even if a file is edited
    while the process runs)."""
    return hashlib.blake2b(b"".join(inspect.getsource(m).encode() for m in _SOURCES)).digest()


KEEP = 24
"""Packages the cache keeps; beyond that the least recently used go (each model, drafter, block
size and code version has its own)."""


def _prune(directory: Path) -> None:
    """Drop the least recently used packages beyond `KEEP` (with their lock files), and what
    compiles killed midway left (partial packages of processes that are gone)."""
    packages = sorted((p for p in directory.glob("*.pt2") if ".partial." not in p.name),
                      key=lambda p: p.stat().st_mtime, reverse=True)
    for old in packages[KEEP:]:
        old.unlink(missing_ok=True)
        old.with_suffix(".lock").unlink(missing_ok=True)
    for partial in directory.glob("*.partial.pt2"):
        pid = partial.name.split(".")[-3]
        if pid.isdigit() and not _alive(int(pid)):
            partial.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def cache_key(model: CausalLM, drafter: DFlashDraftModel | None = None, *extra) -> str:
    """A digest of everything a compiled program depends on."""
    h = hashlib.blake2b(digest_size=16)
    for part in (torch.__version__, torch.backends.cpu.get_cpu_capability(),
                 torch.get_num_threads(), INDUCTOR_OPTIONS, SERIAL_FUSED,
                 sorted(cpu_ops.aoti_shims().items(), key=str), repr(model.config), extra,
                 None if drafter is None else repr(drafter.config),
                 repr(model), repr(drafter)):  # the modules (their kinds and flags)
        h.update(repr(part).encode())
    h.update(_source_digest())
    # every weight (the heads too: with the CPU kernels the programs compute them) but a
    # drafter's context K/V rows (qkv_proj's rows)
    for module, skipped in ((model, ()), (drafter, ("context_kv_proj.",))):
        if module is None:
            continue
        for name, tensor in module.state_dict().items():
            if name.startswith(skipped):
                continue
            h.update(name.encode())
            h.update(tensor.detach().contiguous().view(torch.uint8).numpy().data)
    return h.hexdigest()


def _caches(pages: int, page_size: int, layers: int, heads: int, head_dim: int,
            dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.zeros(pages * page_size, heads, head_dim, dtype=dtype) for _ in range(layers)]


def _tables(ctx_lens: Sequence[int], page_size: int) -> list[list[int]]:
    """Page tables of sequences laid out on consecutive pages."""
    tables, first = [], 0
    for n in ctx_lens:
        pages = -(-n // page_size)
        tables.append(list(range(first, first + pages)))
        first += pages
    return tables


_PAGES = 160
"""Pages of the example caches (the example sequences below need 134 of 16 tokens)."""


def _step_export(model: CausalLM, drafter: DFlashDraftModel | None, page_size: int,
                 kernels: bool) -> tuple:
    """The target program's module, example inputs and dynamic shapes. Every dynamic size of
    the example is distinct (export would tie equal ones together): 3 sequences of 1200 / 640 /
    300 tokens bringing 4 / 2 / 1 new ones (T 7, B 3, Q 4, 5 key chunks), 6 rows returned."""
    cfg = model.config
    kv = (cfg.num_key_value_heads, cfg.head_dim, model.dtype)
    k_caches = _caches(_PAGES, page_size, len(model.layers), *kv)
    v_caches = _caches(_PAGES, page_size, len(model.layers), *kv)
    draft_k: list[torch.Tensor] = []
    draft_v: list[torch.Tensor] = []
    if drafter is not None:
        dcfg = drafter.config
        dkv = (dcfg.num_key_value_heads, dcfg.head_dim, model.dtype)
        draft_k = _caches(_PAGES, page_size, len(drafter.layers), *dkv)
        draft_v = _caches(_PAGES, page_size, len(drafter.layers), *dkv)
    ctx_lens, num_new = [1200, 640, 300], [4, 2, 1]
    build = (KernelAttention.build if kernels
             else functools.partial(PagedAttention.build, one_group=True))
    attn = build(k_caches, v_caches, _tables(ctx_lens, page_size), ctx_lens, num_new, page_size,
                 model.attention_scale)
    positions = torch.cat([torch.arange(c - n, c) for c, n in zip(ctx_lens, num_new)])
    a = step_args(torch.zeros(sum(num_new), dtype=torch.long), positions, attn,
                  torch.tensor([0, 1, 2, 3, 4, 6]))
    example = (a.ids, a.positions, a.rows, a.slot_mapping, a.attention, k_caches, v_caches,
               draft_k, draft_v)
    Dim = torch.export.Dim
    tokens, seqs = Dim("tokens", min=1, max=1 << 16), Dim("seqs", min=1, max=1 << 12)
    slots = Dim("slots", min=page_size)
    if kernels:
        pages = Dim("pages", min=1, max=1 << 16)
        attention: tuple = ({0: seqs, 1: pages}, {0: tokens}, {0: tokens})
    else:
        queries = Dim("queries", min=1, max=torch_ops.INVARIANT_MAX_QUERIES)
        chunks = Dim("chunks", min=1, max=1 << 14)
        attention = ({0: seqs, 1: queries}, {0: tokens}, {0: seqs, 2: chunks},
                     {0: seqs, 1: chunks, 2: queries})
    rows = Dim("rows", min=1, max=1 << 16)
    shapes = ({0: tokens}, {0: tokens}, {0: rows}, {0: tokens}, attention,
              [{0: slots}] * len(k_caches), [{0: slots}] * len(v_caches),
              [{0: slots}] * len(draft_k), [{0: slots}] * len(draft_v))
    return TargetStep(model, drafter, kernels, page_size), example, shapes


def _draft_export(model: CausalLM, drafter: DFlashDraftModel, block_size: int,
                  page_size: int, kernels: bool) -> tuple:
    """The drafter program's module, example inputs and dynamic shapes: 3 blocks over contexts
    of 1200 / 640 / 300 tokens."""
    dcfg = drafter.config
    dkv = (dcfg.num_key_value_heads, dcfg.head_dim, model.dtype)
    k_caches = _caches(_PAGES, page_size, len(drafter.layers), *dkv)
    v_caches = _caches(_PAGES, page_size, len(drafter.layers), *dkv)
    ctx_lens = [1200, 640, 300]
    module = DraftStep(model, drafter, block_size, kernels, page_size)
    build = KernelDraftAttention.build if module.kernel_attention else PagedDraftAttention.build
    attn = build(k_caches, v_caches, _tables(ctx_lens, page_size), ctx_lens, block_size,
                 page_size, drafter)
    positions = torch.cat([torch.arange(c, c + block_size) for c in ctx_lens])
    ids = torch.zeros(len(ctx_lens) * block_size, dtype=torch.long)
    rows = torch.tensor([b * block_size + 1 + i for b in range(len(ctx_lens))
                         for i in range(block_size // 2)])
    example = (ids, positions, rows, draft_metadata(attn), k_caches, v_caches)
    Dim = torch.export.Dim
    seqs, keys = Dim("seqs", min=1, max=1 << 12), Dim("keys", min=1, max=1 << 20)
    slots = Dim("slots", min=page_size)
    tokens = {0: seqs * block_size}
    wanted = {0: Dim("rows", min=1, max=1 << 16)}
    if module.kernel_attention:
        pages = Dim("pages", min=1, max=1 << 16)
        attention: tuple = ({0: seqs, 1: pages}, tokens, tokens, tokens, {0: seqs})
    else:
        attention = ({0: seqs, 1: keys}, {0: seqs})
    shapes = (tokens, tokens, wanted, attention, [{0: slots}] * len(k_caches),
              [{0: slots}] * len(v_caches))
    return module, example, shapes


def _compile(make: Callable[[], tuple], path: Path, kernels: bool) -> None:
    # outside inference mode: export writes into the example caches, made here as normal tensors
    with torch.inference_mode(False), torch.no_grad():
        module, example, shapes = make()
        program = torch.export.export(module.eval(), example, dynamic_shapes=shapes)
        _fold_residual_adds(program)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.pt2")
        # the program calls the CPU kernels' C shims where they are loaded (cpu_ops.aoti_shims)
        shims = {"aot_inductor.custom_ops_to_c_shims": cpu_ops.aoti_shims()}
        with torch._inductor.config.patch({**inductor_options(kernels), **shims}):
            torch._inductor.aoti_compile_and_package(program, package_path=str(partial))
    os.replace(partial, path)  # atomic: a concurrent engine sees a whole package or none


def _fold_residual_adds(program: torch.export.ExportedProgram) -> int:
    """Rewrite `linear_bf16(x, w, b) + r` as `linear_bf16(x, w, b, residual=r)` (and the same for
    `linear_panels`, `linear_int8(x, q, scale, b)` and `linear_int8_dynamic`), in place.

    The residual stream is then written by the kernel, rounded once to bfloat16, as oneDNN's
    fused add wrote it. Left to Inductor, the add fuses with what reads it, and whether a reader
    sees the float32 sum or its bfloat16 rounding depends on how the kernels are cut: that
    differs between the target's program alone and the one that also stores the drafter's
    context (which reads the residual stream of some layers), and a plain engine's rows would
    not be a speculative engine's rows bit for bit. Returns how many adds were folded (none
    where the kernels are not loaded: the program has none of their ops)."""
    if not cpu_ops.loaded():
        return 0
    ops = torch.ops.agentflash
    linears = (ops.linear_bf16.default, ops.linear_panels.default, ops.linear_int8.default,
               ops.linear_int8_dynamic.default)
    graph = program.graph_module.graph
    folded = 0
    for node in list(graph.nodes):
        if node.target is not torch.ops.aten.add.Tensor or node.kwargs or len(node.args) != 2:
            continue
        for lin, other in (node.args, node.args[::-1]):
            if not (isinstance(lin, torch.fx.Node) and lin.target in linears):
                continue
            schema = lin.target._schema.arguments  # the residual is the last argument
            before = len(schema) - 1
            if (len(lin.users) == 1 and len(lin.args) + len(lin.kwargs) <= before
                    and isinstance(other, torch.fx.Node)
                    and other.meta["val"].shape == node.meta["val"].shape
                    and other.meta["val"].dtype == torch.bfloat16):
                args = [lin.args[i] if i < len(lin.args)
                        else lin.kwargs.get(a.name, a.default_value)
                        for i, a in enumerate(schema[:before])]
                with graph.inserting_before(node):
                    fused = graph.call_function(lin.target, (*args, other))
                fused.meta = dict(node.meta)
                node.replace_all_uses_with(fused)
                graph.erase_node(node)
                graph.erase_node(lin)
                folded += 1
                break
    graph.lint()
    program.graph_module.recompile()
    return folded
