"""How the engine prepares its models for inference on the machine it runs on.

A small registry of model transformations, each with the condition it applies under (device,
dtype, what the CPU and the torch build offer). `Engine` runs `prepare` on its target and drafter
when it is made, so every front end (`Engine.from_dir`, `Runtime.load`, `agentflash generate`)
gets the fast path with no flag; `Engine(..., fast_path=False)` keeps the models as loaded.

Packing keeps the numbers bit for bit: greedy output, speculative or not, is the same with and
without it (tests/test_packed.py). The compiled step does not (Inductor fuses casts), but it
serves every decode and verify row, so speculative output equals plain output with it too
(tests/test_compiled.py).

- `onednn-packed-bf16` (CPU, bfloat16, oneDNN with bf16 support): every linear layer's weight is
  reordered once into oneDNN's blocked layout (engine.cpu.packed); the tied lm_head gets a
  packed copy of the embedding matrix (the embedding lookup keeps the plain one). With a
  decode forward (compiled, or eager on the CPU kernels) only the head is packed, and the
  layers, which then serve prefill chunks only, round their rows up to a multiple of 32
  (engine.cpu.bucketed: oneDNN builds a kernel per shape, and chunks come in every length);
  where the decode forward takes prefill chunks too (AMX, AVX512-BF16; compiled, AVX2 too:
  `DecodeForward.takes_prefill`) the eager layers serve no row, and their buckets are not built.

- `cpu-kernels` (with the compiled step, where agentflash's CPU kernels run: kernels.cpu_ops,
  AMX, AVX512-BF16, AVX512 or AVX2): the programs compute their linears and attention with them, and
  the head becomes a `KernelLinear` on the checkpoint's matrix (engine.cpu.compiled).

- `widened-bf16-linears` (CPU, bfloat16, no native bf16 matmuls, where the CPU kernels run):
  every linear layer of the eager models becomes a `WidenedLinear` (engine.cpu.kernel_linear):
  the kernel for few rows, float32 on the widened weight for prefill chunks, where torch's
  emulated bf16 matmul is ~5x slower than float32 (the runner gives each prefill chunk a forward
  of its own, so a chunk's rows are the same in every run); the widened weights are kept,
  packed for oneDNN, up to PACK_FLOAT32_BYTES of them (with the float32 weights the int8
  layers' prefill matmuls use, `Int8Linear.widen`). Applied after compiling (the
  programs trace the plain linears). Hybrid models, whose forwards carry prefill chunks and
  verify blocks together, get `KernelLinear`s instead (`cpu-kernel-linears`: every row the
  kernel's, whatever the call).

- `aoti-compiled-step` (CPU, bfloat16, AOTInductor; on by default up to 2 GB of weights,
  `compile=False` or $AGENTFLASH_COMPILE=0 turn it off, `compile=True` forces it; applied
  before packing): the decode and verify forwards are compiled ahead of time into one program,
  the drafter's forward into another (engine.cpu.compiled), cached on disk. Its numbers are
  Inductor's, not eager's bit for bit, but one program serves every decode and verify row, so
  greedy speculative output still equals plain output. Where compiling fails (no C++ compiler,
  an unsupported op), a warning says why and the engine runs eager.

One transformation changes the output's numbers and so runs only when asked for
(`quantize="int8"`):
- `int8-weights` (CPU, bfloat16, where agentflash's CPU kernels run): the target's decoder
  linears and its head become per-channel int8 (engine.cpu.quantized.Int8Linear; a tied head
  gets an int8 copy, the embedding keeps its matrix). Half the bytes a decode step reads.
  Greedy speculative output equals the quantized target's plain output, bit for bit.

One changes the drafter's numbers only, never the output (the target verifies every draft),
and so runs by default:
- `int8-drafter` (CPU, bfloat16, where agentflash's CPU kernels run, with a drafter; not where
  their bfloat16 linears run on AMX tiles, unless the target is int8 too): the drafter's
  linears (its context projection included) become per-channel int8, and it drafts with an
  int8 copy of the target's head (`DFlashDraftModel.head`; an int8 target's head is already
  int8 and is shared, through a view). Its forward and the context store of every step read
  half the bytes: on agentflash-11m the drafter's forward costs ~20% less, and a replay of its
  drafts on held-out agent prompts (tools/eval_policy.py) commits as many tokens per step as
  the bfloat16 drafter's (docs/performance.md). Its layers are `dynamic` (x's rows quantized
  to 16-bit integers in the kernel, summed exactly in int32). AMX tiles take the bfloat16
  linears in 0.2-0.6x the int8 kernel's time at 8-512 rows (kernels.cpu_ops.tile_linears).

Hybrid targets (Qwen3.5, engine.models.qwen3_5) run eager; in bfloat16 on a CPU without native
bf16 matmuls their linears and MoE experts run the CPU kernel (`cpu-kernel-linears`), else
they are as loaded.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from agentflash.kernels import cpu_ops

from ..models.dflash import DFlashDraftModel
from ..models.moe import Experts
from ..models.qwen3 import CausalLM
from ..models.qwen3_5 import HybridCausalLM
from . import compiled as compiled_step
from .bucketed import BucketedLinear, warm_buckets
from .compiled import CompiledDraft, CompiledForward
from .forward import DecodeForward, DraftForward, ModuleDraftForward
from .kernel_linear import (KernelLinear, WidenedLinear, float32_packing_available,
                            swap_linears)
from .packed import PackedLinear, pack_linears, packing_available
from .quantized import Int8Linear, quantize_drafter_int8, quantize_linears_int8

log = logging.getLogger(__name__)


QUANTIZATIONS = ("int8",)


@dataclass(frozen=True)
class FastPath:
    name: str
    applies: Callable[[CausalLM, DFlashDraftModel | None, str | None], bool]  # (.., quantize)
    apply: Callable[[CausalLM, DFlashDraftModel | None, bool], None]  # (.., target layers too)


def _cpu_bf16(model: CausalLM) -> bool:
    weight = model.embed_tokens.weight
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16


def _head_as(model: CausalLM, make: Callable[[torch.Tensor, torch.Tensor | None], nn.Module]
             ) -> None:
    """The head, while it is still the checkpoint's (tied, or an `nn.Linear`), becomes
    make(weight, bias) on its matrix; a tied embedding keeps its matrix for the lookup."""
    if model.lm_head is None:
        model.lm_head = make(model.embed_tokens.weight, None)
    elif isinstance(model.lm_head, nn.Linear):
        model.lm_head = make(model.lm_head.weight, model.lm_head.bias)


def _int8(model: CausalLM, drafter: DFlashDraftModel | None, layers: bool) -> None:
    quantize_linears_int8(model.layers)
    _head_as(model, Int8Linear)  # a tied head gets an int8 copy


def _int8_drafter(model: CausalLM, drafter: DFlashDraftModel | None, layers: bool) -> None:
    """The drafter's linears, its context K/V rows and (unless the target's already is) the
    head it drafts with, as int8: what its forward and every step's context store read. A
    model an earlier engine prepared still has its matrix (the embedding, or the head's
    `weight`), except an untied head packed for oneDNN: the drafter then drafts with that."""
    assert drafter is not None
    quantize_drafter_int8(drafter)
    head = model.lm_head
    if drafter.head is not None:
        return  # an earlier engine's copy
    if isinstance(head, Int8Linear):
        drafter.head = head.dynamic_view()  # the int8 target's own (its buffers shared)
        return
    if model.config.tie_word_embeddings or head is None:
        matrix = model.embed_tokens.weight, None
    elif isinstance(head, (nn.Linear, KernelLinear)):
        matrix = head.weight, head.bias
    else:
        return
    drafter.head = Int8Linear(*matrix, kernel_rows=None, dynamic=True)  # few rows: the kernel


def _kernel_head(model: CausalLM) -> None:
    """The head through the CPU kernel, on the checkpoint's matrix (no copy)."""
    _head_as(model, KernelLinear)


def _drafts_int8(model: CausalLM, drafter: DFlashDraftModel | None,
                 quantize: str | None) -> bool:
    """Where the kernels run, unless their bfloat16 linears run on AMX tiles (faster there
    than the int8 kernel at every row count) for a bfloat16 target; an int8 target's drafter
    is int8 too (it drafts with the target's int8 head)."""
    int8_target = quantize == "int8" or isinstance(model.lm_head, Int8Linear)
    return drafter is not None and _cpu_bf16(model) and cpu_ops.available() and (
        int8_target or not cpu_ops.tile_linears())


def _packs(model: CausalLM, drafter: DFlashDraftModel | None, quantize: str | None) -> bool:
    return _cpu_bf16(model) and packing_available()


def _pack(model: CausalLM, drafter: DFlashDraftModel | None, layers: bool) -> None:
    _head_as(model, PackedLinear)  # a tied head packs a copy
    if layers:
        pack_linears(model.layers)
    else:  # the layers serve prefill chunks only, of every length
        swap_linears(model.layers, BucketedLinear)
    if drafter is not None and layers:
        if drafter.context_kv_proj is None:
            drafter.context_kv_proj = nn.ModuleList(
                PackedLinear(*drafter.context_kv_rows(i)) for i in range(len(drafter.layers)))
        pack_linears(drafter)


def _kernels_everywhere(model: CausalLM, drafter: DFlashDraftModel | None = None,
                        quantize: str | None = None) -> bool:
    return _cpu_bf16(model) and not packing_available() and cpu_ops.available()


def _kernel_linears(model: CausalLM, drafter: DFlashDraftModel | None, layers: bool,
                    kind: type[KernelLinear] = WidenedLinear) -> None:
    """Every linear of the eager models, with a decode forward or not: prefill runs them (and
    the drafter's context projection with it)."""
    _head_as(model, kind)
    swap_linears(model, kind)
    if drafter is not None:
        if drafter.context_kv_proj is None:
            drafter.context_kv_proj = nn.ModuleList(
                kind(*drafter.context_kv_rows(i)) for i in range(len(drafter.layers)))
        swap_linears(drafter, kind)
    modules = [m for part in (model, drafter) if part is not None for m in part.modules()]
    widened = [m for m in modules if isinstance(m, WidenedLinear)]
    heads = (model.lm_head, None if drafter is None else drafter.head)  # few rows: the kernel
    int8 = [m for m in modules if isinstance(m, Int8Linear) and m.kernel_rows is not None
            and not any(m is head for head in heads)]
    budget = PACK_FLOAT32_BYTES  # the widened weights first, then the int8 layers' copies
    widened_bytes = 4 * sum(m.weight.numel() for m in widened)
    if float32_packing_available() and widened_bytes <= budget:
        for m in widened:
            m.pack()
        budget -= widened_bytes
    if 4 * sum(m.qweight.numel() for m in int8) <= budget:
        for m in int8:
            m.widen()


PACK_FLOAT32_BYTES = 512 << 20
"""`widened-bf16-linears` keeps packed float32 copies of the widened weights (and the float32
weights of the int8 layers' prefill matmuls: `Int8Linear.widen`) when they take this much memory
or less (the embedded model's: 38 MB, its int8 drafter's 2 MB); larger models widen per call."""


FAST_PATHS: list[FastPath] = [  # in order: quantization first, the layouts take what is left
    FastPath("int8-weights", lambda model, drafter, quantize: quantize == "int8", _int8),
    FastPath("int8-drafter", _drafts_int8, _int8_drafter),
    FastPath("onednn-packed-bf16", _packs, _pack),
    FastPath("widened-bf16-linears", _kernels_everywhere, _kernel_linears),
]

_LAYOUTS = frozenset({"onednn-packed-bf16", "widened-bf16-linears"})
"""The decode/verify forward is made before the first of these: export traces plain linears,
and the forward's kernel linears read the checkpoint's weights, not a packed copy."""


@dataclass(frozen=True)
class Prepared:
    applied: list[str]                       # names of the transformations applied, in order
    decode: DecodeForward | None = None      # the decode/verify forward (compiled or eager
                                             # on the CPU kernels), if made
    draft: DraftForward | None = None        # the drafter's, if made
    seconds: dict[str, float] = field(default_factory=dict)  # time each one took


def prepare(model: CausalLM | HybridCausalLM, drafter: DFlashDraftModel | None = None,
            quantize: str | None = None, compile: bool | None = None,
            block_size: int = 16, page_size: int = 16, prefill_rows: int = 0) -> Prepared:
    """Apply, in place, every registered transformation that applies to `model` (and its
    drafter). Models stay usable for inference only. quantize="int8" asks for quantized
    weights (CPU, bfloat16 only, where the CPU kernels run: ValueError elsewhere). compile:
    build (or load) the compiled decode/verify forward and the drafter's forward for
    `block_size` (None: unless $AGENTFLASH_COMPILE=0); where none is made and the CPU kernels
    run, the same forwards run eager on them. prefill_rows: the longest prefill chunk, whose
    bucketed matmul kernels are built now (engine.cpu.bucketed). A hybrid model is left as it
    is."""
    if isinstance(model, HybridCausalLM):
        # The compiled step exports CausalLM's forward over paged attention alone (no recurrent
        # states to carry), and packing and int8 were never checked against transformers on
        # the DeltaNet layers (conv1d, gated norm): hybrid models run eager until they are,
        # with every linear on the CPU kernel where torch would emulate bf16 matmuls.
        if quantize is not None:
            raise ValueError(f"quantize={quantize!r} is not supported on hybrid models yet")
        if not _kernels_everywhere(model):
            return Prepared([])
        t0 = time.perf_counter()
        _kernel_linears(model, drafter, True, KernelLinear)
        for module in model.modules():
            if isinstance(module, Experts):
                module.kernel = True
        return Prepared(["cpu-kernel-linears"],
                        seconds={"cpu-kernel-linears": time.perf_counter() - t0})
    if quantize is not None:
        if quantize not in QUANTIZATIONS:
            raise ValueError(f"quantize={quantize!r}: choose from {QUANTIZATIONS} or None")
        weight = model.embed_tokens.weight
        if not _cpu_bf16(model):
            raise ValueError(f"quantize={quantize!r} needs a bfloat16 model on CPU; this one is "
                             f"{weight.dtype} on {weight.device}")
        if not cpu_ops.available():
            raise ValueError(f"quantize='int8' needs agentflash's CPU kernels, which do not run "
                             f"here: {cpu_ops.load()}")
    if _cpu_bf16(model) and not packing_available() and not cpu_ops.available():
        log.warning("neither oneDNN bfloat16 matmuls with prepacked weights nor agentflash's "
                    "CPU kernels run here (%s): bfloat16 linear layers run unpacked and slow; "
                    "float32 may be faster", cpu_ops.load())
    applied: list[str] = []
    seconds: dict[str, float] = {}
    if compile is None:
        compile = compiled_step.compile_enabled()
        if compile and compiled_step.weight_bytes(model) > compiled_step.DEFAULT_MAX_BYTES:
            log.info("not compiling the decode step of a model of %.1f GB by default (its "
                     "package would copy the weights); Engine(compile=True) does",
                     compiled_step.weight_bytes(model) / 1e9)
            compile = False
    decode: DecodeForward | None = None
    draft: DraftForward | None = None
    made = False
    with torch.inference_mode():
        for path in FAST_PATHS:
            if path.name in _LAYOUTS and not made:
                made = True
                t0 = time.perf_counter()
                decode, draft = _forwards(model, drafter, compile, block_size, page_size)
                if decode is not None and decode.kind == "compiled":
                    applied.append("aoti-compiled-step")
                    seconds["aoti-compiled-step"] = time.perf_counter() - t0
                if decode is not None and decode.kernels:  # the head too: rows as invariant
                    _kernel_head(model)
                    applied.append("cpu-kernels")
            if path.applies(model, drafter, quantize):
                t0 = time.perf_counter()
                # with a decode forward, the eager layers serve prefill only (many rows)
                path.apply(model, drafter, decode is None)
                applied.append(path.name)
                seconds[path.name] = time.perf_counter() - t0
        if ("onednn-packed-bf16" in applied and decode is not None and prefill_rows
                and not decode.takes_prefill):
            t0 = time.perf_counter()
            warm_buckets([m for m in (model, drafter) if m is not None], prefill_rows)
            seconds["bucket-warm-up"] = time.perf_counter() - t0
    return Prepared(applied, decode, draft, seconds)


def _forwards(model: CausalLM, drafter: DFlashDraftModel | None, compile: bool,
              block_size: int, page_size: int) -> tuple[DecodeForward | None, DraftForward | None]:
    """The decode/verify forward and the drafter's: compiled where asked and possible, else
    eager on the CPU kernels where they run, else none (the eager model serves every row)."""
    decode: DecodeForward | None = None
    draft: DraftForward | None = None
    compiles = compile and compiled_step.applies(model)
    if compiles:
        decode = _try(lambda: CompiledForward.build(model, drafter, page_size), "decode step")
    kernels = _cpu_bf16(model) and compiled_step.use_kernels(model)
    if decode is None and kernels:
        decode = DecodeForward.eager(model, drafter, page_size)
    if decode is None or drafter is None:
        return decode, None
    if drafter.config.v2 is not None:  # DFlash2: its own module forward, the kernels' attention
        return decode, ModuleDraftForward(model, drafter, block_size) if kernels else None
    if compiles:
        draft = _try(lambda: CompiledDraft.build(model, drafter, block_size, page_size),
                     "drafter forward")
    if draft is None and kernels:
        draft = DraftForward.eager(model, drafter, block_size, page_size)
    return decode, draft


def _try(build: Callable, what: str):
    try:
        return build()
    except Exception as error:  # a missing compiler or an op AOTInductor cannot take
        log.warning("the compiled %s is unavailable, running it eager (slower): %s: %s", what,
                    type(error).__name__, (str(error).strip() or "?").splitlines()[0][:300])
        return None
