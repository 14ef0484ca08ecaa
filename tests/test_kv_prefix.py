"""RadixCache: match/insert with unaligned node boundaries, locks, LRU eviction (exact page ids)."""

from __future__ import annotations

import pytest

from agentflash.engine.kv import PageAllocator, RadixCache
from agentflash.engine.kv.prefix import common_prefix

P = 4


@pytest.fixture
def tree() -> RadixCache:
    return RadixCache(PageAllocator(16), P)


def put(tree: RadixCache, tokens: list[int], pages: list[int] | None = None):
    """Insert as a finished sequence would, then drop the sequence's refs on `pages` (fresh
    pages unless given; the caller holds one ref on each given page)."""
    a = tree.allocator
    if pages is None:
        pages = [a.alloc() for _ in range(-(-len(tokens) // P))]
    node = tree.insert(tokens, pages)
    for p in pages:
        a.decref(p)
    tree.check_integrity()
    return node


def share(tree: RadixCache, *pages: int) -> list[int]:
    """Take a sequence ref on pages the tree already holds."""
    for p in pages:
        tree.allocator.incref(p)
    return list(pages)


def refs(tree: RadixCache, pages: range | list[int]) -> list[int]:
    return [tree.allocator.refcount(p) for p in pages]


def test_match_empty_tree_and_empty_query(tree):
    m = tree.match([1, 2, 3])
    assert (m.node, m.length, m.pages) == (tree.root, 0, [])
    put(tree, [1, 2, 3])
    assert tree.match([]).length == 0


def test_common_prefix():
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix([1, 2, 3], [1, 2]) == 2
    assert common_prefix((1, 2, 3), [1, 2, 4]) == 2
    for n in range(40):
        a = list(range(40))
        b = a[:n] + [-1] + a[n + 1:]
        assert common_prefix(a, b) == n


def test_matched_length_is_matchs_length_without_changing_the_tree(tree):
    put(tree, [1, 2, 3, 4, 5, 6])
    put(tree, [1, 2, 3, 9])
    before = ([(n.start, n.tokens) for n in tree._nodes()], tree._clock)
    for query, n in (([1, 2, 3, 4, 5, 6, 7], 6), ([1, 2, 3, 4, 0], 4), ([1, 2, 3, 9], 4),
                     ([1, 2], 2), ([2], 0), ([], 0)):
        assert tree.matched_length(query) == n
    assert ([(n.start, n.tokens) for n in tree._nodes()], tree._clock) == before
    assert tree.matched_length([1, 2, 3, 4, 0]) == tree.match([1, 2, 3, 4, 0]).length


def test_insert_then_match_longest_prefix(tree):
    toks = list(range(10, 20))
    node = put(tree, toks)
    assert (node.start, node.end, node.pages) == (0, 10, [0, 1, 2])
    assert refs(tree, range(3)) == [1, 1, 1]
    m = tree.match(toks + [99])
    assert (m.node, m.length, m.pages) == (node, 10, [0, 1, 2])
    assert tree.match([10, 11, 12, 13]).pages == [0]
    assert tree.match([99]).length == 0


def test_match_inside_node_splits_and_shares_boundary_page(tree):
    node = put(tree, list(range(10, 20)))
    m = tree.match([10, 11, 12, 13, 14, 15, 77])
    assert (m.length, m.pages) == (6, [0, 1])
    assert (m.node.start, m.node.end, m.node.pages) == (0, 6, [0, 1])
    assert (node.start, node.end, node.pages, node.parent) == (6, 10, [1, 2], m.node)
    assert refs(tree, range(3)) == [1, 2, 1]  # page 1 is held by both halves
    tree.check_integrity()
    # A split at a page boundary shares nothing.
    m2 = tree.match([10, 11, 12, 13])
    assert (m2.node.pages, m2.node.children[14].pages) == ([0], [1])
    assert refs(tree, range(3)) == [1, 2, 1]
    tree.check_integrity()


def test_insert_branch_uses_sequence_pages_after_divergence(tree):
    put(tree, list(range(10, 20)))                       # pages 0, 1, 2
    a = tree.allocator
    # A sequence reused 6 tokens (pages 0, 1) then copied page 1 into 3 and wrote on: [0, 3, 4].
    branch = put(tree, list(range(10, 16)) + [30, 31, 32], [*share(tree, 0), a.alloc(), a.alloc()])
    assert (branch.start, branch.end, branch.pages) == (6, 9, [3, 4])
    assert tree.match(list(range(10, 16)) + [30, 31, 32]).pages == [0, 3, 4]
    assert tree.match(list(range(10, 20))).pages == [0, 1, 2]
    assert tree.match(list(range(10, 16))).pages == [0, 1]
    assert refs(tree, range(5)) == [1, 2, 1, 1, 1]
    assert a.sealed(3) == 4 and a.sealed(4) == 1


def test_insert_existing_path_keeps_tree_pages(tree):
    node = put(tree, list(range(10, 20)))
    a = tree.allocator
    dup = [a.alloc() for _ in range(3)]                 # 3, 4, 5: same tokens, other pages
    assert tree.insert(list(range(10, 20)), dup) is node
    assert refs(tree, dup) == [1, 1, 1]                  # only the caller's refs
    assert tree.match(list(range(10, 20))).pages == [0, 1, 2]
    tree.check_integrity()


def test_insert_extends_leaf_ending_mid_page(tree):
    parent = put(tree, [1, 2, 3, 4, 5])                  # pages 0, 1 (page 1 holds 1 slot)
    # The next turn wrote in place into page 1 (slots 5..7) and then into page 2.
    child = put(tree, [1, 2, 3, 4, 5, 6, 7, 8, 9], [*share(tree, 0, 1), tree.allocator.alloc()])
    assert (child.parent, child.start, child.pages) == (parent, 5, [1, 2])
    assert refs(tree, range(3)) == [1, 2, 1]
    assert tree.allocator.sealed(1) == 4
    assert tree.match([1, 2, 3, 4, 5, 6, 7, 8, 9]).pages == [0, 1, 2]


def test_insert_rejects_too_few_pages(tree):
    with pytest.raises(ValueError):
        tree.insert([1, 2, 3, 4, 5], [tree.allocator.alloc()])


def test_lru_eviction_order(tree):
    put(tree, [1, 1, 1, 1])   # page 0
    put(tree, [2, 2, 2, 2])   # page 1
    put(tree, [3, 3, 3, 3])   # page 2
    tree.match([1, 1])        # touches (and splits) branch 1: now most recently used
    assert tree.evictable_pages() == 3
    assert tree.evict(1) == 1 and tree.allocator.is_free(1)
    assert tree.evict(1) == 1 and tree.allocator.is_free(2)
    assert not tree.allocator.is_free(0)
    assert tree.evict(1) == 1 and tree.allocator.num_free == 16
    assert not tree.root.children
    tree.check_integrity()


def test_locked_path_is_never_evicted(tree):
    a = put(tree, [1, 1, 1, 1, 1])   # pages 0, 1
    put(tree, [2, 2])                # page 2
    tree.lock(a)
    assert tree.evictable_pages() == 1
    assert tree.evict(10) == 1 and tree.allocator.is_free(2)
    assert refs(tree, [0, 1]) == [1, 1]
    tree.unlock(a)
    with pytest.raises(ValueError):
        tree.unlock(a)
    assert tree.evict(10) == 2 and tree.allocator.num_free == 16


def test_lock_on_split_node_protects_new_parent(tree):
    node = put(tree, list(range(8)))
    tree.lock(node)
    upper = tree.match([0, 1, 2]).node       # split above a locked node
    assert upper.lock_ref == 1
    assert tree.evict(10) == 0
    tree.unlock(node)
    assert tree.evict(10) == 2


def test_eviction_counts_only_freed_pages_and_cascades_to_parents(tree):
    a = tree.allocator
    held = a.alloc()                             # page 0, held by a running sequence too
    put(tree, [5, 5, 5], share(tree, held))
    put(tree, list(range(10, 20)))               # pages 1, 2, 3
    put(tree, list(range(10, 16)) + [7, 7], [*share(tree, 1), a.alloc()])  # split at 6; page 4
    # LRU leaves: [5,5,5] (frees nothing: page 0 is still held), [6,10) (pages 2, 3; page 2
    # stays with its parent [0,6)), then the branch, then [0,6) once it became a leaf.
    assert tree.evict(1) == 1
    assert a.refcount(held) == 1 and a.is_free(3) and not a.is_free(2)
    assert tree.evict(3) == 3                    # page 4, then [0,6): pages 1, 2
    assert a.num_free == 15 and not tree.root.children
    tree.check_integrity()


def test_page_refs_and_pages_on_paths(tree):
    put(tree, list(range(10, 20)))
    branch = put(tree, list(range(10, 16)) + [7, 7], [*share(tree, 0), tree.allocator.alloc()])
    assert tree.page_refs() == {0: 1, 1: 2, 2: 1, 3: 1}
    assert tree.pages_on_paths([branch]) == {0, 1, 3}
    assert tree.pages_on_paths([]) == set()
