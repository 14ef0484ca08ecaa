"""The compiled decode/verify step (engine.cpu.compiled): rows independent of the forward's shape,
K/V stored in place, the program cached on disk, and an eager fallback when compiling fails.
Greedy speculative output equal to plain through it: tests/test_embedded.py (compiled)."""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from agentflash.embedded import embedded_model_dir, model_drafter_dir
from agentflash.engine.attention import PagedAttention, PagedDraftAttention
from agentflash.engine.cpu.attention import KernelDraftAttention
from agentflash.engine.cpu.compiled import CompiledDraft, CompiledForward, cache_key
from agentflash.engine.cpu.forward import DecodeForward, DraftForward, kernel_view, step_args
from agentflash.engine.engine import Engine
from agentflash.engine.models.dflash import load_drafter
from agentflash.engine.models.loader import load_model
from agentflash.engine.cpu.packed import packing_available
from agentflash.engine.cpu.quantized import (Int8Linear, quantize_drafter_int8,
                                               quantize_linears_int8)
from agentflash.engine.sampler import SamplingParams
from agentflash.kernels import cpu_ops
from skips import CPU_KERNELS, PREFILL_THROUGH_KERNELS, ROW_INVARIANT_ONEDNN_BF16

PAGE = 16


@pytest.fixture(scope="module")
def model():
    return load_model(embedded_model_dir(), dtype=torch.bfloat16)


def _caches(model, pages: int, seed: int = 0):
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    shape = (pages * PAGE, cfg.num_key_value_heads, cfg.head_dim)
    return ([torch.randn(shape, generator=g).to(torch.bfloat16) for _ in model.layers],
            [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in model.layers])


def _forward(run, model, tokens, ctx_lens, num_new, k, v):
    """One forward of sequences laid out on consecutive pages; `run` is the compiled program or
    None for the eager model."""
    tables, first = [], 0
    for n in ctx_lens:
        tables.append(list(range(first, first + -(-n // PAGE))))
        first += len(tables[-1])
    eager = run is None
    meta = (k, v, tables, ctx_lens, num_new, PAGE, model.attention_scale)
    attn = PagedAttention.build(*meta) if eager else run.attention(*meta)
    ids = torch.tensor(tokens)
    pos = torch.cat([torch.arange(c - n, c) for c, n in zip(ctx_lens, num_new)])
    if eager:
        return model(ids, pos, attn).hidden
    return run(step_args(ids, pos, attn), k, v)


@pytest.mark.parametrize("kernels,compiled", [(True, True), (False, True), (True, False)],
                         ids=["cpu-kernels", "onednn", "eager-cpu-kernels"])
def test_rows_do_not_depend_on_the_forward_and_kv_is_stored_in_place(model, kernels, compiled):
    """Compiled with agentflash's CPU kernels (where they run) and with oneDNN and the torch
    attention (where they do not: no AVX2, no compiler, AGENTFLASH_CPU_KERNELS=0); and the same
    forward eager on the kernels (where no program is made: compile off, large models)."""
    if kernels:
        CPU_KERNELS.need()
    else:
        ROW_INVARIANT_ONEDNN_BF16.need()  # else the default is the kernels, or float32
    if compiled:
        run = CompiledForward.build(model, page_size=PAGE, kernels=kernels)
        assert run.program.kernels == kernels
    else:
        run = DecodeForward.eager(model, page_size=PAGE)
    tokens = [(31 * i + 7) % model.config.vocab_size for i in range(16)]
    k, v = _caches(model, 128)
    block = _forward(run, model, tokens, [1000], [16], k, v)
    k_block, v_block = [t.clone() for t in k], [t.clone() for t in v]

    k, v = _caches(model, 128)   # the same context; the block's tokens one decode step at a time
    rows = [_forward(run, model, [t], [985 + i], [1], k, v) for i, t in enumerate(tokens)]
    assert torch.equal(torch.cat(rows), block)
    assert all(torch.equal(a, b) for a, b in zip(k + v, k_block + v_block))

    # ... and in a batch beside a decode row and another sequence's verify block (the first
    # sequence keeps its pages, so its context is the same)
    k, v = _caches(model, 128)
    batch = _forward(run, model, tokens + [5, 9, 9, 9], [1000, 300, 610], [16, 1, 3], k, v)
    assert torch.equal(batch[:16], block)

    # the forward's numbers are the eager model's to bfloat16 rounding (Inductor fuses casts,
    # the kernels sum in their own order); with the kernels the head is inside: logits
    k, v = _caches(model, 128)
    eager = _forward(None, model, tokens, [1000], [16], k, v)
    assert run.returns_logits == kernels
    if kernels:
        eager = model.logits(eager)
    cos = torch.nn.functional.cosine_similarity(eager.float(), block.float(), dim=-1)
    assert cos.min() > 0.999, cos


@CPU_KERNELS.mark
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_prefill_chunks_beside_other_rows_are_the_same_as_alone(model, compiled):
    """On the CPU kernels the decode/verify forward takes prefill chunks too (the runner sends
    them there where the kernels are fast at many rows: AMX, AVX512-BF16, compiled on AVX2 too:
    `DecodeForward.takes_prefill`): a chunk's rows and stored K/V are the same alone and in one
    forward with a decode row and another sequence's chunk, and the forward returns just the
    rows asked for."""
    run = (CompiledForward.build(model, page_size=PAGE) if compiled
           else DecodeForward.eager(model, page_size=PAGE))
    vocab = model.config.vocab_size
    chunk = [(31 * i + 7) % vocab for i in range(150)]  # the linears' many-rows path on AMX
    other = [(17 * i + 3) % vocab for i in range(90)]
    k, v = _caches(model, 128)
    alone = _forward(run, model, chunk, [400], [150], k, v)
    kv_alone = [t[:25 * PAGE].clone() for t in k + v]  # the chunk's sequence's pages
    k, v = _caches(model, 128)
    batch = _forward(run, model, chunk + [5] + other, [400, 1000, 90], [150, 1, 90], k, v)
    assert torch.equal(batch[:150], alone)
    assert all(torch.equal(a[:25 * PAGE], b) for a, b in zip(k + v, kv_alone))
    # only the rows that sample (each chunk's last, the decode row): those rows of the whole
    k, v = _caches(model, 128)
    tables = [list(range(25)), list(range(25, 88)), list(range(88, 94))]
    attn = run.attention(k, v, tables, [400, 1000, 90], [150, 1, 90], PAGE,
                         model.attention_scale)
    ids = torch.tensor(chunk + [5] + other)
    pos = torch.cat([torch.arange(250, 400), torch.tensor([999]), torch.arange(90)])
    rows = torch.tensor([149, 150, 240])
    assert torch.equal(run(step_args(ids, pos, attn, rows), k, v), batch[rows])


def test_the_drafter_runs_compiled_and_its_context_is_stored_by_the_target_program(model):
    """The drafter's programs agree with its eager forward (to bfloat16 rounding: only which
    drafts are proposed depends on them)."""
    drafter = load_drafter(model_drafter_dir(embedded_model_dir()), model)
    step = CompiledForward.build(model, drafter, page_size=PAGE)
    draft = CompiledDraft.build(model, drafter, 16, page_size=PAGE)
    tokens = [(31 * i + 7) % model.config.vocab_size for i in range(16)]
    k, v = _caches(model, 128)
    dk, dv = _caches(model, 128, seed=1)
    dk, dv = dk[:len(drafter.layers)], dv[:len(drafter.layers)]
    attn = step.attention(k, v, [list(range(63))], [1000], [16], PAGE, model.attention_scale)
    ids, pos = torch.tensor(tokens), torch.arange(984, 1000)
    step(step_args(ids, pos, attn), k, v, dk, dv)
    captured = model(ids, pos, PagedAttention.build(
        [t.clone() for t in k], [t.clone() for t in v], [list(range(63))], [1000], [16], PAGE,
        model.attention_scale), drafter.config.target_layer_ids).captured
    want_k = dk[0].clone()
    drafter.store_context_kv(0, drafter.context_features(captured), pos, pos, want_k,
                             dv[0].clone())
    assert torch.allclose(dk[0][984:1000].float(), want_k[984:1000].float(), atol=0.1, rtol=0.05)

    block = torch.tensor([tokens[0]] + [drafter.config.mask_token_id] * 15)
    bpos = torch.arange(1000, 1016)
    assert draft.kernel_attention == cpu_ops.available()  # the context read in place
    attn = draft.attention(dk, dv, [list(range(63))], [1000], 16, PAGE, drafter)
    got = draft(block, bpos, attn, torch.arange(16))
    eager_attn = PagedDraftAttention.build(dk, dv, [list(range(63))], [1000], 16, PAGE, drafter)
    want = drafter(drafter.embed_block(model, block), bpos, eager_attn)
    cos = torch.nn.functional.cosine_similarity(got.float(), want.float(), dim=-1)
    assert cos.min() > 0.999, cos
    # only the rows whose drafts are verified: bitwise those rows of the whole block
    rows = torch.tensor([1, 2, 3])
    assert torch.equal(draft(block, bpos, attn, rows), got[rows])


def _two_blocks(model, drafter):
    """A drafter's caches (random) and two blocks over contexts of 1000 and 580 tokens: (k
    caches, v caches, page tables, context lengths, block ids, block positions)."""
    dk, dv = _caches(model, 128, seed=1)
    dk, dv = dk[:len(drafter.layers)], dv[:len(drafter.layers)]
    tables, ctx = [list(range(63)), list(range(63, 100))], [1000, 580]
    mask = drafter.config.mask_token_id
    block = torch.tensor([5] + [mask] * 15 + [9] + [mask] * 15)
    bpos = torch.cat([torch.arange(1000, 1016), torch.arange(580, 596)])
    return dk, dv, tables, ctx, block, bpos


@CPU_KERNELS.mark
def test_the_drafter_computes_only_the_rows_verified(model):
    """On the CPU kernels the drafter's last layer computes queries, MLP and norm only for the
    rows whose drafts are verified (every row's K/V still): those rows are bitwise the rows of
    the whole forward, in a batch of blocks over different contexts, so which drafts are
    proposed does not depend on how many are verified."""
    drafter = load_drafter(model_drafter_dir(embedded_model_dir()), model)
    run = DraftForward.eager(model, drafter, 16, PAGE)
    assert run.kernel_attention
    dk, dv, tables, ctx, block, bpos = _two_blocks(model, drafter)
    attn = run.attention(dk, dv, tables, ctx, 16, PAGE, drafter)
    whole = run(block, bpos, attn, torch.arange(32))
    eager_attn = PagedDraftAttention.build(dk, dv, tables, ctx, 16, PAGE, drafter)
    want = drafter(drafter.embed_block(model, block), bpos, eager_attn)
    cos = torch.nn.functional.cosine_similarity(whole.float(), want.float(), dim=-1)
    assert cos.min() > 0.999, cos
    for rows in ([1], [1, 2, 3, 17, 18, 19], list(range(1, 16)) + list(range(17, 32))):
        rows = torch.tensor(rows)
        assert torch.equal(run(block, bpos, attn, rows), whole[rows])


@pytest.mark.parametrize("quantize", [None, pytest.param("int8", marks=CPU_KERNELS.mark)])
def test_a_plain_engines_rows_are_a_speculative_engines_rows(model, quantize):
    """The target's program alone and the one that also stores the drafter's context compute
    the same rows bit for bit (greedy DFlash equals plain across the two engines), with bf16 and
    with int8 weights (each residual add folded into its linear: left to Inductor, the int8
    programs gave different bits)."""
    drafter = load_drafter(model_drafter_dir(embedded_model_dir()), model)
    if quantize == "int8":
        model = copy.deepcopy(model)
        quantize_linears_int8(model.layers)
    plain = CompiledForward.build(model, page_size=PAGE)
    spec = CompiledForward.build(model, drafter, page_size=PAGE)
    tokens = [(31 * i + 7) % model.config.vocab_size for i in range(16)]
    k, v = _caches(model, 128)
    alone = _forward(plain, model, tokens, [1000], [16], k, v)
    k, v = _caches(model, 128)
    dk, dv = _caches(model, 128, seed=1)
    meta = (k, v, [list(range(63))], [1000], [16], PAGE, model.attention_scale)
    ids, pos = torch.tensor(tokens), torch.arange(984, 1000)
    both = spec(step_args(ids, pos, spec.attention(*meta)), k, v, dk[:len(drafter.layers)],
                dv[:len(drafter.layers)])
    assert torch.equal(alone, both)


def test_the_program_is_cached_on_disk(model):
    first = CompiledForward.build(model, page_size=PAGE)  # compiled above, or now
    again = CompiledForward.build(model, page_size=PAGE)
    assert not again.program.compiled and again.program.path == first.program.path
    other = load_model(embedded_model_dir(), dtype=torch.bfloat16)
    with torch.no_grad():
        other.norm.weight.mul_(1.5)
    assert cache_key(other) != cache_key(model)
    assert cache_key(model, None, 16) != cache_key(model, None, 8)
    # an untied head is part of the step's program (the kernels compute it there): its weights
    # are part of the key
    heads = []
    for factor in (1.0, 1.5):
        untied = load_model(embedded_model_dir(), dtype=torch.bfloat16)
        cfg = untied.config
        head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False,
                               dtype=torch.bfloat16)
        with torch.no_grad():
            head.weight.copy_(untied.embed_tokens.weight * factor)
        untied.lm_head = head
        heads.append(cache_key(untied))
    assert heads[0] != heads[1]


@CPU_KERNELS.mark
def test_the_programs_call_the_kernels_through_their_c_shims(model):
    """A program calls the CPU kernels as C functions (kernels/cpu/common/shims.cpp), not through
    AOTInductor's proxy executor, which boxes every argument on every call."""
    drafter = load_drafter(model_drafter_dir(embedded_model_dir()), model)
    for program in (CompiledForward.build(model, drafter, page_size=PAGE).program,
                    CompiledDraft.build(model, drafter, 16, page_size=PAGE).program):
        wrapper = _wrapper_source(program)
        assert "aoti_torch_cpu_paged_attention_bf16(" in wrapper
        assert "aoti_torch_cpu_linear_" in wrapper
        assert "proxy_executor_call_function(" not in wrapper


@CPU_KERNELS.mark
def test_other_threads_run_while_a_program_computes(model):
    """A forward runs with the GIL released (the `run_program` op), so a server's event loop
    reads, renders and streams while the engine's thread computes. With a switch interval
    longer than the test, a thread keeps the GIL through its Python lines until a call releases
    it: the main thread gets to stop another's loop of forwards only if a forward lets go."""
    import sys
    import threading

    run = CompiledForward.build(model, page_size=PAGE)
    k, v = _caches(model, 32)
    tokens = [(31 * i + 7) % model.config.vocab_size for i in range(300)]
    program, inputs = run.program, []
    entry = program.run_flat
    program.run_flat = lambda flat: (inputs.extend(flat), entry(flat))[1]
    _forward(run, model, tokens, [300], [300], k, v)  # its flat inputs, kept
    program.run_flat = entry

    def forwards_before_stopped() -> int:
        stop, forwards = threading.Event(), []

        def loop() -> None:
            while not stop.is_set() and len(forwards) < 50:
                entry(list(inputs))
                forwards.append(1)

        thread = threading.Thread(target=loop)
        thread.start()
        stop.set()
        thread.join()
        return len(forwards)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:  # torch's own loader, which keeps the GIL but for a rare moment: 50 in most tries
        assert all(forwards_before_stopped() < 50 for _ in range(5))
    finally:
        sys.setswitchinterval(interval)


@PREFILL_THROUGH_KERNELS.mark
def test_an_engine_on_its_own_thread_gives_the_same_tokens_on_the_kernels_pool():
    """Where every forward is a compiled program on the kernels (AMX, AVX512-BF16, AVX2: prefill
    chunks too), the thread that steps the engine (`Engine.own_thread`, the runtime's) splits
    the kernels' work over their own pool and runs its torch ops alone: greedy DFlash tokens,
    prefill and verify, are those of the same engine stepped on a plain thread (OpenMP's
    split)."""
    import threading

    model = load_model(embedded_model_dir(), dtype=torch.bfloat16)
    engine = Engine(model, drafter=load_drafter(model_drafter_dir(embedded_model_dir()), model),
                    compile=True)
    vocab = model.config.vocab_size
    prompts = [[(31 * i + 7 * j + 5) % vocab for i in range(40 + 300 * j)] for j in range(4)]
    params = SamplingParams(max_new_tokens=24)
    want = [c.output_ids for c in engine.generate(prompts, params)]
    assert engine.counters.draft_tokens > 0  # the drafter's program ran too
    engine.clear_cache()
    out: dict = {}

    def run() -> None:
        engine.own_thread()
        try:
            out["threads"] = torch.get_num_threads()
            out["tokens"] = [c.output_ids for c in engine.generate(prompts, params)]
        finally:
            cpu_ops.set_engine_thread(0)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert out["tokens"] == want
    assert out["threads"] == 1  # its torch ops on it alone
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{task}/comm").read().strip())
        except (ProcessLookupError, FileNotFoundError):  # a thread that ended meanwhile
            pass
    assert torch.get_num_threads() == 1 or "agentflash-cpu" in names  # the pool's workers


def _wrapper_source(program) -> str:
    """The C++ wrapper of a compiled program's package (what it calls, and how)."""
    import zipfile

    with zipfile.ZipFile(program.path) as package:
        return "".join(package.read(name).decode() for name in package.namelist()
                       if name.endswith("wrapper.cpp"))


def test_a_failed_compile_runs_eager_with_a_warning(monkeypatch, tmp_path, caplog):
    def no_compiler(*args, **kwargs):  # as where no C++ compiler is installed
        raise RuntimeError("Failed to find C++ compiler. Please specify via CXX environment "
                           "variable or set torch._inductor.config.cpp.cxx")

    monkeypatch.setenv("AGENTFLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", no_compiler)
    prompt = [(7 * i + 3) % 4000 for i in range(40)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    with caplog.at_level(logging.WARNING, logger="agentflash.engine.cpu.fastpath"):
        engine = Engine(load_model(embedded_model_dir(), dtype=torch.bfloat16), compile=True)
    assert "aoti-compiled-step" not in engine.fast_paths
    # decode rows run eager: on the CPU kernels where they run, else through the model
    eager = engine.runner.decode
    assert eager.kind == "eager" if cpu_ops.available() else eager is None
    assert "compiled decode step is unavailable" in caplog.text
    assert "C++ compiler" in caplog.text
    (done,) = engine.generate([prompt], params)
    (want,) = Engine(load_model(embedded_model_dir(), dtype=torch.bfloat16),
                     compile=False).generate([prompt], params)
    assert done.output_ids == want.output_ids


_WITHOUT_KERNELS = """
import json, torch
from agentflash.embedded import embedded_model_dir, model_drafter_dir
from agentflash.engine.engine import Engine
from agentflash.engine.models.dflash import load_drafter
from agentflash.engine.models.loader import load_model
from agentflash.engine.sampler import SamplingParams
from agentflash.kernels import cpu_ops

model = load_model(embedded_model_dir(), dtype=torch.bfloat16)
drafter = load_drafter(model_drafter_dir(embedded_model_dir()), model)
engine = Engine(model, drafter=drafter, compile=True)
prompt = [(7 * i + 3) % 4000 for i in range(300)]
params = SamplingParams(max_new_tokens=24, ignore_eos=True)
plain = engine.generate([prompt], params, speculative=False)[0]
spec = engine.generate([prompt], params, reuse=False)[0]  # its prompt computed the same way
print(json.dumps({"loaded": cpu_ops.loaded(), "fast_paths": engine.fast_paths,
                  "kernels": engine.runner.decode.kernels, "drafts": spec.counters.draft_forwards,
                  "head": type(model.lm_head).__name__, "plain": plain.output_ids,
                  "spec": spec.output_ids}))
"""


def test_without_the_cpu_kernels_the_engine_keeps_onednn(tmp_path):
    """Where the kernels do not build or run (a process that never loads them:
    $AGENTFLASH_CPU_KERNELS=0), the compiled step runs without them: the same tokens decoding
    plainly and speculatively through that program, and the head stays oneDNN's."""
    env = {**os.environ, "AGENTFLASH_CPU_KERNELS": "0"}
    run = subprocess.run([sys.executable, "-c", _WITHOUT_KERNELS], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    assert not out["loaded"] and not out["kernels"]
    assert "aoti-compiled-step" in out["fast_paths"] and "cpu-kernels" not in out["fast_paths"]
    if packing_available():
        assert out["head"] == "PackedLinear"
    # plain and speculative decoding through the same program
    assert out["spec"] == out["plain"] and len(out["plain"]) == 24 and out["drafts"] > 0


@CPU_KERNELS.mark
def test_a_drafter_with_a_head_of_its_own_ends_its_forward_in_it(model):
    """The drafter engine.cpu.fastpath makes has a head of its own (int8): with the CPU kernels its
    forward, eager or compiled, ends in that head, so a draft is one call from token ids to
    logits: the head's logits on the forward's hidden states."""
    drafter = load_drafter(model_drafter_dir(embedded_model_dir()), model)
    quantize_drafter_int8(drafter)
    drafter.head = Int8Linear(model.embed_tokens.weight, None, kernel_rows=None, dynamic=True)
    dk, dv, tables, ctx, block, bpos = _two_blocks(model, drafter)
    rows = torch.tensor([1, 2, 3, 17, 18])
    eager, compiled = (DraftForward.eager(model, drafter, 16, PAGE),
                       CompiledDraft.build(model, drafter, 16, page_size=PAGE))
    assert eager.returns_logits and compiled.returns_logits
    attn = eager.attention(dk, dv, tables, ctx, 16, PAGE, drafter)
    logits = eager(block, bpos, attn, rows)
    head, drafter.head = drafter.head, None
    headless = DraftForward.eager(model, drafter, 16, PAGE)
    assert not headless.returns_logits
    hidden = headless(block, bpos, attn, rows)
    drafter.head = head
    assert logits.dtype == torch.float32 and torch.equal(logits, drafter.logits(model, hidden))
    got = compiled(block, bpos, compiled.attention(dk, dv, tables, ctx, 16, PAGE, drafter), rows)
    cos = torch.nn.functional.cosine_similarity(got, logits, dim=-1)
    assert got.shape == logits.shape and cos.min() > 0.999, cos
    # its dynamic int8 layers and head through their C shim (a program that failed to compile
    # them would leave the engine eager, with only a warning)
    wrapper = _wrapper_source(compiled.program)
    assert "aoti_torch_cpu_linear_int8_dynamic(" in wrapper
    assert "proxy_executor_call_function(" not in wrapper


@CPU_KERNELS.mark
def test_a_drafter_whose_attention_takes_the_torch_path_still_ends_in_its_head(model,
                                                                            monkeypatch):
    """A drafter whose attention the kernel cannot take (a windowed layer, a head size it does
    not support) attends through the torch path; with the head engine.cpu.fastpath gives every
    drafter on the CPU kernels, its forward still ends in that head: logits, which the engine
    drafts from, not hidden states."""
    drafter = load_drafter(model_drafter_dir(embedded_model_dir()), model)
    quantize_drafter_int8(drafter)
    drafter.head = Int8Linear(model.embed_tokens.weight, None, kernel_rows=None, dynamic=True)
    monkeypatch.setattr(KernelDraftAttention, "supports", staticmethod(lambda drafter: False))
    run = DraftForward.eager(model, drafter, 16, PAGE)
    assert not run.kernel_attention and run.returns_logits
    dk, dv, tables, ctx, block, bpos = _two_blocks(model, drafter)
    attn = run.attention(dk, dv, tables, ctx, 16, PAGE, drafter)
    rows = torch.tensor([1, 2, 17])
    logits = run(block, bpos, attn, rows)
    head, drafter.head = drafter.head, None
    hidden = DraftForward.eager(model, drafter, 16, PAGE)(block, bpos, attn, rows)
    drafter.head = head
    assert logits.shape == (3, model.config.vocab_size)
    assert torch.equal(logits, drafter.logits(model, hidden))


@CPU_KERNELS.mark
def test_the_drafter_projects_a_blocks_mask_tokens_once(model):
    """Every mask token of a block enters the drafter's first layer with the same input: given
    the block size, the layer projects the anchors and one mask token and rotates them per
    position, and every row is bitwise what projecting all N*B tokens gives (the kernels
    compute each row alone), with bf16 and with int8 drafter weights."""
    drafter = load_drafter(model_drafter_dir(embedded_model_dir()), model)
    dk, dv, tables, ctx, block, bpos = _two_blocks(model, drafter)
    attn = PagedDraftAttention.build(dk, dv, tables, ctx, 16, PAGE, drafter)
    quantized = copy.deepcopy(drafter)
    quantize_drafter_int8(quantized)
    h = drafter.embed_block(model, block)
    outputs = []
    for weights in (drafter, quantized):
        run = kernel_view(weights)
        outputs.append(run(h, bpos, attn))
        projected = []  # rows the first layer's qkv projects
        hook = run.layers[0].self_attn.qkv_proj.register_forward_hook(
            lambda module, args, out: projected.append(args[0].shape[0]))
        assert torch.equal(run(h, bpos, attn, block_size=16), outputs[-1])
        hook.remove()
        assert projected == [3]  # two anchors and one mask token, not 32 tokens
    assert not torch.equal(*outputs)  # the int8 drafter's numbers are its own
