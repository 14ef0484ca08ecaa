"""Radix tree over token ids that keeps finished sequences' KV pages for prefix reuse.

Each node covers the token span [start, end) of the path from the root and holds the pages of
page indices floor(start/P) .. ceil(end/P)-1 (P = page_size), one allocator ref on each. Node
boundaries need not be page aligned, so a parent and a child may both hold a page for the
boundary page index, possibly different page ids:

    tokens   0 1 2 3 | 4 5 6 7 | 8 9
    parent   [0, 6)  pages [a, b]        b valid for slots 4, 5
    child    [6, 10) pages [c, d]        c valid for slots 4..7, d for 8, 9

Invariant: the page a deeper node holds for a page index has valid KV for every earlier slot of
that page along its path. So the page table of a path takes, for each page index, the page of
the deepest node covering it (`_page_table`). Nodes held by running sequences or pinned sessions
are locked (`lock_ref` counts locks on the node and its descendants); only unlocked leaves are
evicted, least recently used first.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from typing import Iterable, NamedTuple, Sequence

from .allocator import PageAllocator


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two token lists (slices compared in C:
    O(n log n) element compares, no Python loop per token)."""
    if type(a) is not type(b):
        a, b = list(a), list(b)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class RadixNode:
    """A span [start, end) of tokens on one root path, with the pages of the indices it covers."""

    def __init__(
        self, id: int, parent: RadixNode | None, start: int, tokens: list[int], pages: list[int]
    ) -> None:
        self.id = id  # creation order; tie-break for equal access times
        self.parent = parent
        self.start = start
        self.tokens = tokens
        self.pages = pages
        self.children: dict[int, RadixNode] = {}
        self.lock_ref = 0
        self.last_access = 0
        # a hybrid model's per-sequence state after this node's end (kv.state_pool): what a
        # prefix hit restores besides the pages; dies with the node
        self.state: object | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def path(self) -> list[RadixNode]:
        """Nodes from the root (excluded) down to this node."""
        nodes: list[RadixNode] = []
        node: RadixNode | None = self
        while node is not None and node.parent is not None:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]


class PrefixMatch(NamedTuple):
    node: RadixNode      # node ending exactly at `length` (the root when nothing matched)
    length: int          # number of cached tokens
    pages: list[int]     # page table for those tokens: ceil(length / page_size) pages


class RadixCache:
    """The prefix tree; holds one allocator ref per (node, page) and never allocates pages."""

    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self._ids = itertools.count()
        self.root = RadixNode(next(self._ids), None, 0, [], [])
        self._clock = 0

    def match(self, tokens: Sequence[int], with_state: bool = False) -> PrefixMatch:
        """Longest cached prefix of `tokens`; splits a node so the match ends on a boundary.
        with_state: the longest that ends where a node holds a `state` (or nothing)."""
        node, _ = self._walk(tokens)
        while with_state and node.parent is not None and node.state is None:
            node = node.parent
        self._touch(node)
        return PrefixMatch(node, node.end, self._page_table(node))

    def matched_length(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` the tree holds (`match`'s length, read only: no
        split, no access recorded)."""
        _, pos, _, inside = self._descend(tokens)
        return pos + inside

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> RadixNode:
        """Cache `tokens` whose KV lives in `pages` (page table of ceil(len/P) pages); the
        existing part of the path keeps its pages. Returns the node ending at len(tokens)."""
        P = self.page_size
        num_pages = -(-len(tokens) // P)
        if len(pages) < num_pages:
            raise ValueError(f"{len(pages)} pages cannot hold {len(tokens)} tokens")
        node, length = self._walk(tokens)
        if length < len(tokens):
            first = length // P
            leaf_pages = list(pages[first:num_pages])
            leaf = RadixNode(next(self._ids), node, length, list(tokens[length:]), leaf_pages)
            for i, page in enumerate(leaf_pages):
                self.allocator.incref(page)
                self.allocator.seal(page, min(P, leaf.end - (first + i) * P))
            node.children[leaf.tokens[0]] = leaf
            node = leaf
        self._touch(node)
        return node

    def lock(self, node: RadixNode) -> None:
        n: RadixNode | None = node
        while n is not None:
            n.lock_ref += 1
            n = n.parent

    def unlock(self, node: RadixNode) -> None:
        n: RadixNode | None = node
        while n is not None:
            if n.lock_ref <= 0:
                raise ValueError("unlock of an unlocked radix node")
            n.lock_ref -= 1
            n = n.parent

    def evict(self, num_pages: int) -> int:
        """Evict unlocked leaves, least recently used first, until `num_pages` pages were freed
        (pages still held elsewhere do not count) or nothing is evictable. Returns pages freed."""
        heap = [(n.last_access, n.id, n) for n in self._nodes() if self._evictable_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.tokens[0]]
            leaf.state = None
            freed += sum(self.allocator.decref(page) for page in leaf.pages)
            if self._evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    def evictable_pages(self) -> int:
        """Pages that evicting every unlocked node would free: all their refs are unlocked nodes'.
        (Unlocked nodes form whole subtrees, so repeated leaf eviction reaches all of them.)"""
        refs = Counter(p for n in self._nodes() if n.lock_ref == 0 for p in n.pages)
        return sum(1 for page, c in refs.items() if c == self.allocator.refcount(page))

    def page_refs(self) -> Counter[int]:
        """How many tree refs each page has."""
        return Counter(p for n in self._nodes() for p in n.pages)

    def pages_on_paths(self, nodes: Iterable[RadixNode]) -> set[int]:
        """Distinct pages held by the given nodes and their ancestors."""
        pages: set[int] = set()
        seen: set[int] = set()
        for node in nodes:
            for n in node.path():
                if n.id not in seen:
                    seen.add(n.id)
                    pages.update(n.pages)
        return pages

    def check_integrity(self) -> None:
        P = self.page_size
        assert self.root.parent is None and not self.root.pages and not self.root.tokens
        for node in self._nodes():
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), "lock_ref"
            for key, child in node.children.items():
                assert child.parent is node and child.tokens and child.tokens[0] == key
                assert child.start == node.end, "child does not start where its parent ends"
            if node is self.root:
                continue
            first = node.start // P
            assert len(node.pages) == -(-node.end // P) - first, "node page count"
            for i, page in enumerate(node.pages):
                assert self.allocator.refcount(page) > 0, f"node holds free page {page}"
                assert self.allocator.sealed(page) >= min(P, node.end - (first + i) * P)

    def _walk(self, tokens: Sequence[int]) -> tuple[RadixNode, int]:
        """Follow `tokens` down the tree; split the last node if the match ends inside it."""
        node, pos, child, inside = self._descend(tokens)
        if child is not None:
            return self._split(child, inside), pos + inside
        return node, pos

    def _descend(self, tokens: Sequence[int]
                 ) -> tuple[RadixNode, int, RadixNode | None, int]:
        """Follow `tokens` down the tree: the deepest node matched whole, the tokens matched
        through it, and the child the match ends inside (None if it ends at a node) with how
        many of its tokens match."""
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = common_prefix(child.tokens, tokens[pos:pos + len(child.tokens)])
            if n < len(child.tokens):
                return node, pos, child, n
            node, pos = child, pos + n
        return node, pos, None, 0

    def _split(self, node: RadixNode, n: int) -> RadixNode:
        """Cut `node` after its first n tokens; returns the new upper half (the parent)."""
        P = self.page_size
        parent = node.parent
        assert parent is not None and 0 < n < len(node.tokens)
        cut = node.start + n
        first = node.start // P
        upper_pages = node.pages[: -(-cut // P) - first]
        upper = RadixNode(next(self._ids), parent, node.start, node.tokens[:n], upper_pages)
        upper.lock_ref = node.lock_ref  # every lock on `node` also locks its new ancestor
        upper.last_access = node.last_access
        if cut % P:  # boundary page now held by both halves
            self.allocator.incref(node.pages[cut // P - first])
        node.pages = node.pages[cut // P - first :]
        node.tokens = node.tokens[n:]
        node.start = cut
        node.parent = upper
        parent.children[upper.tokens[0]] = upper
        upper.children[node.tokens[0]] = node
        return upper

    def _page_table(self, node: RadixNode) -> list[int]:
        table: list[int] = []
        for n in node.path():  # deeper nodes overwrite a shared boundary page index
            del table[n.start // self.page_size :]
            table.extend(n.pages)
        return table

    def _touch(self, node: RadixNode) -> None:
        self._clock += 1
        for n in node.path():
            n.last_access = self._clock

    def _evictable_leaf(self, node: RadixNode) -> bool:
        return node is not self.root and not node.children and node.lock_ref == 0

    def _nodes(self) -> list[RadixNode]:
        nodes, stack = [], [self.root]
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes
