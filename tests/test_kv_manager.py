"""KVManager, exact page ids: sharing, copy-on-write, reserve/extend/truncate, pins, eviction."""

from __future__ import annotations

import pytest
import torch

from agentflash.engine.errors import KVPoolExhaustedError
from agentflash.engine.kv import KVManager, KVPool, SeqKV

P = 4
TOKENS = list(range(100, 110))  # 10 tokens: pages 0, 1 full, page 2 holds 2 slots


def make(num_pages: int = 16) -> KVManager:
    return KVManager(P, num_pages, KVPool(P, num_pages, [(1, 1), (1, 1)]))


def write(m: KVManager, kv: SeqKV, tokens: list[int], new_len: int) -> list[int]:
    """Extend kv and store each token id as its K (and -id as V) in every layer."""
    start = kv.length
    slots = m.extend(kv, new_len)
    ids = torch.tensor(tokens[start:new_len], dtype=torch.float32)
    assert m.pool is not None
    for k, v in zip(m.pool.k, m.pool.v):
        k[slots, 0, 0] = ids
        v[slots, 0, 0] = -ids
    return slots


def content(m: KVManager, kv: SeqKV) -> list[int]:
    assert m.pool is not None
    slots = m.slots(kv, 0, kv.length)
    return [int(x) for x in m.pool.k[0][slots, 0, 0]]


def finished(m: KVManager, tokens: list[int]) -> None:
    """Run one turn over `tokens` from scratch (or the cache), cache it and release it."""
    kv = m.begin(tokens, len(tokens) - 1)
    write(m, kv, tokens, len(tokens))
    m.cache(kv, tokens)
    m.release(kv)
    m.check_integrity()


def refcounts(m: KVManager, pages) -> list[int]:
    return [m.allocator.refcount(p) for p in pages]


def test_fresh_sequence_reserve_extend():
    m = make()
    kv = m.begin(TOKENS, 9)
    assert (kv.length, kv.pages) == (0, [])
    assert m.reserve(kv, 10) and kv.reserved == 3
    assert m.stats()["pages_reserved"] == 3
    assert write(m, kv, TOKENS, 10) == list(range(10))
    assert (kv.pages, kv.length, kv.reserved) == ([0, 1, 2], 10, 0)
    assert [m.allocator.fill(p) for p in kv.pages] == [4, 4, 2]
    assert write(m, kv, TOKENS + [110], 11) == [10]  # in place: not shared
    assert m.slots(kv, 3, 6) == [3, 4, 5]
    m.check_integrity()


def test_two_sequences_share_cached_prefix():
    m = make()
    finished(m, TOKENS)
    assert m.stats()["pages_cached"] == 3
    a = m.begin(TOKENS + [1, 2], 11)
    b = m.begin(TOKENS + [3], 10)
    assert (a.length, a.pages) == (10, [0, 1, 2])
    assert (b.length, b.pages) == (10, [0, 1, 2])
    assert refcounts(m, range(3)) == [3, 3, 3]
    assert content(m, a) == TOKENS
    s = m.stats()
    assert (s["pages_referenced"], s["pages_cached"], s["pages_free"]) == (3, 0, 13)
    m.check_integrity()


def test_copy_on_write_of_shared_partial_page():
    m = make()
    finished(m, TOKENS)
    a = m.begin(TOKENS + [1, 2], 11)
    b = m.begin(TOKENS + [3, 4, 5], 12)
    # a appends in place: nobody wrote past slot 2 of page 2 yet.
    assert write(m, a, TOKENS + [1, 2], 12) == [10, 11]
    assert a.pages == [0, 1, 2] and m.allocator.fill(2) == 4
    # b must copy page 2's first two slots into a fresh page (3) before writing.
    assert write(m, b, TOKENS + [3, 4, 5], 13) == [14, 15, 16]
    assert b.pages == [0, 1, 3, 4]
    assert content(m, a) == TOKENS + [1, 2]
    assert content(m, b) == TOKENS + [3, 4, 5]
    assert refcounts(m, range(5)) == [3, 3, 2, 1, 1]  # page 2: tree + a
    m.check_integrity()


def test_truncate_restores_fill_and_frees_pages():
    m = make()
    finished(m, TOKENS)
    a = m.begin(TOKENS + [1, 2, 3, 4, 5], 10)
    write(m, a, TOKENS + [1, 2, 3, 4, 5], 15)
    assert a.pages == [0, 1, 2, 3] and m.allocator.fill(2) == 4
    m.truncate(a, 11)                                 # speculative rejection
    assert a.pages == [0, 1, 2] and m.allocator.is_free(3)
    assert m.allocator.fill(2) == 3
    m.truncate(a, 9)                                  # into the cached prefix
    assert m.allocator.fill(2) == 2                   # never below the tree's sealed slots
    assert a.pages == [0, 1, 2] and a.length == 9
    # Another sequence may now append in place after the cached prefix ...
    b = m.begin(TOKENS + [7], 10)
    write(m, b, TOKENS + [7], 11)
    assert b.pages == [0, 1, 2]
    # ... so a, rewriting its position 9, has to copy.
    write(m, a, TOKENS[:9] + [8], 10)
    assert a.pages == [0, 1, 3]
    assert content(m, a) == TOKENS[:9] + [8] and content(m, b) == TOKENS + [7]
    m.check_integrity()


def test_speculative_loop_stays_inside_its_reservation():
    m = make()
    kv = m.begin(TOKENS, 0)
    write(m, kv, TOKENS, 6)
    assert m.reserve(kv, 30) and kv.reserved == 6    # pages 2..7 for positions 8..29
    outside = m.allocator.num_free - m.stats()["pages_reserved"]
    while kv.length + 5 <= 30:
        write(m, kv, list(range(kv.length + 5)), kv.length + 5)
        m.truncate(kv, kv.length - 3)                 # accept 2 of 5
        # truncated pages went back to the reservation: nothing taken from anyone else
        assert m.allocator.num_free - m.stats()["pages_reserved"] == outside
        m.check_integrity()
    assert (kv.length, kv.pages, kv.reserved) == (26, list(range(7)), 1)


def test_reserve_counts_copy_of_shared_partial_page():
    m = make()
    finished(m, TOKENS)
    kv = m.begin(TOKENS + [1], 10)
    assert m.reserve(kv, 11) and kv.reserved == 1      # page 2 is shared: may need a copy
    assert m.reserve(kv, 12) and kv.reserved == 1      # still the same page
    assert m.reserve(kv, 13) and kv.reserved == 2
    write(m, kv, TOKENS + [1, 2, 3], 13)                # in place, one new page
    assert kv.pages == [0, 1, 2, 3] and kv.reserved == 1
    m.release(kv)
    assert m.stats()["pages_reserved"] == 0
    m.check_integrity()


def test_reservations_exclude_each_other_and_evict_lru_cache():
    m = make(6)
    finished(m, [1, 2, 3, 4])                     # cached in page 0
    finished(m, [5, 6, 7, 8])                     # cached in page 1
    m.release(m.begin([1, 2, 3, 4, 9], 4))        # touch page 0's node: page 1 is now LRU
    a, b, c = (m.begin([0] * 20, 0) for _ in range(3))
    assert m.reserve(a, 16)                       # exactly the 4 free pages, no eviction
    assert m.stats()["pages_cached"] == 2
    assert m.reserve(b, 4)                        # evicts the LRU entry (page 1)
    assert m.allocator.is_free(1) and not m.allocator.is_free(0)
    before = m.stats()
    assert not m.reserve(c, 8)                    # 2 needed, only page 0 evictable
    assert m.stats() == before and c.reserved == 0
    write(m, a, [0] * 20, 16)
    assert a.pages == [1, 2, 3, 4] and a.reserved == 0
    # c has no reservation: page 5 is b's, so c's extend evicts page 0 ...
    write(m, c, [0] * 20, 1)
    assert c.pages == [0] and m.stats()["pages_cached"] == 0
    # ... and then nothing is left: the error leaves c untouched.
    with pytest.raises(KVPoolExhaustedError):
        m.extend(c, 5)
    assert (c.pages, c.length) == ([0], 1)
    write(m, b, [0] * 20, 4)
    assert b.pages == [5]
    m.check_integrity()


def test_pin_keeps_session_prefix_after_release():
    m = make()
    finished(m, TOKENS)
    toks = TOKENS + [1, 2]
    kv = m.begin(toks, 11)
    write(m, kv, toks, 12)                         # in place into page 2
    m.cache(kv, toks)
    assert (kv.node.start, kv.node.end, kv.node.pages) == (10, 12, [2])
    pin = m.pin(kv)
    m.release(kv)
    s = m.stats()
    assert (s["pages_pinned"], s["pages_cached"], s["pages_referenced"]) == (3, 0, 0)
    assert m.max_reservable() == 13
    assert m.evict(100) == 0
    nxt = m.begin(toks + [3], 12)
    assert (nxt.length, nxt.pages) == (12, [0, 1, 2]) and content(m, nxt) == toks
    m.release(nxt)
    m.unpin(pin)
    m.unpin(pin)                                   # idempotent
    assert m.stats()["pages_pinned"] == 0 and m.stats()["pages_cached"] == 3
    assert m.evict(100) == 3 and m.allocator.num_free == 16
    m.check_integrity()


def test_pool_exhausted_by_pinned_sessions():
    m = make(4)
    toks = list(range(12))
    kv = m.begin(toks, 0)
    write(m, kv, toks, 12)
    m.cache(kv, toks)
    m.pin(kv)
    m.release(kv)
    assert m.max_reservable() == 1                 # a request needing 2 pages can never fit
    other = m.begin([7] * 8, 0)
    assert not m.reserve(other, 8)
    assert m.reserve(other, 4)


def test_cache_moves_lock_to_new_deepest_node():
    m = make()
    kv = m.begin(TOKENS, 9)
    assert kv.node is m.radix.root
    write(m, kv, TOKENS, 6)
    m.cache(kv, TOKENS)
    first = kv.node
    assert (first.end, first.lock_ref) == (6, 1)
    write(m, kv, TOKENS, 10)
    m.cache(kv, TOKENS)
    assert kv.node.parent is first and kv.node.end == 10 and kv.node.lock_ref == 1
    m.check_integrity()                            # lock refs match live sequences exactly
    m.release(kv)
    assert first.lock_ref == 0 and m.radix.root.lock_ref == 0


def test_everything_returns_after_sessions_end():
    m = make()
    finished(m, TOKENS)
    seqs = [m.begin(TOKENS + [i, i + 1, i + 2], 10 + i % 3) for i in range(4)]
    pins = []
    for i, kv in enumerate(seqs):
        toks = TOKENS + [i, i + 1, i + 2]
        m.reserve(kv, 13)
        write(m, kv, toks, 13)
        m.truncate(kv, 11 + i % 2)
        m.cache(kv, toks)
        pins.append(m.pin(kv))
        m.check_integrity()
    for kv in seqs:
        m.release(kv)
        m.release(kv)                              # idempotent
    for pin in pins:
        m.unpin(pin)
    tree_refs = m.radix.page_refs()
    assert all(m.allocator.refcount(p) == tree_refs[p] for p in range(16))
    s = m.stats()
    assert (s["pages_referenced"], s["pages_pinned"], s["pages_reserved"]) == (0, 0, 0)
    assert s["pages_cached"] == 16 - s["pages_free"]
    m.evict(16)
    assert m.allocator.num_free == 16 and not m.radix.root.children
    m.check_integrity()


def test_released_sequence_is_rejected_and_errors_are_typed():
    m = make()
    kv = m.begin(TOKENS, 0)
    write(m, kv, TOKENS, 3)
    with pytest.raises(ValueError):
        m.extend(kv, 2)
    with pytest.raises(ValueError):
        m.truncate(kv, 4)
    with pytest.raises(ValueError):
        m.slots(kv, 0, 4)
    m.release(kv)
    assert (kv.pages, kv.length, kv.node) == ([], 0, None)
    with pytest.raises(ValueError):
        m.extend(kv, 5)
    with pytest.raises(ValueError):
        m.pin(kv)
    with pytest.raises(ValueError):  # fewer pages than the manager hands out
        KVManager(P, 8, KVPool(P, 7, [(1, 1)]))
    with pytest.raises(ValueError):
        KVManager(P, 8, KVPool(P + 1, 8, [(1, 1)]))
    # more: the pages past the manager's are reserved (engine.graphs' scratch page), never
    # allocated
    roomy = KVManager(P, 8, KVPool(P, 9, [(1, 1)]))
    held = roomy.begin(list(range(8 * P)), 0)
    roomy.extend(held, 8 * P)
    assert sorted(held.pages) == list(range(8))
    with pytest.raises(KVPoolExhaustedError):
        roomy.extend(held, 8 * P + 1)


def test_check_integrity_catches_a_leaked_ref():
    m = make()
    finished(m, TOKENS)
    m.allocator.incref(1)
    with pytest.raises(AssertionError):
        m.check_integrity()
