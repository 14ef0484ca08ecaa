"""engine.attention.PagedAttention over scattered pages against naive causal attention, with
batches that mix decode steps, verify blocks and prefill chunks (padded in separate groups)."""

from __future__ import annotations

import pytest
import torch

from agentflash.engine.attention import PagedAttention

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


@pytest.mark.parametrize("num_new", [[1, 40, 5, 1], [3, 3], [1, 1, 1], [37], [16, 1, 33, 2]])
def test_mixed_batches_match_naive(num_new: list[int]) -> None:
    g = torch.Generator().manual_seed(len(num_new))
    hq, hkv, d, pages = 4, 2, 8, 128
    ctx_lens = [n + int(torch.randint(0, 30, (1,), generator=g)) for n in num_new]
    perm = torch.randperm(pages, generator=g).tolist()  # scattered page tables
    tables, used = [], 0
    for n in ctx_lens:
        count = -(-n // PAGE)
        tables.append(perm[used:used + count])
        used += count
    k_cache = torch.zeros(pages * PAGE, hkv, d)
    v_cache = torch.zeros(pages * PAGE, hkv, d)
    full = []  # per sequence: q, k, v of all its positions
    for table, n in zip(tables, ctx_lens):
        q, k, v = (torch.randn(n, h, d, generator=g) for h in (hq, hkv, hkv))
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
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
