"""Triton attention kernels against their torch references (compiled on CUDA, else in Triton's
CPU interpreter): odd shapes (page sizes, context lengths off the tile, decode / verify / prefill query counts,
GQA 1/2/4, head_dim 16/32) in float32 and bfloat16, then the engine's greedy tokens with
`dispatch.use("triton")` equal to `use("reference")`, with and without a DFlash drafter."""

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

from agentflash.engine.attention import PagedAttention  # noqa: E402
from agentflash.engine.config import CacheConfig, SpecConfig  # noqa: E402
from agentflash.engine.engine import Engine  # noqa: E402
from agentflash.engine.models.dflash import load_drafter  # noqa: E402
from agentflash.engine.models.loader import load_model  # noqa: E402
from agentflash.engine.sampler import SamplingParams  # noqa: E402
from agentflash.kernels import dispatch, reference, triton_attention  # noqa: E402
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
        got = triton_attention.paged_attention(*args)
        want = reference.paged_attention(*args)
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), atol=ATOL[dtype], rtol=0)


def test_paged_attention_without_mask() -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(6, 4, 16, generator=g).to(DEVICE)
    k_cache, v_cache = (torch.randn(50, 2, 16, generator=g).to(DEVICE) for _ in range(2))
    gather = torch.randint(0, 50, (2, 35), generator=g).to(DEVICE)
    q_index = torch.arange(6, device=DEVICE).view(2, 3)
    args = (q, k_cache, v_cache, gather, q_index, None, None, 0.3)
    torch.testing.assert_close(triton_attention.paged_attention(*args),
                               reference.paged_attention(*args), atol=1e-4, rtol=0)


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
    got = triton_attention.draft_attention(*args)
    want = reference.draft_attention(*args)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=ATOL[dtype], rtol=0)


def test_head_dim_must_be_a_power_of_two() -> None:
    q = torch.zeros(1, 2, 24)
    cache = torch.zeros(4, 2, 24)
    with pytest.raises(AssertionError, match="head_dim"):
        triton_attention.paged_attention(q, cache, cache, torch.zeros(1, 4, dtype=torch.long),
                                         torch.zeros(1, 1, dtype=torch.long), None, None, 1.0)


def test_dispatch_registers_triton_and_auto_keeps_cpu_on_reference(backend) -> None:
    backend("auto")
    assert dispatch._pick("paged_attention", "cpu") is reference.paged_attention
    assert dispatch._pick("draft_attention", "cuda") is triton_attention.draft_attention
    backend("triton")
    assert dispatch._pick("paged_attention", "cpu") is triton_attention.paged_attention
    assert dispatch._pick("store_kv", "cpu") is reference.store_kv  # no Triton store_kv


def test_engine_greedy_tokens_equal_reference(tmp_path, backend, monkeypatch) -> None:
    backend("triton")  # registers the Triton kernels, which are then wrapped to count calls
    calls = {"paged_attention": 0, "draft_attention": 0}
    for name in calls:
        def counted(*args, _fn=getattr(triton_attention, name), _name=name):
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
        for name in ("reference", "triton"):
            backend(name)
            engine = Engine(model, CacheConfig(4, 128), drafter=d, spec=SpecConfig(4))
            outputs.append([c.output_ids for c in engine.generate(prompts, params)])
        assert outputs[0] == outputs[1], d
        assert all(len(o) == 6 for o in outputs[0])
    assert calls["paged_attention"] > 0 and calls["draft_attention"] > 0, calls
