"""KVManager: per-sequence page tables over the allocator and the radix prefix cache.

Lifecycle of one sequence (one turn of an agent):

    kv = begin(tokens, max_cached)     reuse the longest cached prefix (pages shared, node locked;
                                       with_state: the longest ending at a state snapshot)
    reserve(kv, n) -> bool             promise the pages that growing to n tokens can need
    slots = extend(kv, n)              slot ids for the new positions (model writes K/V there)
    truncate(kv, n)                    roll back rejected speculative tokens
    cache(kv, tokens)                  put the written tokens into the radix tree
    pin(kv) -> Pin                     keep the cached path alive after release (live sessions)
    release(kv)                        drop the sequence's refs, lock and unused reservation

Invariants (checked by `check_integrity`):
- refcount(page) == tree refs + occurrences in live sequences' page tables; 0 iff free.
- len(kv.pages) == ceil(kv.length / P), and every slot < kv.length holds that sequence's KV.
- num_free >= total reserved: a reservation is a count of free pages nobody else may take, so
  it survives evictions and other sequences' allocations.
Copy-on-write: a sequence appends in place to its partial last page only when the page's fill
mark equals its own valid prefix of the page (nobody else wrote past it); otherwise it copies
that prefix into a fresh page first. See `allocator.py` for the fill/sealed marks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import KVPoolExhaustedError
from .allocator import PageAllocator
from .pool import KVPool
from .prefix import RadixCache, RadixNode


@dataclass(eq=False)
class SeqKV:
    """KV state of one sequence; owned by the manager, read by the engine."""

    pages: list[int] = field(default_factory=list)  # page table: ceil(length / P) pages
    length: int = 0                                 # tokens whose KV is written
    node: RadixNode | None = None                   # locked radix node; None once released
    reserved: int = 0                               # pages promised but not yet allocated
    promised_len: int = 0                           # length `reserved` is kept sufficient for


@dataclass(eq=False)
class Pin:
    """Handle keeping a cached radix path locked (unevictable) until `unpin`."""

    node: RadixNode
    active: bool = True


class KVManager:
    def __init__(self, page_size: int, num_pages: int, pool: KVPool | None = None) -> None:
        # a pool may hold pages beyond the manager's: reserved, never allocated (engine.graphs)
        if pool is not None and (pool.page_size != page_size or pool.num_pages < num_pages):
            raise ValueError("KVPool geometry differs from the manager's")
        self.page_size = page_size
        self.pool = pool
        self.allocator = PageAllocator(num_pages)
        self.radix = RadixCache(self.allocator, page_size)
        self._live: set[SeqKV] = set()
        self._pins: set[Pin] = set()
        self._reserved = 0  # sum of live sequences' `reserved`

    def begin(self, tokens: list[int], max_cached: int, with_state: bool = False) -> SeqKV:
        """with_state: reuse only a prefix that ends where a node holds a state snapshot (a
        hybrid model cannot resume anywhere else); `kv.node.state` is that snapshot."""
        match = self.radix.match(tokens[: max(0, max_cached)], with_state)
        self.radix.lock(match.node)
        for page in match.pages:
            self.allocator.incref(page)
        kv = SeqKV(pages=list(match.pages), length=match.length, node=match.node)
        self._live.add(kv)
        return kv

    def cached_length(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` the prefix cache holds now (read only)."""
        return self.radix.matched_length(tokens)

    def reserve(self, kv: SeqKV, total_len: int) -> bool:
        """Promise every page that extending `kv` to `total_len` tokens can need, evicting cache
        if required; False (reserving nothing, evicting nothing) if that is not possible now.

        The promise (for the largest total_len granted so far) outlives speculative rollback:
        extends up to it cannot fail while kv is only extended and truncated to lengths >= its
        length at this call, because `truncate` returns the pages it frees to the reservation.
        """
        self._check_live(kv)
        promised = max(total_len, kv.promised_len)
        extra = self._pages_needed(kv, promised, may_share=True) - kv.reserved
        if extra > 0 and not self._make_free(extra):
            return False
        kv.promised_len = promised
        if extra > 0:
            kv.reserved += extra
            self._reserved += extra
        return True

    def max_reservable(self) -> int:
        """Pages a new sequence could get once every running sequence ended and all unpinned
        cache was evicted (pages it reuses from a pinned prefix are not counted)."""
        return self.allocator.num_pages - len(self.radix.pages_on_paths(p.node for p in self._pins))

    def extend(self, kv: SeqKV, new_len: int) -> list[int]:
        """Slot ids for positions [kv.length, new_len); allocates pages (from the reservation
        first) and copies a shared partial last page before writing into it."""
        self._check_live(kv)
        if new_len < kv.length:
            raise ValueError(f"extend to {new_len} < length {kv.length}")
        if new_len == kv.length:
            return []
        P = self.page_size
        # Allocate everything up front so a KVPoolExhaustedError leaves kv unchanged.
        need = self._pages_needed(kv, new_len, may_share=False)
        if need > kv.reserved and not self._make_free(need - kv.reserved):
            raise KVPoolExhaustedError(f"KV pool cannot hold {new_len} tokens for a sequence")
        fresh = [self.allocator.alloc() for _ in range(need)]
        used = min(need, kv.reserved)
        kv.reserved -= used
        self._reserved -= used
        offset = kv.length % P
        if offset and self.allocator.fill(kv.pages[-1]) != offset:
            shared, copy = kv.pages[-1], fresh.pop(0)
            if self.pool is not None:
                self.pool.copy_page(shared, copy, offset)
            self.allocator.set_fill(copy, offset)
            self.allocator.decref(shared)
            kv.pages[-1] = copy
        kv.pages.extend(fresh)
        # This sequence is now the writer of every page it touched: raise the fill marks.
        for i in range(kv.length // P, -(-new_len // P)):
            self.allocator.set_fill(kv.pages[i], min(P, new_len - i * P))
        start = kv.length
        kv.length = new_len
        return self.slots(kv, start, new_len)

    def truncate(self, kv: SeqKV, n: int) -> None:
        """Roll back to the first n tokens: drops pages no longer needed (those freed go back to
        kv's reservation as far as its promise needs them) and, where this sequence was the last
        writer of a page, lowers the page's fill mark (never below the tree's seal)."""
        self._check_live(kv)
        if not 0 <= n <= kv.length:
            raise ValueError(f"truncate to {n} outside [0, {kv.length}]")
        if n == kv.length:
            return  # (every plain decode step: its KV is all kept)
        P = self.page_size
        for i in range(n // P, len(kv.pages)):
            page = kv.pages[i]
            if self.allocator.fill(page) == min(P, kv.length - i * P):
                keep = min(P, max(0, n - i * P))
                self.allocator.set_fill(page, max(keep, self.allocator.sealed(page)))
        keep_pages = -(-n // P)
        freed = sum(self.allocator.decref(page) for page in kv.pages[keep_pages:])
        del kv.pages[keep_pages:]
        kv.length = n
        refund = min(freed, self._pages_needed(kv, kv.promised_len, may_share=True) - kv.reserved)
        if refund > 0:  # freed pages are free: num_free >= reserved total still holds
            kv.reserved += refund
            self._reserved += refund

    def slots(self, kv: SeqKV, start: int, end: int) -> list[int]:
        if not 0 <= start <= end <= kv.length:
            raise ValueError(f"slots [{start}, {end}) outside the {kv.length} written tokens")
        P = self.page_size
        return [kv.pages[i // P] * P + i % P for i in range(start, end)]

    def cache(self, kv: SeqKV, tokens: list[int]) -> None:
        """Insert tokens[:kv.length] (their KV is in kv.pages) into the radix tree and move the
        sequence's lock to the node ending there."""
        self._check_live(kv)
        if len(tokens) < kv.length:
            raise ValueError(f"{len(tokens)} tokens given for {kv.length} cached positions")
        node = self.radix.insert(tokens[: kv.length], kv.pages)
        self.radix.lock(node)
        assert kv.node is not None
        self.radix.unlock(kv.node)
        kv.node = node

    def cache_running(self, kv: SeqKV, tokens: list[int]) -> bool:
        """`cache` for a sequence that goes on running: its partial last page, shared from now
        on, will be copied before it writes there, so that page is promised too. False (nothing
        cached) when it cannot be promised now."""
        if kv.length % self.page_size and not self._make_free(1):
            return False
        self.cache(kv, tokens)
        promised = self.reserve(kv, kv.promised_len)  # the page _make_free just set aside
        assert promised
        return True

    def pin(self, kv: SeqKV) -> Pin:
        self._check_live(kv)
        assert kv.node is not None
        pin = Pin(kv.node)
        self.radix.lock(pin.node)
        self._pins.add(pin)
        return pin

    def share(self, pin: Pin) -> Pin:
        """A second pin on the same cached prefix (a forked session); unpinned separately."""
        if not pin.active:
            raise ValueError("pin was released")
        shared = Pin(pin.node)
        self.radix.lock(shared.node)
        self._pins.add(shared)
        return shared

    def unpin(self, pin: Pin) -> None:
        if pin.active:
            pin.active = False
            self._pins.discard(pin)
            self.radix.unlock(pin.node)

    def release(self, kv: SeqKV) -> None:
        if kv not in self._live:
            return
        self._live.discard(kv)
        for page in kv.pages:
            self.allocator.decref(page)
        assert kv.node is not None
        self.radix.unlock(kv.node)
        self._reserved -= kv.reserved
        kv.pages, kv.length, kv.node, kv.reserved, kv.promised_len = [], 0, None, 0, 0

    def evict(self, num_pages: int) -> int:
        """Evict unlocked cache (LRU) until num_pages pages were freed; returns pages freed."""
        return self.radix.evict(num_pages)

    def stats(self) -> dict[str, int]:
        return {
            "pages_total": self.allocator.num_pages,
            "pages_free": self.allocator.num_free,
            "pages_pinned": len(self.radix.pages_on_paths(p.node for p in self._pins)),
            "pages_referenced": len({p for kv in self._live for p in kv.pages}),
            "pages_cached": self.radix.evictable_pages(),
            "pages_reserved": self._reserved,
        }

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
        self.radix.check_integrity()
        P = self.page_size
        refs = self.radix.page_refs()
        # Each live sequence and pin locks its node's path: lock_ref == locks through the node.
        locks: dict[int, int] = {}
        for kv in self._live:
            assert kv.node is not None and len(kv.pages) == -(-kv.length // P), "page table size"
            assert kv.reserved >= 0
            refs.update(kv.pages)
            for i, page in enumerate(kv.pages):
                assert self.allocator.fill(page) >= min(P, kv.length - i * P), "slot past fill"
        for node in [kv.node for kv in self._live] + [p.node for p in self._pins]:
            for n in [self.radix.root, *node.path()]:
                locks[n.id] = locks.get(n.id, 0) + 1
        for page in range(self.allocator.num_pages):
            assert self.allocator.refcount(page) == refs[page], f"page {page} refcount"
        stack = [self.radix.root]
        while stack:
            node = stack.pop()
            assert node.lock_ref == locks.get(node.id, 0), f"node {node.id} lock_ref"
            stack.extend(node.children.values())
        assert self._reserved == sum(kv.reserved for kv in self._live), "reservation total"
        assert self.allocator.num_free >= self._reserved, "reserved pages were handed out"

    def _pages_needed(self, kv: SeqKV, total_len: int, may_share: bool) -> int:
        """Pages to allocate for growing kv to total_len, counting a copy of its partial last
        page if that copy is needed now, or (may_share) if the page is shared and could be."""
        if total_len <= kv.length:
            return 0
        need = -(-total_len // self.page_size) - len(kv.pages)
        offset = kv.length % self.page_size
        if offset:
            last = kv.pages[-1]
            shared = may_share and self.allocator.refcount(last) > 1
            if shared or self.allocator.fill(last) != offset:
                need += 1
        return need

    def _make_free(self, n: int) -> bool:
        """Ensure n free pages beyond all reservations, evicting cache; False if impossible."""
        deficit = self._reserved + n - self.allocator.num_free
        if deficit <= 0:
            return True
        if self.radix.evictable_pages() < deficit:
            return False
        freed = self.radix.evict(deficit)
        assert freed >= deficit
        return True

    def _check_live(self, kv: SeqKV) -> None:
        if kv not in self._live:
            raise ValueError("sequence was released")
