"""The engine's kernels in torch: what runs on the CPU, and wherever no Triton kernel is
registered (kernels.dispatch). Paged attention's bfloat16 decode/verify rows take a chunked,
row-invariant path (`_chunked_attention`); the rest are direct torch. kernels.reference holds
the oracles they are tested against."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


INVARIANT_MAX_QUERIES = 32
"""bfloat16 groups with at most this many queries per sequence (decode rows, verify blocks)
take the chunked path of `paged_attention`; longer ones (prefill chunks) and float32 take SDPA."""

KEY_CHUNK = 256
"""Keys per chunk of the chunked path; chunk c holds keys c*KEY_CHUNK .. (c+1)*KEY_CHUNK - 1."""


class ChunkPlan(NamedTuple):
    """The layout `_chunked_attention` reads, built once per forward and shared by every layer
    (all layers have the same page tables, lengths and KV head count). Tensors only, so a
    compiled forward takes it as input (engine.cpu.compiled)."""

    kv_index: torch.Tensor   # [B, Hkv, n, C] rows of a cache viewed as [S*Hkv, D]: each
                             # sequence's keys head by head, padded to whole chunks of C keys
    visible: torch.Tensor    # [B, n, Q, C] True: query may see the key


def chunk_plan(gather: torch.Tensor, mask: torch.Tensor | None, q_len: int, n_kv: int
               ) -> ChunkPlan:
    """The ChunkPlan of `paged_attention`'s gather [B, L] and mask [B, 1, Q, L] (None: all
    visible) for caches with `n_kv` KV heads."""
    batch, keys = gather.shape
    chunks = -(-keys // KEY_CHUNK)
    pad = chunks * KEY_CHUNK - keys
    visible = (torch.ones(batch, q_len, keys, dtype=torch.bool, device=gather.device)
               if mask is None else mask[:, 0])
    if pad:
        gather = F.pad(gather, (0, pad), value=0)
        visible = F.pad(visible, (0, pad), value=False)
    visible = visible.view(batch, q_len, chunks, KEY_CHUNK).transpose(1, 2).contiguous()
    heads = torch.arange(n_kv, device=gather.device)
    kv_index = gather.view(batch, 1, chunks, KEY_CHUNK) * n_kv + heads[None, :, None, None]
    return ChunkPlan(kv_index, visible)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    gather: torch.Tensor,
    q_index: torch.Tensor,
    out_index: torch.Tensor | None,
    mask: torch.Tensor | None,
    scale: float,
    plan: ChunkPlan | None = None,
) -> torch.Tensor:
    """Attention of a flattened batch of queries over paged K/V.

    q        [T, Hq, D]   queries of all sequences, flattened
    k_cache  [S, Hkv, D]  one layer's key slots (S = pages * page_size); v_cache likewise
    gather   [B, L]       slot index of each sequence's key j (padding points at any valid slot)
    q_index  [B, Q]       row of q for each (sequence, query) pair; T means padding
    out_index [T]         row of the flattened [B*Q] output holding each query (None: identity)
    mask     [B, 1, Q, L] True where query may see key (None: all visible)
    plan                  `chunk_plan` of gather/mask, when the caller built it once for all
                          layers (bfloat16 decode/verify groups); made here when needed and None
    returns  [T, Hq, D]

    In bfloat16, decode rows and verify blocks (Q <= INVARIANT_MAX_QUERIES) go through
    `_chunked_attention`, whose result for a query does not depend on how many queries or keys
    share the call, so a verify block's rows are bitwise the plain decode steps' rows. float32
    keeps SDPA: its GEMMs are row-count dependent anyway (so no bitwise guarantee to win), the
    differences stay at float32 rounding, and SDPA is faster there.
    """
    n_tokens, n_heads, head_dim = q.shape
    batch, q_len = q_index.shape
    if batch == 1 and q_len == n_tokens:  # one sequence's queries in order (a prefill chunk)
        q_pad = q.unsqueeze(0)
    else:
        q_pad = torch.cat([q, q.new_zeros(1, n_heads, head_dim)])[q_index]  # [B, Q, Hq, D]
    if q_len <= INVARIANT_MAX_QUERIES and q.dtype == torch.bfloat16:
        if plan is None:
            plan = chunk_plan(gather, mask, q_len, k_cache.shape[1])
        out = _chunked_attention(q_pad, k_cache, v_cache, plan, scale)
    else:
        k = gather_slots(k_cache, gather).transpose(1, 2)  # [B, Hkv, L, D]
        v = gather_slots(v_cache, gather).transpose(1, 2)
        out = _causal_sdpa(q_pad.transpose(1, 2), k, v, mask, scale).transpose(1, 2)
    out = out.reshape(batch * q_len, n_heads, head_dim)
    return out if out_index is None else out[out_index]


CAUSAL_BLOCK = 128
"""Queries per SDPA call of a long prefill chunk (`_causal_sdpa`)."""


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 scale: float) -> torch.Tensor:
    """SDPA of q [B, Hq, Q, D] over k/v [B, Hkv, L, D] with `mask` [B, 1, Q, L]. A chunk of
    one sequence with 3 * CAUSAL_BLOCK queries or more runs a call per block of CAUSAL_BLOCK
    queries over only the keys its last query sees: CPU SDPA computes every masked key. On
    a 2-core AVX2 EPYC, one layer of the embedded model: 7.1 -> 5.6 ms for a prompt's first
    512 tokens, 14.3 -> 12.9 after a prefix of 512, 21.6 -> 20.5 after 1024; the whole
    512-token prefill 193 -> 187 ms."""
    gqa = k.shape[1] != q.shape[1]
    q_len = q.shape[2]
    if mask is None or q.shape[0] != 1 or q_len < 3 * CAUSAL_BLOCK:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=gqa)
    ends = list(range(CAUSAL_BLOCK, q_len, CAUSAL_BLOCK)) + [q_len]
    # keys [0, n) hold every key a block sees: n is one past its last query's last visible key
    last = mask[0, 0, [e - 1 for e in ends]]
    seen = (last.shape[-1] - last.flip(-1).int().argmax(-1)).tolist()
    outs, start = [], 0
    for end, n in zip(ends, seen):
        outs.append(F.scaled_dot_product_attention(
            q[:, :, start:end], k[:, :, :n], v[:, :, :n], attn_mask=mask[:, :, start:end, :n],
            scale=scale, enable_gqa=gqa))
        start = end
    return torch.cat(outs, 2)


def gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots] for slots [B, L]: [B, L, Hkv, D] (index_select: on CPU several times
    faster than advanced indexing)."""
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


def _chunked_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: ChunkPlan,
    scale: float,
) -> torch.Tensor:
    """paged_attention for few queries [B, Q, Hq, D], computed so that each query's output is
    bitwise independent of the other queries in the call and of keys it does not see.

    SDPA's CPU kernels block queries and keys by the call's shape, so the same query gives
    last-bit different outputs alone (a decode step) and in a block of 16 (a verify); in
    bfloat16 that flips a rounding now and then and, at a near-tie, a greedy token. Here every
    step is either elementwise (IEEE-exact whatever the vector width) or a reduction of a fixed
    shape: keys are split into chunks at fixed absolute positions (KEY_CHUNK); scores and chunk
    outputs are batched matmuls of one [Q*G, D] x [D, KEY_CHUNK] shape per chunk, whose rows come
    out the same whatever Q is (measured for bfloat16; float32 GEMMs on CPU depend on the row
    count, so there outputs agree to float32 rounding only); the softmax subtracts the row's
    global maximum (exact), sums each chunk over its KEY_CHUNK keys, and chunks add up one by
    one in order, a chunk the query cannot see adding exact zeros. Keys and values are gathered
    head-major (plan.kv_index), so the matmuls read them as gathered, with no second copy.
    Returns [B, Q, Hq, D].
    """
    batch, q_len, n_heads, head_dim = q.shape
    _, n_kv, chunks, _ = plan.kv_index.shape
    group = n_heads // n_kv
    shape = (batch, n_kv, chunks, KEY_CHUNK, head_dim)
    index = plan.kv_index.reshape(-1)
    k = k_cache.view(-1, head_dim).index_select(0, index).view(shape)
    v = v_cache.view(-1, head_dim).index_select(0, index).view(shape)
    qg = q.view(batch, q_len, n_kv, group, head_dim).transpose(1, 2)
    qg = qg.reshape(batch, n_kv, 1, q_len * group, head_dim)           # [B, Hkv, 1, Q*G, D]
    s = torch.matmul(qg, k.transpose(-1, -2)).float()                  # [B, Hkv, n, Q*G, C]
    s = s.view(batch, n_kv, chunks, q_len, group, KEY_CHUNK) * scale
    s = s.masked_fill(~plan.visible[:, None, :, :, None, :], float("-inf"))
    # the row's maximum, chunk by chunk then over chunks (exact in any order; a contiguous
    # reduction first is what a compiler vectorises well)
    top = s.amax(-1, keepdim=True).amax(2, keepdim=True)
    e = (s - top).exp()      # numel a multiple of KEY_CHUNK: every element takes the vector exp
    total = e.sum(-1, keepdim=True)                                    # per chunk, fixed length
    e = e.view(batch, n_kv, chunks, q_len * group, KEY_CHUNK).to(v.dtype)
    o = torch.matmul(e, v).float()                                     # [B, Hkv, n, Q*G, D]
    o = torch.cat([o.view(batch, n_kv, chunks, q_len, group, head_dim), total], -1)
    # Chunks add up one by one, in order (a scan): a sum's order would depend on the shape.
    acc = o.cumsum(2)[:, :, -1]
    out = acc[..., :head_dim] / acc[..., head_dim:]                   # [B, Hkv, Q, G, D]
    return out.to(q.dtype).permute(0, 2, 1, 3, 4).reshape(batch, q_len, n_heads, head_dim)


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Write new keys/values [T, Hkv, D] into their slots [T] of one layer's cache."""
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)


def draft_attention(
    q: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    ctx_lens: torch.Tensor,
    k_blk: torch.Tensor,
    v_blk: torch.Tensor,
    scale: float,
    causal: bool,
    window: int | None,
) -> torch.Tensor:
    """Attention of N drafted blocks over their cached context and themselves (DFlash drafter).

    q        [N, B, Hq, D]   block queries; query i of sequence n sits at position ctx_lens[n] + i
    k_ctx    [N, L, Hkv, D]  context keys, key j at position j; only the first ctx_lens[n] valid
    v_ctx    [N, L, Hkv, D]
    ctx_lens [N]             valid context length of each sequence (0 .. L)
    k_blk    [N, B, Hkv, D]  the block's own keys/values, at the queries' positions
    v_blk    [N, B, Hkv, D]
    causal   False: every query sees the whole block; True: block keys up to its own position
    window   None, or a key is visible only if |query_pos - key_pos| < window
    returns  [N, B, Hq, D]

    Every query sees at least its own key, so no row is fully masked.
    """
    n, b, n_heads, _ = q.shape
    ctx_len = k_ctx.shape[1]
    device = q.device
    lens = ctx_lens.to(device=device, dtype=torch.long)
    ctx_pos = torch.arange(ctx_len, device=device).expand(n, ctx_len)
    q_pos = lens[:, None] + torch.arange(b, device=device)                  # [N, B]
    key_pos = torch.cat([ctx_pos, q_pos], dim=1)                            # [N, L + B]
    block = torch.ones_like(q_pos, dtype=torch.bool)
    valid = torch.cat([ctx_pos < lens[:, None], block], dim=1)              # padding: False
    mask = valid[:, None, :].expand(n, b, ctx_len + b)
    diff = q_pos[:, :, None] - key_pos[:, None, :]                          # [N, B, L + B]
    if causal:
        mask = mask & (diff >= 0)
    if window is not None:
        mask = mask & (diff.abs() < window)
    k = torch.cat([k_ctx, k_blk], dim=1).transpose(1, 2)                    # [N, Hkv, L + B, D]
    v = torch.cat([v_ctx, v_blk], dim=1).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k, v, attn_mask=mask[:, None], scale=scale,
        enable_gqa=k.shape[1] != n_heads,
    )  # [N, Hq, B, D]
    return out.transpose(1, 2)


def _row_positions(row_start: torch.Tensor, width: int, num_rows: int) -> torch.Tensor:
    """[N, width] rows row_start[n] + k, clamped into the tensor (rows past an item's own are
    padding: read, never used)."""
    k = torch.arange(width, device=row_start.device)
    return (row_start[:, None] + k).clamp(max=max(num_rows - 1, 0))


def accept_greedy(
    logits: torch.Tensor, row_start: torch.Tensor, num_drafts: torch.Tensor, drafts: torch.Tensor
) -> torch.Tensor:
    """Greedy verification of a batch of drafted blocks, without a host sync.

    logits     [R, V]  the target's rows; item n's rows are row_start[n] .. + num_drafts[n]
    row_start  [N]     int64
    num_drafts [N]     int64, 0 .. D (0: a plain decode row)
    drafts     [N, D]  int64 drafted tokens, padded; draft k is judged by row k
    returns    [N, 2]  int64 (accepted drafts, bonus token): the longest prefix of drafts equal to
                       the row argmaxes, and the argmax of the row after it (first index on ties)
    """
    n, width = drafts.shape
    rows = _row_positions(row_start, width + 1, logits.shape[0])
    choice = logits.argmax(-1)[rows]                                   # [N, D + 1]
    k = torch.arange(width, device=drafts.device)
    match = (drafts == choice[:, :width]) & (k < num_drafts[:, None])
    accepted = match.long().cumprod(1).sum(1)
    bonus = choice.gather(1, accepted[:, None])[:, 0]
    return torch.stack([accepted, bonus], dim=1)


def accept_sample(
    probs: torch.Tensor,
    row_start: torch.Tensor,
    num_drafts: torch.Tensor,
    drafts: torch.Tensor,
    uniforms: torch.Tensor,
    q_probs: torch.Tensor | None = None,
    q_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact speculative sampling for a batch of drafted blocks, without a host sync.

    probs      [R, V]    float32 target distributions (rows sum to 1); layout as accept_greedy
    uniforms   [N, D+1]  U[0, 1): column k < num_drafts[n] tests draft k, column num_drafts[n]
                         draws the bonus
    q_probs    [N, D, K] the distribution each draft was drawn from, over the tokens q_ids
                         [N, D, K] (zero-padded); None: every draft was chosen for certain
                         (one-hot q)
    returns    [N, 2]    int64 (accepted drafts, bonus token)

    Draft k is accepted when u_k * q_k(d_k) < p_k(d_k). At the first rejection the bonus is
    drawn from max(p_k - q_k, 0) (p_k with d_k's mass removed for a one-hot q; p_k itself where
    nothing is left); after a fully accepted block, from the next row. The draw inverts the
    row's cumulative sum: the first token whose cumulative mass exceeds u * total.
    """
    n, width = drafts.shape
    vocab = probs.shape[1]
    rows = _row_positions(row_start, width, probs.shape[0])
    k = torch.arange(width, device=drafts.device)
    p_draft = probs[rows, drafts.clamp(0, vocab - 1)] if width else probs.new_zeros(n, 0)
    test = uniforms[:, :width]
    if q_probs is not None and width:
        test = test * (q_probs * (q_ids == drafts[..., None])).sum(-1)
    ok = (test < p_draft) & (k < num_drafts[:, None])
    accepted = ok.long().cumprod(1).sum(1)
    p = probs[row_start + accepted]                                    # [N, V]
    rejected = accepted < num_drafts
    if width:
        at = accepted.clamp(max=width - 1)
        if q_probs is None:
            draft = drafts.gather(1, at[:, None])
            removed = rejected[:, None] & (torch.arange(vocab, device=p.device) == draft)
            p = p.masked_fill(removed, 0.0)
        else:
            items = torch.arange(n, device=p.device)
            q = q_probs[items, at].to(p.dtype) * rejected[:, None]
            residual = p.scatter_add(1, q_ids[items, at], -q).clamp_min(0.0)
            p = torch.where(residual.sum(1, keepdim=True) > 0, residual, p)
    cdf = p.cumsum(1)
    u = uniforms.gather(1, num_drafts[:, None])
    pick = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0]
    last = (vocab - 1) - (p > 0).flip(1).long().argmax(1)             # rounding: stay in support
    return torch.stack([accepted, torch.minimum(pick, last)], dim=1)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dim, normalised in float32 (HF Llama/Qwen3 numerics)."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def store_context_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    cos_half: torch.Tensor,
    sin_half: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """Finish and store one drafter layer's context K/V (DFlash KV injection).

    k, v        [T, Hkv, D]  the layer's projections of the context features, before k_norm/RoPE
    norm_weight [D] or None  k_norm (per-head RMSNorm, normalised in float32)
    cos_half    [P, D/2]     float32 RoPE tables (rotate-half convention); sin_half likewise
    positions   [T]          each token's position; slots [T] its slot in the caches
    k_cache[slots] = rope(k_norm(k)), v_cache[slots] = v, in the caches' dtype
    """
    if norm_weight is not None:
        k = _rms_norm(k, norm_weight, eps)
    cos, sin = cos_half[positions], sin_half[positions]
    cos = torch.cat((cos, cos), dim=-1).to(k.dtype)[:, None, :]
    sin = torch.cat((sin, sin), dim=-1).to(k.dtype)[:, None, :]
    k1, k2 = k.chunk(2, dim=-1)
    k = k * cos + torch.cat((-k2, k1), dim=-1) * sin
    store_kv(k_cache, v_cache, slots, k, v)
