"""engine.attention.PagedAttention over scattered pages against naive causal attention, with
batches that mix decode steps, verify blocks and prefill chunks (padded in separate groups; a
long chunk in blocks of queries or in one call), and
the bfloat16 decode/verify path's promise: a query's output is bitwise the same alone (a decode
step) as in a verify block, which is what keeps speculative greedy output equal to plain."""

from __future__ import annotations

import pytest
import torch

from agentflash.engine.attention import PagedAttention
from agentflash.kernels import torch_ops

PAGE = 4


def naive(q_all, k_all, v_all, scale):
    """Causal attention of each query over keys 0..its position, float64, one sequence."""
    t, hq, _ = q_all.shape
    group = hq // k_all.shape[1]
    out = torch.zeros(q_all.shape, dtype=torch.float64)
    for i in range(t):
        for h in range(hq):
            s = k_all[: i + 1, h // group].double() @ q_all[i, h].double() * scale
            out[i, h] = s.softmax(0) @ v_all[: i + 1, h // group].double()
    return out


@pytest.mark.parametrize("causal_block", [8, torch_ops.CAUSAL_BLOCK])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_new", [[1, 40, 5, 1], [3, 3], [1, 1, 1], [37], [16, 1, 33, 2]])
def test_mixed_batches_match_naive(num_new: list[int], dtype: torch.dtype, causal_block: int,
                                   monkeypatch) -> None:
    monkeypatch.setattr(torch_ops, "KEY_CHUNK", 8)  # several chunks on these short contexts
    # a prefill chunk of 24 or more queries in blocks of 8 (SDPA over each block's keys)
    monkeypatch.setattr(torch_ops, "CAUSAL_BLOCK", causal_block)
    g = torch.Generator().manual_seed(len(num_new))
    hq, hkv, d, pages = 4, 2, 8, 128
    ctx_lens = [n + int(torch.randint(0, 30, (1,), generator=g)) for n in num_new]
    perm = torch.randperm(pages, generator=g).tolist()  # scattered page tables
    tables, used = [], 0
    for n in ctx_lens:
        count = -(-n // PAGE)
        tables.append(perm[used:used + count])
        used += count
    k_cache = torch.zeros(pages * PAGE, hkv, d, dtype=dtype)
    v_cache = torch.zeros(pages * PAGE, hkv, d, dtype=dtype)
    full = []  # per sequence: q, k, v of all its positions
    for table, n in zip(tables, ctx_lens):
        q, k, v = (torch.randn(n, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
        slots = torch.tensor([table[j // PAGE] * PAGE + j % PAGE for j in range(n)])
        k_cache[slots], v_cache[slots] = k, v  # the context already cached
        full.append((q, k, v))
    scale = d ** -0.5
    attn = PagedAttention.build([k_cache], [v_cache], tables, ctx_lens, num_new, PAGE, scale)
    q = torch.cat([fq[-n:] for (fq, _, _), n in zip(full, num_new)])
    k = torch.cat([fk[-n:] for (_, fk, _), n in zip(full, num_new)])
    v = torch.cat([fv[-n:] for (_, _, fv), n in zip(full, num_new)])
    out = attn.attend(0, q, k, v)
    want = torch.cat([naive(*f, scale)[-n:] for f, n in zip(full, num_new)])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("chunk", [256, 16])
@pytest.mark.parametrize("context", [200, 250, 700])
def test_bfloat16_decode_rows_are_bitwise_verify_rows(chunk: int, context: int,
                                                      monkeypatch) -> None:
    """The same queries over the same cache: 16 one-query steps (each seeing only the pages up
    to its position, as plain decoding does) against one 16-query verify block, on the shapes
    of the embedded model (6 query heads, 2 KV heads of 64). Blocks that cross a chunk border
    are included. SDPA's CPU kernel fails this (a few elements per block differ by an ulp)."""
    monkeypatch.setattr(torch_ops, "KEY_CHUNK", chunk)
    g = torch.Generator().manual_seed(context)
    hq, hkv, d, page = 6, 2, 64, 16
    total = context + 16
    pages = -(-total // page)
    table = torch.randperm(pages + 8, generator=g)[:pages].tolist()
    k_cache = torch.randn((pages + 8) * page, hkv, d, generator=g).to(torch.bfloat16)
    v_cache = torch.randn((pages + 8) * page, hkv, d, generator=g).to(torch.bfloat16)
    q = torch.randn(16, hq, d, generator=g).to(torch.bfloat16)
    k_new, v_new = k_cache[:16].clone(), v_cache[:16].clone()  # the block's own K/V
    scale = d ** -0.5
    block = PagedAttention.build([k_cache], [v_cache], [table], [total], [16], page, scale)
    verify = block.attend(0, q, k_new, v_new)
    for i in range(16):
        n = context + i + 1
        step = PagedAttention.build([k_cache], [v_cache], [table[: -(-n // page)]], [n], [1],
                                    page, scale)
        decode = step.attend(0, q[i:i + 1], k_new[i:i + 1], v_new[i:i + 1])
        assert torch.equal(decode[0], verify[i]), f"query {i} differs"
