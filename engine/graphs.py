"""Decode/verify and drafter forwards replayed from captured graphs: no per-kernel launch cost
on CUDA.

A step's decode rows and verify blocks (every forward the runner sends to a decode forward), and
the drafter's blocks, are laid out in a bucket: a batch of sequences padded to `Bucket.batch`,
each sequence's new tokens padded to `Bucket.queries` rows, its page table padded to
`Bucket.pages` pages. Every tensor the forward reads lives in the bucket's static buffers
(token ids, positions, the slot each token's K/V goes to, page tables), which each step
overwrites; the KV pool's tensors never move. The forward computes the keys' slots and the causal mask from those buffers inside the graph, so one
capture per bucket serves every step that fits it, whatever its page tables.

Padding rows are token 0 at position 0, their K/V (and a drafter's context K/V) written into a
scratch page the engine keeps out of the allocator (`Engine(graphs=...)` gives the pool one page
more than the manager), their queries masked to one key; padded page-table entries point at the
scratch page too, never visible to a real query. A step with no bucket (a batch or context beyond
the largest, more buckets than `max_graphs`) or whose capture failed runs the same forward eager,
with a message saying why, once per reason.

`capture` turns a forward over the static buffers into a replay: `cuda_graph` captures a
torch.cuda.CUDAGraph (after two warm-up runs on a side stream; graphs share one memory pool);
`eager_replay` (CPU) runs the forward again on each replay, which exercises everything but the
capture: the bucket choice, the padding, the buffers each step fills and the replay reads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch

from agentflash.kernels.torch_ops import INVARIANT_MAX_QUERIES

from .attention import (PagedAttention, PagedDraftAttention, PagedGroup, index_tensor,
                        table_slots)
from .config import CacheConfig
from .cpu.forward import DecodeForward, DraftForward
from .models.dflash import DFlashDraftModel
from .models.qwen3 import CausalLM
from .models.qwen3_5 import HybridCausalLM

log = logging.getLogger("agentflash.engine")

Replay = Callable[[], torch.Tensor]
Capture = Callable[[Replay], Replay]


def _powers_of_two(limit: int) -> tuple[int, ...]:
    out = [1]
    while out[-1] < limit:
        out.append(out[-1] * 2)
    return tuple(out)


@dataclass(frozen=True)
class Bucket:
    batch: int      # sequences
    queries: int    # new tokens per sequence (1: decode rows; a block: verify)
    pages: int      # KV pages per sequence


@dataclass(frozen=True)
class GraphBuckets:
    """The bucket sizes graphs are captured for (ascending), and how many graphs may exist."""

    batch: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    queries: tuple[int, ...] = _powers_of_two(INVARIANT_MAX_QUERIES)
    pages: tuple[int, ...] = _powers_of_two(2048)
    max_graphs: int = 64

    def __post_init__(self) -> None:
        for name in ("batch", "queries", "pages"):
            sizes = getattr(self, name)
            if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
                raise ValueError(f"GraphBuckets.{name} must be ascending sizes >= 1, got {sizes}")
        if self.max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1, got {self.max_graphs}")

    @classmethod
    def for_engine(cls, max_running: int, max_model_len: int, page_size: int,
                   max_graphs: int = 64) -> GraphBuckets:
        """Powers of two up to the engine's largest batch and context."""
        return cls(_powers_of_two(max_running), _powers_of_two(INVARIANT_MAX_QUERIES),
                   _powers_of_two(-(-max_model_len // page_size)), max_graphs)

    def choose(self, batch: int, queries: int, pages: int) -> Bucket | None:
        """The smallest bucket holding a step of `batch` sequences, up to `queries` new tokens
        and `pages` pages each; None when a size is beyond the largest bucket."""
        sizes = []
        for n, options in ((batch, self.batch), (queries, self.queries), (pages, self.pages)):
            fit = next((size for size in options if size >= n), None)
            if fit is None:
                return None
            sizes.append(fit)
        return Bucket(*sizes)


def eager_replay(forward: Replay) -> Replay:
    """The CPU stand-in for a capture: each replay runs the forward again over the buffers."""
    return forward


def cuda_graph() -> Capture:
    """Captures on CUDA: two warm-up runs on a side stream (Triton compiles its kernels, the
    caching allocator settles), then the forward captured into a CUDAGraph; an engine's graphs
    share one memory pool."""
    pool = torch.cuda.graph_pool_handle()

    def capture(forward: Replay) -> Replay:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            forward()
            forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = forward()

        def replay() -> torch.Tensor:
            graph.replay()
            return out
        return replay
    return capture


@dataclass
class GraphStats:
    captures: int = 0
    replays: int = 0
    eager: int = 0
    reasons: dict[str, int] = field(default_factory=dict)   # why steps ran eager


class _Graphs:
    """Captured graphs by bucket, and the eager fallback: what both forwards share. A forward
    gives its buffers for a bucket, how a step fills them (returning the rows to read back) and
    its computation over them."""

    def __init__(self, buckets: GraphBuckets, capture: Capture, what: str) -> None:
        self.buckets = buckets
        self.capture = capture
        self.what = what
        self.graphs: dict[Bucket, tuple[object, Replay]] = {}
        self.stats = GraphStats()
        self.capture_error: str | None = None

    def run(self, size: tuple[int, int, int], buffers: Callable[[Bucket], object],
            fill: Callable[[object, Bucket], torch.Tensor],
            forward: Callable[[object, Bucket], Replay]) -> torch.Tensor:
        bucket = self.buckets.choose(*size)
        if bucket is None:
            return self._eager(Bucket(*size), buffers, fill, forward, "beyond the buckets", (
                f"a step of {size[0]} sequences, {size[1]} new tokens and {size[2]} pages each "
                f"is beyond the largest bucket ({self.buckets.batch[-1]}, "
                f"{self.buckets.queries[-1]}, {self.buckets.pages[-1]})"))
        if self.capture_error is not None:
            return self._eager(bucket, buffers, fill, forward, "capture failed",
                               f"capturing failed ({self.capture_error})")
        if bucket not in self.graphs and len(self.graphs) >= self.buckets.max_graphs:
            return self._eager(bucket, buffers, fill, forward, "graph limit", (
                f"{self.buckets.max_graphs} graphs are captured (GraphBuckets.max_graphs); "
                f"bucket {bucket} has none"))
        held = self.graphs.get(bucket)
        state = held[0] if held is not None else buffers(bucket)
        rows = fill(state, bucket)
        if held is not None:
            replay = held[1]
        else:
            try:
                replay = self.capture(forward(state, bucket))
            except Exception as e:  # the forward itself runs eager: say why, stop capturing
                self.capture_error = f"{type(e).__name__}: {e}"
                return self._eager(bucket, buffers, fill, forward, "capture failed",
                                   f"capturing failed ({self.capture_error})")
            self.graphs[bucket] = (state, replay)
            self.stats.captures += 1
        self.stats.replays += 1
        return replay().index_select(0, rows)

    def _eager(self, bucket: Bucket, buffers, fill, forward, kind: str,
               reason: str) -> torch.Tensor:
        """The same forward over buffers of `bucket`, not captured; each kind of reason is
        logged the first time it happens (`stats.reasons` counts them)."""
        if kind not in self.stats.reasons:
            log.warning("graphs: %s; the %s runs eager", reason, self.what)
        self.stats.reasons[kind] = self.stats.reasons.get(kind, 0) + 1
        self.stats.eager += 1
        state = buffers(bucket)
        rows = fill(state, bucket)
        return forward(state, bucket)().index_select(0, rows)


@dataclass
class GraphBatch:
    """A forward's sequences as the graph forwards take them: their caches' layers, page
    tables and context lengths; for the target, each one's new tokens."""

    k_caches: Sequence[torch.Tensor]
    v_caches: Sequence[torch.Tensor]
    page_tables: Sequence[Sequence[int]]
    ctx_lens: Sequence[int]
    num_new: Sequence[int] = ()
    ids: torch.Tensor | None = None   # [T] the new tokens, in batch order


@dataclass
class _Buffers:
    ids: torch.Tensor        # [B*Q]
    positions: torch.Tensor  # [B*Q]
    slots: torch.Tensor      # [B*Q]
    table: torch.Tensor      # [B, P]


class GraphDecodeForward(DecodeForward):
    """The decode/verify forward of a dense target (and its DFlash drafter's context K/V
    store) run from one captured graph per bucket; returns float32 logits of the real rows."""

    kind = "graphs"

    def __init__(self, model: CausalLM, drafter: DFlashDraftModel | None, page_size: int,
                 scratch_page: int, buckets: GraphBuckets, capture: Capture) -> None:
        super().__init__(kernels=False)
        self.returns_logits = True
        self.model = model
        self.drafter = drafter
        self.layers = tuple(drafter.config.target_layer_ids) if drafter is not None else ()
        self.page_size = page_size
        self.scratch_page = scratch_page
        self.device = model.device
        self.graphs = _Graphs(buckets, capture, "decode/verify forward")

    def attention(self, k_caches, v_caches, page_tables, ctx_lens, num_new, page_size,
                  scale) -> GraphBatch:
        return GraphBatch(k_caches, v_caches, page_tables, ctx_lens, num_new)

    def args(self, ids: torch.Tensor, positions: torch.Tensor, attn: GraphBatch,
             rows: torch.Tensor | None = None) -> GraphBatch:
        """(Every row's logits are computed: the runner takes the `rows` it wants.)"""
        attn.ids = ids
        return attn

    @property
    def stats(self) -> GraphStats:
        return self.graphs.stats

    def __call__(self, batch: GraphBatch, k_caches: Sequence[torch.Tensor],
                 v_caches: Sequence[torch.Tensor], draft_k_caches: Sequence[torch.Tensor] = (),
                 draft_v_caches: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        caches = (tuple(k_caches), tuple(v_caches), tuple(draft_k_caches), tuple(draft_v_caches))
        size = (len(batch.num_new), max(batch.num_new), max(len(p) for p in batch.page_tables))
        return self.graphs.run(size, self._buffers,
                               lambda buf, bucket: self._fill(buf, batch, bucket),
                               lambda buf, bucket: self._forward(buf, bucket.queries, caches))

    def _buffers(self, bucket: Bucket) -> _Buffers:
        tokens = bucket.batch * bucket.queries
        new = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=self.device)  # noqa
        return _Buffers(new(tokens), new(tokens), new(tokens), new(bucket.batch, bucket.pages))

    def _fill(self, buffers: _Buffers, batch: GraphBatch, bucket: Bucket) -> torch.Tensor:
        """Write the step into the buffers (padding: token 0 at position 0 into the scratch
        page); returns the rows of the real tokens, in batch order, on the device."""
        q, ps, scratch = bucket.queries, self.page_size, self.scratch_page
        rows: list[int] = []
        positions = [0] * (bucket.batch * q)
        slots = [scratch * ps] * (bucket.batch * q)
        table = [scratch] * (bucket.batch * bucket.pages)
        for b, (pages, ctx, n) in enumerate(zip(batch.page_tables, batch.ctx_lens,
                                                batch.num_new)):
            table[b * bucket.pages: b * bucket.pages + len(pages)] = pages
            for i in range(n):
                pos = ctx - n + i
                rows.append(b * q + i)
                positions[b * q + i] = pos
                slots[b * q + i] = pages[pos // ps] * ps + pos % ps
        flat = index_tensor([*rows, *positions, *slots, *table], self.device)
        t, tokens = len(rows), bucket.batch * q
        real = flat[:t]
        buffers.positions.copy_(flat[t: t + tokens])
        buffers.slots.copy_(flat[t + tokens: t + 2 * tokens])
        buffers.table.copy_(flat[t + 2 * tokens:].view(bucket.batch, bucket.pages))
        buffers.ids.zero_()
        assert batch.ids is not None
        buffers.ids.index_copy_(0, real, batch.ids)
        return real

    def _forward(self, buffers: _Buffers, queries: int, caches) -> Replay:
        """The forward over `buffers` as a function of nothing (what a graph captures)."""
        k_caches, v_caches, draft_k, draft_v = caches
        model, drafter, ps = self.model, self.drafter, self.page_size

        def forward() -> torch.Tensor:
            table, positions = buffers.table, buffers.positions
            batch, pages = table.shape
            gather = table_slots(table, ps)
            keys = torch.arange(pages * ps, device=table.device)
            mask = keys[None, None, :] <= positions.view(batch, queries)[:, :, None]
            q_index = torch.arange(batch * queries, device=table.device).view(batch, queries)
            group = PagedGroup(rows=None, gather=gather, q_index=q_index, out_index=None,
                               mask=mask[:, None], plan=None)
            attn = PagedAttention(k_caches, v_caches, buffers.slots, [group],
                                  model.attention_scale)
            out = model(buffers.ids, positions, attn, self.layers)
            if drafter is not None:
                ctx = drafter.context_features(out.captured)
                for i, (k, v) in enumerate(zip(draft_k, draft_v)):
                    drafter.store_context_kv(i, ctx, positions, buffers.slots, k, v)
            return model.logits(out.hidden)
        return forward


@dataclass
class _DraftBuffers:
    ids: torch.Tensor        # [N*B]
    positions: torch.Tensor  # [N*B]
    table: torch.Tensor      # [N, P]
    lens: torch.Tensor       # [N] context keys of each block


class GraphDraftForward(DraftForward):
    """The drafter's block forward (N blocks of B over each sequence's cached context K/V) run
    from one captured graph per (blocks, pages) bucket; returns the wanted rows' hidden states
    after its final norm (the head runs after, eager). Padded blocks read no context (length 0)
    and write nothing."""

    kind = "graphs"

    def __init__(self, model: CausalLM, drafter: DFlashDraftModel, block_size: int,
                 page_size: int, scratch_page: int, buckets: GraphBuckets,
                 capture: Capture) -> None:
        super().__init__(kernel_attention=False, returns_logits=False)
        self.model, self.drafter = model, drafter
        self.block_size, self.page_size, self.scratch_page = block_size, page_size, scratch_page
        self.device = model.device
        self.graphs = _Graphs(replace(buckets, queries=(block_size,)), capture,
                              "drafter's block forward")

    @property
    def stats(self) -> GraphStats:
        return self.graphs.stats

    def attention(self, k_caches, v_caches, page_tables, ctx_lens, block_size, page_size,
                  drafter) -> GraphBatch:
        return GraphBatch(k_caches, v_caches, page_tables, ctx_lens)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, attn: GraphBatch,
                 rows: torch.Tensor) -> torch.Tensor:
        size = (len(attn.ctx_lens), self.block_size, max(len(p) for p in attn.page_tables))
        caches = (tuple(attn.k_caches), tuple(attn.v_caches))
        return self.graphs.run(size, self._buffers,
                               lambda buf, bucket: self._fill(buf, attn, ids, rows, bucket),
                               lambda buf, bucket: self._forward(buf, caches))

    def _buffers(self, bucket: Bucket) -> _DraftBuffers:
        tokens = bucket.batch * self.block_size
        new = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=self.device)  # noqa
        return _DraftBuffers(new(tokens), new(tokens), new(bucket.batch, bucket.pages),
                             new(bucket.batch))

    def _fill(self, buffers: _DraftBuffers, attn: GraphBatch, ids: torch.Tensor,
              rows: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        """Write the blocks into the buffers; the real blocks come first, so the wanted rows
        keep their indices."""
        b = self.block_size
        table = [self.scratch_page] * (bucket.batch * bucket.pages)
        lens = [0] * bucket.batch
        positions = [0] * (bucket.batch * b)
        for n, (pages, ctx) in enumerate(zip(attn.page_tables, attn.ctx_lens)):
            table[n * bucket.pages: n * bucket.pages + len(pages)] = pages
            lens[n] = ctx
            positions[n * b: (n + 1) * b] = range(ctx, ctx + b)
        flat = index_tensor([*positions, *table, *lens], self.device)
        tokens = bucket.batch * b
        buffers.positions.copy_(flat[:tokens])
        buffers.table.copy_(flat[tokens: tokens + bucket.batch * bucket.pages]
                            .view(bucket.batch, bucket.pages))
        buffers.lens.copy_(flat[tokens + bucket.batch * bucket.pages:])
        buffers.ids.zero_()
        buffers.ids[: ids.shape[0]].copy_(ids)
        return rows

    def _forward(self, buffers: _DraftBuffers, caches) -> Replay:
        k_caches, v_caches = caches
        model, drafter, b, ps = self.model, self.drafter, self.block_size, self.page_size
        kinds = [drafter.layer_kind(i) for i in range(len(k_caches))]

        def forward() -> torch.Tensor:
            attn = PagedDraftAttention(k_caches, v_caches, table_slots(buffers.table, ps),
                                       buffers.lens, b, drafter.attention_scale, kinds)
            h = drafter.embed_block(model, buffers.ids)
            return drafter(h, buffers.positions, attn, block_size=b)
        return forward


def graph_forwards(model: CausalLM | HybridCausalLM, drafter: DFlashDraftModel | None,
                   graphs: bool | GraphBuckets, block_size: int, cache: CacheConfig,
                   max_running: int, max_model_len: int
                   ) -> tuple[GraphDecodeForward, GraphDraftForward | None]:
    """An engine's decode/verify forward and drafter forward from graphs (`Engine(graphs=)`):
    buckets up to its batch and length unless given, CUDA graphs on CUDA, the eager replay
    elsewhere; the scratch page is the one past the manager's pages."""
    if isinstance(model, HybridCausalLM):
        raise ValueError("graphs: a hybrid target's linear-attention states are not captured; "
                         "run it without graphs")
    buckets = graphs if isinstance(graphs, GraphBuckets) else GraphBuckets.for_engine(
        max_running, max_model_len, cache.page_size)
    capture = cuda_graph() if model.device.type == "cuda" else eager_replay
    decode = GraphDecodeForward(model, drafter, cache.page_size, cache.num_pages, buckets,
                                capture)
    draft = None if drafter is None else GraphDraftForward(
        model, drafter, block_size, cache.page_size, cache.num_pages, buckets, capture)
    return decode, draft
