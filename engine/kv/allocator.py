"""Page bookkeeping in pure Python ints: free list, reference counts and per-page fill marks.

A page is free iff its refcount is 0. Holders (sequences, radix-tree nodes) each own one ref on
every page they use; the page returns to the free list when the last ref is dropped.

Two marks per page drive copy-on-write (see `KVManager.extend`); both count slots from the start
of the page and reset to 0 when the page is freed:
- `fill`: high-water mark of written slots. Every holder's valid slots lie below it, so a holder
  whose own valid prefix of the page ends exactly at `fill` may append in place.
- `sealed`: slots below it belong to the radix tree and are never rewritten; a writer that rolls
  back (`KVManager.truncate`) may lower `fill` but never below `sealed`.
Invariant: sealed <= fill <= page_size (the allocator does not know page_size; callers keep it).
"""

from __future__ import annotations

import heapq

from ..errors import KVPoolExhaustedError


class PageAllocator:
    """Free list (lowest page id first, so tests can assert exact ids) plus refcounts and marks."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError("num_pages must be >= 1")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages))  # a heap; sorted is a valid heap
        self._ref = [0] * num_pages
        self._fill = [0] * num_pages
        self._sealed = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        """Take the lowest free page with refcount 1 and empty marks."""
        if not self._free:
            raise KVPoolExhaustedError("no free KV page")
        page = heapq.heappop(self._free)
        self._ref[page] = 1
        return page

    def incref(self, page: int) -> None:
        if self._ref[page] <= 0:
            raise ValueError(f"incref of free page {page}")
        self._ref[page] += 1

    def decref(self, page: int) -> bool:
        """Drop one ref; returns True when that freed the page."""
        if self._ref[page] <= 0:
            raise ValueError(f"decref of free page {page}")
        self._ref[page] -= 1
        if self._ref[page]:
            return False
        self._fill[page] = self._sealed[page] = 0
        heapq.heappush(self._free, page)
        return True

    def refcount(self, page: int) -> int:
        return self._ref[page]

    def is_free(self, page: int) -> bool:
        return self._ref[page] == 0

    def fill(self, page: int) -> int:
        return self._fill[page]

    def set_fill(self, page: int, n: int) -> None:
        if self._ref[page] <= 0 or n < self._sealed[page]:
            raise ValueError(f"set_fill({page}, {n}): page free or below its sealed mark")
        self._fill[page] = n

    def sealed(self, page: int) -> int:
        return self._sealed[page]

    def seal(self, page: int, n: int) -> None:
        """Freeze the first n slots of `page` (they were written and now belong to the tree)."""
        if self._ref[page] <= 0:
            raise ValueError(f"seal of free page {page}")
        self._sealed[page] = max(self._sealed[page], n)
        self._fill[page] = max(self._fill[page], n)

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "free list holds a page twice"
        for page in range(self.num_pages):
            ref = self._ref[page]
            assert ref >= 0, f"page {page} has refcount {ref}"
            assert (ref == 0) == (page in free), f"page {page}: refcount {ref} vs free list"
            assert 0 <= self._sealed[page] <= self._fill[page], f"page {page}: sealed > fill"
            if ref == 0:
                assert self._fill[page] == 0, f"free page {page} has a fill mark"
