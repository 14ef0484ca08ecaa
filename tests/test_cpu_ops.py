"""agentflash's CPU kernels (kernels.cpu_ops, built for AMX, AVX512-BF16, AVX512 or AVX2): close
to a float32 reference, and each row bitwise independent of what else is in the call (what makes
a verify block's rows the decode steps' rows). Their use in the compiled step:
tests/test_compiled.py, tests/test_embedded.py. On a CPU with a better set, the builds below it
run this file too (in a process that asks for them)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from agentflash.engine.attention import PagedAttention
from agentflash.engine.cpu.attention import KernelAttention
from agentflash.engine.cpu.kernel_linear import (WIDEN_ROWS, KernelLinear, WidenedLinear,
                                                 float32_packing_available, with_kernel_linears)
from agentflash.engine.constraint import masked, masked_choice, pack
from agentflash.engine.errors import RequestError
from agentflash.engine.sampler import top1
from agentflash.kernels import cpu_ops
from skips import CPU_KERNELS, OTHER_CPU_BUILDS, other_cpu_builds

pytestmark = CPU_KERNELS.mark


def _bf16(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


PANELS = cpu_ops.isa() is not None and cpu_ops.isa().name != "avx2"
"""This build has `linear_panels` (every set with AVX512)."""


def _weights(fmt, n, k):
    """(the op as y = f(x, bias, residual), its weight in float32) for a random weight."""
    if fmt == "bf16":
        w = _bf16(n, k, seed=0)
        return (lambda x, b, r=None: cpu_ops.linear(x, w, b, r)), w.float()
    if fmt == "panels":
        w = _bf16(n, k, seed=0)
        panels = cpu_ops.pack_panels(w)
        return (lambda x, b, r=None: cpu_ops.linear_panels(x, panels, n, b, r)), w.float()
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.02 + 0.001
    op = torch.ops.agentflash.linear_int8 if fmt == "int8" else torch.ops.agentflash.linear_int8_dynamic
    return (lambda x, b, r=None: op(x, q, scale, b, r)), q.float() * scale[:, None]


@pytest.mark.parametrize("fmt", ["bf16", *(["panels"] if PANELS else []), "int8", "int8-dynamic"])
@pytest.mark.parametrize("n,k", [(384, 384), (2048, 384), (1024, 3072), (203, 200), (5, 37)])
def test_linear_matches_float32_and_rows_are_independent(fmt, n, k):
    op, w = _weights(fmt, n, k)
    b, x = _bf16(n, seed=1), _bf16(70, k, seed=2)
    y = op(x, b)
    want = torch.nn.functional.linear(x.float(), w, b.float())
    # one bfloat16 rounding of a float32 sum: within bf16's relative step of the largest output
    assert (y.float() - want).abs().max() <= want.abs().max() * 2 ** -7
    # every row count has its own tile up to 7 rows (and a remainder after 8 rows' tiles);
    # on AMX, 64 rows or more take the many-rows tiles (70: two blocks of 32 and a remainder)
    for rows in (slice(0, 1), slice(3, 4), slice(8, 10), slice(8, 11), slice(10, 14),
                 slice(40, 45), slice(64, 70), slice(30, 37), slice(50, 58), slice(5, 21),
                 slice(1, 70)):
        assert torch.equal(op(x[rows], b), y[rows])
    assert torch.equal(op(x.t().contiguous().t(), b), y)  # strided x
    r = _bf16(70, n, seed=4)  # a residual is added before the one rounding
    with_r, want_r = op(x, b, r), want + r.float()
    assert (with_r.float() - want_r).abs().max() <= want_r.abs().max() * 2 ** -7
    assert torch.equal(op(x[5:21], b, r[5:21]), with_r[5:21])
    if fmt in ("bf16", "panels"):  # the Python wrapper takes leading dims
        assert torch.equal(op(x[None, :8], b)[0], y[:8])


def test_panels_are_the_weight_and_refuse_another_shape():
    """`pack_panels`' layout holds every element of W once (zeros past N and K), and
    `linear_panels` refuses panels of another weight's shape, or on the wrong n (and, in the
    build without them, AVX2, any call)."""
    w = _bf16(50, 7, seed=0)
    panels = cpu_ops.pack_panels(w)
    assert panels.shape == (2, 4, 48, 2)
    unpacked = panels.permute(0, 2, 1, 3).reshape(96, 8)
    assert torch.equal(unpacked[:50, :7], w)
    assert not unpacked[50:].any() and not unpacked[:, 7:].any()
    x = _bf16(3, 7, seed=1)
    for bad_x, bad_panels, n in ((x, panels, 97), (_bf16(3, 9, seed=2), panels, 50),
                                 (x, panels.float(), 50), (x, panels[:1], 50)):
        with pytest.raises(RuntimeError, match="panels"):
            cpu_ops.linear_panels(bad_x, bad_panels, n)


@pytest.mark.parametrize("n,k", [(384, 384), (1024, 3072), (203, 200), (5, 37)])
def test_dynamic_int8_linear_is_its_integer_arithmetic_exactly(n, k):
    """linear_int8_dynamic's numbers, bit for bit, in torch: each row of x quantized to Q
    levels of its largest |x| (Q as large as int32 sums of K products allow), the products summed
    exactly, times the weight row's scale and the row's step, rounded once to bfloat16."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.02 + 0.001
    x, bias = _bf16(9, k, seed=1) * 3, _bf16(n, seed=2)
    x[4] = 0  # a row of zeros: all its products are 0
    levels = torch.tensor(float(min(32767, 2147483647 // (128 * ((k + 31) // 32 * 32)))))
    amax = x.float().abs().amax(1, keepdim=True)
    inv = torch.where(amax > 0, levels / amax, torch.zeros_like(amax))
    sums = ((x.float() * inv).round().long() @ q.long().T).float()  # exact; < 2^31
    want = (sums * scale * (amax / levels) + bias.float()).to(torch.bfloat16)
    assert torch.equal(torch.ops.agentflash.linear_int8_dynamic(x, q, scale, bias), want)
    assert torch.equal(cpu_ops.linear_int8(x[None], q, scale, bias, dynamic=True)[0], want)


def test_linear_refuses_what_it_does_not_compute():
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu_ops.linear(torch.randn(2, 64), torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="weight"):
        cpu_ops.linear(_bf16(2, 64, seed=0), _bf16(8, 32, seed=1))


def test_kernel_linears_share_the_weights_and_leave_the_model_as_it_was():
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 8, bias=False)).to(torch.bfloat16)
    fast = with_kernel_linears(model)
    assert isinstance(fast[0], KernelLinear) and fast[0].weight is model[0].weight
    # where the kernels prefer float32 products, each also holds its weight in panels
    assert (fast[0].panels is not None) == cpu_ops.prefer_float32()
    assert isinstance(model[0], torch.nn.Linear)
    x = _bf16(3, 64, seed=3)
    cos = torch.nn.functional.cosine_similarity(fast(x).float(), model(x).float(), dim=-1)
    assert cos.min() > 0.999


def test_a_widened_linear_takes_the_kernel_for_few_rows_and_float32_for_many():
    """The eager bf16 linear where torch emulates bf16 matmuls: decode-sized calls are the
    kernel's rows, prefill chunks float32 on the widened weight, rounded once."""
    w, b = _bf16(96, 64, seed=0), _bf16(96, seed=1)
    layer = WidenedLinear(w, b)
    few, many = _bf16(WIDEN_ROWS, 64, seed=2), _bf16(WIDEN_ROWS + 1, 64, seed=3)
    kernel = KernelLinear(w, b)  # (on its panels where the kernels prefer float32 products)
    assert torch.equal(layer(few), kernel(few))
    want = torch.nn.functional.linear(many.float(), w.float(), b.float()).to(torch.bfloat16)
    assert torch.equal(layer(many), want)
    assert torch.equal(layer(many[None])[0], want)  # leading dimensions
    if float32_packing_available():  # the float32 weight kept in oneDNN's layout
        layer.pack()
        assert torch.equal(layer(few), kernel(few))
        torch.testing.assert_close(layer(many), want, atol=0, rtol=1 / 128)
        assert torch.equal(layer(many[None])[0], layer(many))


@pytest.mark.parametrize("isa,extras", other_cpu_builds() or [pytest.param(
    None, None, marks=OTHER_CPU_BUILDS.mark)])
def test_the_builds_a_cpu_that_has_a_better_one_can_run(isa, extras):
    """Most laptops and older servers have AVX2 (or AVX512) but not AVX512-BF16, and AVX512
    CPUs before Cascade Lake lack VNNI: each build is tested wherever it runs, not only where
    it is the one chosen."""
    env = {**os.environ, "AGENTFLASH_CPU_ISA": isa, "AGENTFLASH_CPU_EXTRAS": str(int(extras))}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          __file__, "-k", "not better_one"], env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1]


def _attention_kernels() -> list[bool | None]:
    """The attention kernels of this build: avx512-bf16's and amx's own (bfloat16 dot products)
    and the float32 one, which `cpu_ops.prefer_float32` picks between; one elsewhere."""
    chosen = cpu_ops.isa()
    return [False, True] if chosen is not None and chosen.name in ("avx512-bf16", "amx") else [None]


@pytest.fixture(params=_attention_kernels(),
                ids=lambda on: {None: "the-set's", False: "bf16-dot", True: "float32"}[on])
def attention_kernel(request):
    """Each of the build's attention kernels in turn (the one this CPU takes restored after)."""
    assert cpu_ops.available()
    if request.param is not None:
        torch.ops.agentflash.set_float32_attention(request.param)
    try:
        yield
    finally:
        torch.ops.agentflash.set_float32_attention(cpu_ops.prefer_float32())


def _reference_attention(q, k_cache, v_cache, table, page, seq, keys, scale):
    out = torch.empty(q.shape)
    group = q.shape[1] // k_cache.shape[1]
    slots = (table[:, :, None] * page + torch.arange(page)).flatten(1)
    for t in range(q.shape[0]):
        s = slots[seq[t], : keys[t]]
        k, v = k_cache[s].float(), v_cache[s].float()
        for h in range(q.shape[1]):
            w = torch.softmax(k[:, h // group] @ q[t, h].float() * scale, 0)
            out[t, h] = w @ v[:, h // group]
    return out


@pytest.mark.usefixtures("attention_kernel")
@pytest.mark.parametrize("heads,kv_heads,dim", [(6, 2, 64), (16, 8, 128), (4, 4, 32)])
def test_attention_matches_float32_and_rows_are_independent(heads, kv_heads, dim):
    k_cache, v_cache = _bf16(4096, kv_heads, dim, seed=0), _bf16(4096, kv_heads, dim, seed=1)
    page = 16  # 3 sequences of 75 pages, shuffled over the cache's 256
    table = torch.randperm(256, generator=torch.Generator().manual_seed(2))[:225].view(3, 75)
    # a verify block of 16 at 1001.., a decode row at 700, 5 queries from 33 (a partial block)
    seq = torch.tensor([0] * 16 + [1] + [2] * 5)
    keys = torch.tensor(list(range(1001, 1017)) + [700] + list(range(33, 38)))
    q = _bf16(len(seq), heads, dim, seed=3)
    scale = 1 / math.sqrt(dim)
    out = cpu_ops.paged_attention(q, k_cache, v_cache, table, page, seq, keys, scale)
    want = _reference_attention(q, k_cache, v_cache, table, page, seq, keys, scale)
    assert (out.float() - want).abs().max() < 0.02
    for t in range(len(seq)):  # each query alone, as a decode step would run it
        alone = cpu_ops.paged_attention(q[t:t + 1], k_cache, v_cache, table, page, seq[t:t + 1],
                                        keys[t:t + 1], scale)
        assert torch.equal(alone[0], out[t])


@pytest.mark.usefixtures("attention_kernel")
def test_attention_is_the_same_however_the_work_is_split():
    """Many sequences (a thread takes whole runs), one (its key segments spread over the
    threads), one thread or two: every query's output is bit for bit the same."""
    page, n = 16, 8
    k_cache, v_cache = _bf16(8192, 8, 128, seed=0), _bf16(8192, 8, 128, seed=1)
    table = torch.randperm(512, generator=torch.Generator().manual_seed(2)).view(n, 64)
    keys = torch.tensor([1, 127, 128, 129, 300, 513, 1000, 1024])  # around segment edges
    q, seq = _bf16(n, 16, 128, seed=3), torch.arange(n)
    threads = torch.get_num_threads()
    try:
        outs = []
        for count in (1, 2):
            torch.set_num_threads(count)
            outs.append(cpu_ops.paged_attention(q, k_cache, v_cache, table, page, seq, keys,
                                                0.088))
            for t in range(n):
                alone = cpu_ops.paged_attention(q[t:t + 1], k_cache, v_cache, table, page,
                                                seq[t:t + 1], keys[t:t + 1], 0.088)
                assert torch.equal(alone[0], outs[-1][t])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    want = _reference_attention(q, k_cache, v_cache, table, page, seq, keys, 0.088)
    assert (outs[0].float() - want).abs().max() < 0.02


@pytest.mark.usefixtures("attention_kernel")
@pytest.mark.parametrize("causal", [False, True])
def test_attention_over_new_rows_is_the_same_as_over_them_in_the_pool(causal):
    """Drafter blocks: keys past each sequence's cached context come from the block's own rows
    (k_new, v_new) instead of the pool. Bit for bit what the kernel gives with those rows stored
    in the pool after the context; and the float32 reference agrees."""
    page, B = 16, 16
    k_cache, v_cache = _bf16(4096, 2, 64, seed=0), _bf16(4096, 2, 64, seed=1)
    table = torch.randperm(256, generator=torch.Generator().manual_seed(2))[:130].view(2, 65)
    ctx = torch.tensor([1000, 37])
    q, k_new, v_new = _bf16(2 * B, 6, 64, seed=3), _bf16(2 * B, 2, 64, seed=4), _bf16(
        2 * B, 2, 64, seed=5)
    seq = torch.arange(2).repeat_interleave(B)
    offsets = torch.arange(1, B + 1).repeat(2) if causal else torch.full((2 * B,), B)
    keys = ctx.repeat_interleave(B) + offsets
    out = cpu_ops.paged_attention(q, k_cache, v_cache, table, page, seq, keys, 0.125, k_new,
                                  v_new, ctx)
    stored_k, stored_v = k_cache.clone(), v_cache.clone()
    for t in range(2 * B):  # the block's rows written where they would sit in the pool
        b, pos = int(seq[t]), int(ctx[seq[t]]) + t % B
        slot = int(table[b, pos // page]) * page + pos % page
        stored_k[slot], stored_v[slot] = k_new[t], v_new[t]
    same = cpu_ops.paged_attention(q, stored_k, stored_v, table, page, seq, keys, 0.125)
    assert torch.equal(out, same)
    # the queries of only some of each block's rows (those whose drafts are verified): those
    # rows of the whole call, bit for bit
    rows = torch.tensor([1, 2, 3, 4, 5, B + 1, B + 2, B + 3, B + 4, B + 5])
    some = cpu_ops.paged_attention(q[rows], k_cache, v_cache, table, page, seq[rows], keys[rows],
                                   0.125, k_new, v_new, ctx)
    assert torch.equal(some, out[rows])
    want = _reference_attention(q, stored_k, stored_v, table, page, seq, keys, 0.125)
    assert (out.float() - want).abs().max() < 0.02
    with pytest.raises(RuntimeError, match="sees 1017 keys"):  # past the block's own rows
        cpu_ops.paged_attention(q, k_cache, v_cache, table, page, seq, keys + 1, 0.125, k_new,
                                v_new, ctx)


@pytest.mark.usefixtures("attention_kernel")
def test_attention_refuses_a_query_past_its_keys_or_pages():
    k_cache, q = _bf16(64, 2, 64, seed=0), _bf16(1, 2, 64, seed=1)
    with pytest.raises(RuntimeError, match="sees 65 keys"):
        cpu_ops.paged_attention(q, k_cache, k_cache, torch.arange(4)[None], 16,
                                torch.tensor([0]), torch.tensor([65]), 0.125)
    with pytest.raises(RuntimeError, match="page 9 of sequence 0 is not in the cache"):
        cpu_ops.paged_attention(q, k_cache, k_cache, torch.tensor([[0, 9]]), 16,
                                torch.tensor([0]), torch.tensor([20]), 0.125)


@pytest.mark.usefixtures("attention_kernel")
def test_kernel_attention_stores_kv_and_agrees_with_the_torch_path():
    """Two sequences on their own pages, decode row and verify block: the new K/V land in their
    slots, and the outputs agree with PagedAttention's to bfloat16 rounding."""
    pages, page = 40, 16
    k0, v0 = _bf16(pages * page, 2, 64, seed=0), _bf16(pages * page, 2, 64, seed=1)
    tables, ctx_lens, num_new = [list(range(0, 20)), list(range(39, 19, -1))], [300, 250], [1, 5]
    q, k, v = _bf16(6, 6, 64, seed=2), _bf16(6, 2, 64, seed=3), _bf16(6, 2, 64, seed=4)
    caches = ([k0.clone()], [v0.clone()])
    kernel = KernelAttention.build(*caches, tables, ctx_lens, num_new, page, 0.125)
    out = kernel.attend(0, q, k, v)
    torch_caches = ([k0.clone()], [v0.clone()])
    want = PagedAttention.build(*torch_caches, tables, ctx_lens, num_new, page,
                                0.125).attend(0, q, k, v)
    assert torch.equal(caches[0][0], torch_caches[0][0])
    assert torch.equal(caches[1][0], torch_caches[1][0])
    assert (out.float() - want.float()).abs().max() < 0.02
    slot = tables[1][249 // page] * page + 249 % page  # sequence 1's last new token
    assert torch.equal(caches[0][0][slot], k[5])


@pytest.mark.parametrize("shape", [(1, 4096), (6, 4096), (2, 3, 4096), (3, 7), (5, 2)])
def test_top1_is_torch_argmax_and_the_softmax_there(shape, monkeypatch):
    logits = torch.randn(*shape, generator=torch.Generator().manual_seed(3)) * 4
    logits[..., 1] = logits[..., 0] = logits.amax(-1)  # a tie: the first index wins
    assert cpu_ops.loaded()  # engine.sampler.top1 takes the kernel
    index, prob = top1(logits, with_prob=True)
    assert index == logits.argmax(-1).tolist()
    want = (logits.amax(-1) - logits.logsumexp(-1)).exp()
    assert torch.allclose(torch.tensor(prob), want, rtol=1e-5, atol=0)
    assert top1(logits) == (index, None)
    strided = logits.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert top1(strided) == (index, None)
    monkeypatch.setattr(cpu_ops, "_loaded", False)  # the torch path where the ops are not loaded
    torch_index, torch_prob = top1(logits, with_prob=True)
    assert torch_index == index
    assert torch.allclose(torch.tensor(torch_prob), torch.tensor(prob), rtol=1e-5, atol=0)


@pytest.mark.parametrize("vocab", [4096, 70, 5])
def test_masked_top1_is_torch_argmax_of_the_masked_row(vocab, monkeypatch):
    """The greedy token under a packed grammar mask (engine.constraint.masked_choice): as
    `masked(row, mask).argmax()`, ties to the first allowed index, tokens past a short mask
    refused, a row allowing nothing -1 (the request's error)."""
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(8, vocab, generator=g) * 4
    rows[:, 1] = rows[:, 3] = rows.amax(-1) + 1  # a tie: the first allowed wins
    rows[2, :vocab // 2] = float("-inf")
    words = -(-vocab // 32) - (vocab == 70)  # 70 tokens, 2 words: tokens 64.. never allowed
    sets = torch.rand(8, words * 32, generator=g) < torch.tensor(
        [0.5, 0.02, 0.9, 1.0, 0.1, 0.5, 0.5, 0.0]).unsqueeze(1)
    sets[5, 1] = False  # the tie's first refused: the second wins
    if vocab >= 96:  # a tie across two whole words of allowed tokens: the first wins
        sets[6, 32:96] = True
        rows[6, 40] = rows[6, 70] = rows[6].amax() + 2
    masks = torch.stack([pack(m) for m in sets])
    got = cpu_ops.masked_top1(rows, masks).tolist()
    for r in range(8):
        if not sets[r, :vocab].any():
            assert got[r] == -1
            with pytest.raises(RequestError):
                masked_choice(rows[r], masks[r])
            continue
        want = int(masked(rows[r], masks[r]).argmax())
        assert got[r] == want and sets[r, want]
        assert masked_choice(rows[r], masks[r]) == want
        monkeypatch.setattr(cpu_ops, "_loaded", False)  # the torch path
        assert masked_choice(rows[r], masks[r]) == want
        monkeypatch.setattr(cpu_ops, "_loaded", True)


def test_top1_treats_nan_and_masked_rows_as_torch_does():
    rows = torch.randn(3, 40, generator=torch.Generator().manual_seed(4))
    rows[1, 13] = rows[1, 17] = float("nan")  # the first NaN is the argmax
    rows[2] = float("-inf")                     # a row masked whole: index 0, probability NaN
    index, prob = cpu_ops.top1(rows, True)
    assert index.tolist() == rows.argmax(-1).tolist() == [index[0].item(), 13, 0]
    assert not math.isnan(prob[0].item()) and math.isnan(prob[1].item())
    assert math.isnan(prob[2].item())
    with pytest.raises(RuntimeError, match="float32"):
        cpu_ops.top1(rows.bfloat16(), False)
