"""KVPool tensors (slot layout, copy_page across layer groups) and PageAllocator bookkeeping."""

from __future__ import annotations

import pytest
import torch

from agentflash.engine.errors import KVPoolExhaustedError
from agentflash.engine.kv import KVPool, PageAllocator


def test_pool_shapes_and_add_layers():
    pool = KVPool(4, 3, [(2, 8), (1, 16)], dtype=torch.float16)
    assert [tuple(t.shape) for t in pool.k] == [(12, 2, 8), (12, 1, 16)]
    assert [tuple(t.shape) for t in pool.v] == [(12, 2, 8), (12, 1, 16)]
    assert pool.num_slots == 12 and pool.num_layers == 2
    assert pool.bytes() == 2 * 12 * (2 * 8 + 16) * 2
    added = pool.add_layers([(3, 2)])
    assert added == range(2, 3)
    assert tuple(pool.k[2].shape) == (12, 3, 2) and pool.k[2].dtype == torch.float16
    assert pool.bytes() == 2 * 12 * (2 * 8 + 16 + 3 * 2) * 2


def test_copy_page_copies_prefix_slots_in_every_layer_group():
    pool = KVPool(4, 3, [(2, 3), (1, 5)])
    pool.add_layers([(3, 2)])  # e.g. a drafter's context K/V under the same page ids
    torch.manual_seed(0)
    for t in (*pool.k, *pool.v):
        t.copy_(torch.randn_like(t))
    before = [t.clone() for t in (*pool.k, *pool.v)]
    pool.copy_page(0, 2, 3)
    for old, new in zip(before, (*pool.k, *pool.v)):
        assert torch.equal(new[8:11], old[0:3])   # page 2 slots 0..2 <- page 0 slots 0..2
        assert torch.equal(new[11], old[11])      # slot 3 of page 2 untouched
        assert torch.equal(new[:8], old[:8])      # pages 0 and 1 untouched
    with pytest.raises(ValueError):
        pool.copy_page(0, 3, 1)
    with pytest.raises(ValueError):
        pool.copy_page(0, 1, 5)


def test_allocator_lowest_first_and_refcounts():
    a = PageAllocator(4)
    assert [a.alloc() for _ in range(3)] == [0, 1, 2]
    assert a.num_free == 1
    a.incref(1)
    assert a.refcount(1) == 2
    assert a.decref(1) is False and a.refcount(1) == 1
    assert a.decref(1) is True and a.is_free(1)
    a.decref(0)
    assert a.alloc() == 0  # lowest free id comes back first
    assert a.alloc() == 1
    assert a.alloc() == 3
    with pytest.raises(KVPoolExhaustedError):
        a.alloc()
    a.check_integrity()


def test_allocator_marks_reset_on_free():
    a = PageAllocator(2)
    p = a.alloc()
    a.set_fill(p, 3)
    a.seal(p, 2)
    assert (a.fill(p), a.sealed(p)) == (3, 2)
    with pytest.raises(ValueError):
        a.set_fill(p, 1)  # below the sealed mark
    a.seal(p, 4)
    assert (a.fill(p), a.sealed(p)) == (4, 4)  # sealing implies written
    a.decref(p)
    assert (a.fill(p), a.sealed(p)) == (0, 0)
    with pytest.raises(ValueError):
        a.incref(p)
    with pytest.raises(ValueError):
        a.decref(p)
    a.check_integrity()
