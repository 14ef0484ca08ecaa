"""Paged KV cache: tensors in a preallocated pool, bookkeeping in pure Python ints.

- `pool.KVPool`: per-layer K/V tensors addressed by flat slot ids (page * page_size + offset).
- `allocator.PageAllocator`: free list, refcounts, per-page fill/sealed marks for copy-on-write.
- `prefix.RadixCache`: radix tree over token ids holding reusable pages (match/insert/lock/evict).
- `manager.KVManager`: what the engine uses; per-sequence page tables (`SeqKV`), reservations,
  extend/truncate with copy-on-write, caching finished turns and pinning live sessions.
- `state_pool.StatePool`: per-sequence slots of a hybrid model's linear-attention states.

Model code sees only the pool's tensors and slot ids, never the allocator.
"""

from __future__ import annotations

from .allocator import PageAllocator
from .manager import KVManager, Pin, SeqKV
from .pool import KVPool
from .prefix import PrefixMatch, RadixCache, RadixNode
from .state_pool import StatePool

__all__ = [
    "KVManager",
    "KVPool",
    "PageAllocator",
    "Pin",
    "PrefixMatch",
    "RadixCache",
    "RadixNode",
    "SeqKV",
    "StatePool",
]
