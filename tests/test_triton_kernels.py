"""Triton kernels against their torch references (compiled on CUDA, else in Triton's CPU
interpreter): attention on odd shapes (page sizes, context lengths off the tile, decode / verify /
prefill query counts, GQA 1/2/4, head_dim 16/32) in float32 and bfloat16; verification (greedy
with ties, sampling) on ragged batches and vocabularies off the tile; the drafter's context K/V
store. Then the engine's greedy tokens with `dispatch.use("triton")` equal `use("torch")`,
with and without a DFlash drafter, and its sampling through the Triton accept kernel stays
inside the sampling support."""

from __future__ import annotations

import os

import torch  # does not import triton

# Without CUDA the kernels run in Triton's interpreter on CPU tensors. The switch is read when
# triton and the kernels are imported, so it is set here, before anything imports them
# (kernels.dispatch imports triton only on first need).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"

import pytest  # noqa: E402

tl = pytest.importorskip("triton.language", reason="triton is not installed")

from agentflash.engine.attention import DenseCausal, PagedAttention  # noqa: E402
from agentflash.engine.config import CacheConfig, SpecConfig  # noqa: E402
from agentflash.engine.engine import Engine  # noqa: E402
from agentflash.engine.models.dflash import load_drafter  # noqa: E402
from agentflash.engine.models.loader import load_model  # noqa: E402
from agentflash.engine.sampler import SamplingParams  # noqa: E402
from agentflash.kernels import (  # noqa: E402
    dispatch, reference, torch_ops, triton_accept, triton_attention, triton_context_kv,
)
from conftest import make_dflash_checkpoint, make_hf_model  # noqa: E402

ATOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}

# triton's own jitted helpers (tl.sum, tl.max) are decorated when triton is first imported
if DEVICE == "cpu" and type(tl.sum).__name__ != "InterpretedFunction":
    pytest.skip("triton was imported before TRITON_INTERPRET was set; run this file on its own",
                allow_module_level=True)


@pytest.fixture
def backend():
    yield dispatch.use
    dispatch.use("auto")


# (page size, new tokens per sequence, query heads, KV heads, head_dim, dtype)
PAGED_CASES = [
    (4, [1, 1, 1], 2, 2, 16, torch.float32),        # decode, MHA
    (3, [5, 16], 4, 2, 32, torch.float32),          # verify blocks, padded group (out_index)
    (5, [1, 3, 37], 4, 1, 16, torch.bfloat16),      # decode + verify + prefill, GQA 4
    (16, [9, 2], 8, 2, 32, torch.bfloat16),         # one big page, GQA 4
]


@pytest.mark.parametrize("page,num_new,hq,hkv,d,dtype", PAGED_CASES)
def test_paged_attention_matches_reference(page, num_new, hq, hkv, d, dtype) -> None:
    g = torch.Generator().manual_seed(page * 100 + len(num_new))
    ctx_lens = [n + int(torch.randint(0, 40, (1,), generator=g)) for n in num_new]
    n_pages = sum(-(-n // page) for n in ctx_lens) + 3
    perm = torch.randperm(n_pages, generator=g).tolist()  # scattered page tables
    tables, used = [], 0
    for n in ctx_lens:
        tables.append(perm[used:used + -(-n // page)])
        used += len(tables[-1])
    k_cache = torch.randn(n_pages * page, hkv, d, generator=g).to(DEVICE, dtype)
    v_cache = torch.randn(n_pages * page, hkv, d, generator=g).to(DEVICE, dtype)
    q = torch.randn(sum(num_new), hq, d, generator=g).to(DEVICE, dtype)
    attn = PagedAttention.build([k_cache], [v_cache], tables, ctx_lens, num_new, page, d ** -0.5)
    assert len(attn.groups) == len({0 if n == 1 else 1 if n <= 32 else 2 for n in num_new})
    for grp in attn.groups:
        args = (q[grp.rows], k_cache, v_cache, grp.gather, grp.q_index, grp.out_index, grp.mask,
                attn.scale)
        want = reference.paged_attention(*args)
        for impl in (triton_attention.paged_attention, torch_ops.paged_attention):
            got = impl(*args)
            assert got.dtype == dtype and got.shape == want.shape
            torch.testing.assert_close(got.cpu().double(), want, atol=ATOL[dtype], rtol=0)


def test_paged_attention_without_mask() -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(6, 4, 16, generator=g).to(DEVICE)
    k_cache, v_cache = (torch.randn(50, 2, 16, generator=g).to(DEVICE) for _ in range(2))
    gather = torch.randint(0, 50, (2, 35), generator=g).to(DEVICE)
    q_index = torch.arange(6, device=DEVICE).view(2, 3)
    args = (q, k_cache, v_cache, gather, q_index, None, None, 0.3)
    want = reference.paged_attention(*args)
    for impl in (triton_attention.paged_attention, torch_ops.paged_attention):
        torch.testing.assert_close(impl(*args).cpu().double(), want, atol=1e-4, rtol=0)


# (block, query heads, KV heads, head_dim, dtype); context lengths 0, short, and 40 (past a
# 32-key tile, so a window of 3 skips the first context tile)
DRAFT_CASES = [(4, 4, 2, 16, torch.float32), (16, 4, 1, 32, torch.bfloat16)]
KINDS = [(False, None), (True, None), (True, 3)]


@pytest.mark.parametrize("kind", KINDS, ids=["full", "causal", "window3"])
@pytest.mark.parametrize("block,hq,hkv,d,dtype", DRAFT_CASES)
def test_draft_attention_matches_reference(block, hq, hkv, d, dtype, kind) -> None:
    g = torch.Generator().manual_seed(block)
    ctx_lens = torch.tensor([0, 5, 40], device=DEVICE)
    n, ctx = len(ctx_lens), 40
    q = torch.randn(n, block, hq, d, generator=g).to(DEVICE, dtype)
    k_ctx, v_ctx = (torch.randn(n, ctx, hkv, d, generator=g).to(DEVICE, dtype) for _ in range(2))
    k_blk, v_blk = (torch.randn(n, block, hkv, d, generator=g).to(DEVICE, dtype)
                    for _ in range(2))
    args = (q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, d ** -0.5, *kind)
    want = reference.draft_attention(*args)
    for impl in (triton_attention.draft_attention, torch_ops.draft_attention):
        got = impl(*args)
        assert got.dtype == dtype
        torch.testing.assert_close(got.cpu().double(), want, atol=ATOL[dtype], rtol=0)


def ragged_blocks(g: torch.Generator, n: int, width: int) -> tuple[torch.Tensor, ...]:
    """row_start, num_drafts [n] of a packed batch of blocks (0 .. width drafts each)."""
    num = torch.randint(0, width + 1, (n,), generator=g)
    start = torch.cat([torch.zeros(1, dtype=torch.long), (num + 1).cumsum(0)[:-1]])
    return start, num


# (sequences, padded draft width, vocabulary): vocabularies below, at and past a 1024 tile
ACCEPT_CASES = [(1, 0, 7), (4, 3, 1024), (6, 15, 2500)]


@pytest.mark.parametrize("n,width,vocab", ACCEPT_CASES)
def test_accept_greedy_matches_reference(n, width, vocab) -> None:
    g = torch.Generator().manual_seed(vocab)
    start, num = ragged_blocks(g, n, width)
    rows = int((num + 1).sum())
    logits = torch.randint(0, 3, (rows, vocab), generator=g).float()  # many ties: first wins
    logits[0, -1] = 5.0                                                 # a maximum in the last tile
    choice = logits.argmax(-1)
    drafts = torch.randint(0, vocab, (n, width), generator=g)
    for i in range(n):  # drafts mostly agree with the target, so some blocks accept a lot
        for k in range(width):
            if torch.rand((), generator=g) < 0.85:
                drafts[i, k] = choice[min(int(start[i]) + k, rows - 1)]
    layout = torch.stack([start, num], dim=1)  # strided views, as the engine passes them
    args = [t.to(DEVICE) for t in (logits, layout[:, 0], layout[:, 1], drafts)]
    want = reference.accept_greedy(*args)
    for impl in (triton_accept.accept_greedy, torch_ops.accept_greedy):
        assert torch.equal(impl(*args).cpu(), want)
    accepted = want[:, 0].cpu()
    assert (accepted <= num).all() and (width == 0 or accepted.max() > 0)
    for i in range(n):  # the reference itself: longest agreeing prefix, then the next argmax
        a = int(accepted[i])
        rows_i = choice[int(start[i]):int(start[i]) + int(num[i]) + 1].tolist()
        assert drafts[i, :a].tolist() == rows_i[:a]
        assert a == num[i] or drafts[i, a] != rows_i[a]
        assert int(want[i, 1]) == rows_i[a]


@pytest.mark.parametrize("n,width,vocab", ACCEPT_CASES)
def test_accept_sample_matches_reference(n, width, vocab) -> None:
    g = torch.Generator().manual_seed(vocab + 1)
    start, num = ragged_blocks(g, n, width)
    rows = int((num + 1).sum())
    # dyadic probabilities (k / 2^12) with zeros: every partial sum is exact in float32, so both
    # implementations invert the same cumulative sums bit for bit
    draws = torch.randint(0, vocab, (rows, 4096), generator=g)
    probs = torch.stack([torch.bincount(d, minlength=vocab) for d in draws]).float() / 4096
    drafts = torch.stack([torch.multinomial(probs[int(s)], max(width, 1), replacement=True,
                                            generator=g)[:width] for s in start])
    uniforms = torch.rand(n, width + 1, generator=g)
    args = [t.to(DEVICE) for t in (probs, start, num, drafts, uniforms)]
    want = reference.accept_sample(*args)
    for impl in (triton_accept.accept_sample, torch_ops.accept_sample):
        assert torch.equal(impl(*args).cpu(), want)
    for i in range(n):
        a, bonus = int(want[i, 0]), int(want[i, 1])
        row = int(start[i]) + a
        assert probs[row, bonus] > 0
        if a < num[i]:  # the rejected draft is never the bonus
            assert bonus != int(drafts[i, a])


@pytest.mark.parametrize("n,width,vocab", ACCEPT_CASES)
def test_accept_sample_with_a_draft_distribution_matches_reference(n, width, vocab) -> None:
    """Drafts drawn from q over K candidates (a DFlash2 selector): the Triton kernel and the torch
    ops = the float64 oracle, and a one-hot q gives what no q gives."""
    g = torch.Generator().manual_seed(vocab + 2)
    start, num = ragged_blocks(g, n, width)
    rows = int((num + 1).sum())
    draws = torch.randint(0, vocab, (rows, 4096), generator=g)
    probs = torch.stack([torch.bincount(d, minlength=vocab) for d in draws]).float() / 4096
    top = min(3, vocab)
    q_ids = torch.stack([torch.randperm(vocab, generator=g)[:top]
                         for _ in range(n * max(width, 1))]).view(n, max(width, 1), top)[:, :width]
    # dyadic too (k / 64): p - q and every partial sum are exact, as in the test above
    cuts = torch.sort(torch.randint(1, 64, (*q_ids.shape[:2], top - 1), generator=g), -1).values
    edges = torch.cat([torch.zeros(*q_ids.shape[:2], 1), cuts.float(),
                       torch.full((*q_ids.shape[:2], 1), 64.0)], -1)
    q_probs = (edges[..., 1:] - edges[..., :-1]) / 64
    pick = torch.multinomial(q_probs.reshape(-1, top), 1, generator=g).view(n, width)
    drafts = q_ids.gather(2, pick[..., None])[..., 0]
    uniforms = torch.rand(n, width + 1, generator=g)
    args = [t.to(DEVICE) for t in (probs, start, num, drafts, uniforms)]
    q = [t.to(DEVICE) for t in (q_probs, q_ids)]
    want = reference.accept_sample(*args, *q)
    for impl in (triton_accept.accept_sample, torch_ops.accept_sample):
        assert torch.equal(impl(*args, *q).cpu(), want)
        one_hot = [torch.ones(n, width, 1).to(DEVICE), drafts[..., None].to(DEVICE)]
        assert torch.equal(impl(*args, *one_hot).cpu(), reference.accept_sample(*args))
    if width:  # q changes verdicts: one-hot drafts are rejected more often
        assert not torch.equal(want, reference.accept_sample(*args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False], ids=["k_norm", "no_norm"])
def test_store_context_kv_matches_reference(dtype, norm) -> None:
    g = torch.Generator().manual_seed(7)
    tokens, heads, d, slots_total, max_pos = 7, 3, 32, 40, 100
    k, v = (torch.randn(tokens, heads, d, generator=g).to(DEVICE, dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(d, generator=g)).to(DEVICE, dtype) if norm else None
    angles = torch.rand(max_pos, d // 2, generator=g) * 6
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    positions = torch.randint(0, max_pos, (tokens,), generator=g).to(DEVICE)
    slots = torch.randperm(slots_total, generator=g)[:tokens].to(DEVICE)
    impls = (reference.store_context_kv, torch_ops.store_context_kv,
             triton_context_kv.store_context_kv)
    caches = [[torch.zeros(slots_total, heads, d, dtype=dtype, device=DEVICE) for _ in range(2)]
              for _ in impls]
    for fn, (kc, vc) in zip(impls, caches):
        fn(k, v, weight, 1e-6, cos, sin, positions, slots, kc, vc)
    (k_want, v_want), *others = caches
    # the torch ops round to bfloat16 after each op, the oracle and the kernel once: a few
    # units in the last place
    rtol = 0 if dtype == torch.float32 else 2 ** -6
    untouched = torch.ones(slots_total, dtype=torch.bool)
    untouched[slots.cpu()] = False
    for k_got, v_got in others:
        torch.testing.assert_close(k_got.float(), k_want.float(), atol=ATOL[dtype], rtol=rtol)
        assert torch.equal(v_got, v_want)
        assert not k_got[untouched.to(DEVICE)].any()  # nothing written outside the slots


def test_head_dim_must_be_a_power_of_two() -> None:
    q = torch.zeros(1, 2, 24)
    cache = torch.zeros(4, 2, 24)
    with pytest.raises(AssertionError, match="head_dim"):
        triton_attention.paged_attention(q, cache, cache, torch.zeros(1, 4, dtype=torch.long),
                                         torch.zeros(1, 1, dtype=torch.long), None, None, 1.0)


def test_dispatch_registers_triton_and_auto_keeps_cpu_on_reference(backend) -> None:
    backend("auto")
    assert dispatch._pick("paged_attention", "cpu") is torch_ops.paged_attention
    assert dispatch._pick("draft_attention", "cuda") is triton_attention.draft_attention
    backend("triton")
    assert dispatch._pick("paged_attention", "cpu") is triton_attention.paged_attention
    assert dispatch._pick("store_kv", "cpu") is torch_ops.store_kv  # no Triton store_kv
    for name in ("accept_greedy", "accept_sample", "store_context_kv"):
        assert dispatch._pick(name, "cpu").__module__.endswith(("triton_accept",
                                                                "triton_context_kv"))


def test_engine_greedy_tokens_equal_reference(tmp_path, backend, monkeypatch) -> None:
    backend("triton")  # registers the Triton kernels, which are then wrapped to count calls
    calls = {"paged_attention": 0, "draft_attention": 0, "accept_greedy": 0,
             "store_context_kv": 0}
    for name in calls:
        def counted(*args, _fn=dispatch._BACKENDS["triton"][name], _name=name):
            calls[_name] += 1
            return _fn(*args)
        monkeypatch.setitem(dispatch._BACKENDS["triton"], name, counted)
    hf = make_hf_model("qwen3", vocab_size=64, bos_token_id=None, eos_token_id=None)
    hf.save_pretrained(tmp_path / "target")
    model = load_model(tmp_path / "target", dtype=torch.float32, device=DEVICE)
    make_dflash_checkpoint(tmp_path / "draft", hf.config, num_layers=2, block_size=4,
                           layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    drafter = load_drafter(tmp_path / "draft", model)
    prompts = [[1, 2, 3], list(range(5, 30)), [7] * 9]
    params = SamplingParams(max_new_tokens=6)
    for d in (None, drafter):
        outputs = []
        for name in ("torch", "triton"):
            backend(name)
            engine = Engine(model, CacheConfig(4, 128), drafter=d, spec=SpecConfig(4),
                            speculation="always")
            outputs.append([c.output_ids for c in engine.generate(prompts, params)])
        assert outputs[0] == outputs[1], d
        assert all(len(o) == 6 for o in outputs[0])
    assert all(calls.values()), calls


def test_engine_sampling_through_triton_accept(tmp_path, backend) -> None:
    """Speculative sampling with the Triton accept kernel: seeded runs repeat, tokens stay in the
    top-k support at every position, and drafts get accepted."""
    backend("triton")
    hf = make_hf_model("qwen3", vocab_size=8, bos_token_id=None, eos_token_id=None)
    hf.save_pretrained(tmp_path / "target")
    model = load_model(tmp_path / "target", dtype=torch.float32, device=DEVICE)
    make_dflash_checkpoint(tmp_path / "draft", hf.config, num_layers=1, block_size=4)
    drafter = load_drafter(tmp_path / "draft", model)
    params = [SamplingParams(temperature=0.8, top_k=2, seed=s, max_new_tokens=6) for s in range(4)]
    prompt = [3, 1, 4, 1, 5]  # a small vocabulary, so that a random drafter gets accepted
    runs = []
    for _ in range(2):
        engine = Engine(model, CacheConfig(4, 256), drafter=drafter, spec=SpecConfig(4),
                        speculation="always")
        runs.append([c.output_ids for c in engine.generate([prompt] * 4, params)])
    assert runs[0] == runs[1] and len(set(map(tuple, runs[0]))) > 1
    assert engine.counters.accepted_tokens > 0
    for out in runs[0]:  # every token is one of the target's top 2 after its prefix
        ids = prompt + out
        with torch.no_grad():
            hidden = model(torch.tensor(ids, device=DEVICE), torch.arange(len(ids), device=DEVICE),
                           DenseCausal([len(ids)], model.attention_scale)).hidden
        logits = model.logits(hidden)
        top2 = logits[len(prompt) - 1:-1].topk(2, dim=-1).indices.tolist()
        assert all(t in top for t, top in zip(out, top2))
