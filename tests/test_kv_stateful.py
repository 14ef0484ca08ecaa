"""Randomized KVManager check: interleaved operations on a tiny pool with real KV content.

Each token id is written as its K (and V, in two layer groups) on extend; after every operation
every live sequence's page table must read back exactly its tokens, which proves that prefix
sharing, copy-on-write, truncation and eviction never corrupt anyone's KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from agentflash.engine.errors import KVPoolExhaustedError
from agentflash.engine.kv import KVManager, KVPool, Pin, SeqKV

MAX_LEN = 24
TOKENS = st.lists(st.integers(0, 30), max_size=8)
RECENT = st.integers(0, 3) | st.integers(0, 99)  # counted from the newest: favours fork pairs


@dataclass
class Seq:
    kv: SeqKV
    tokens: list[int]          # tokens[:kv.length] are written; the rest is the unwritten prompt
    node_tokens: list[int]     # tokens of the path ending at kv.node (what a pin keeps)
    promise: int | None = None  # extends up to here must succeed (granted by reserve) ...
    floor: int = 0              # ... unless cached or truncated below its length at reserve


class KVMachine(RuleBasedStateMachine):
    P, N = 4, 14  # page size, pages: small enough that eviction and exhaustion are common

    def __init__(self) -> None:
        super().__init__()
        P, N = self.P, self.N
        self.pool = KVPool(P, N, [(1, 1)])
        self.pool.add_layers([(1, 1)])  # a second layer group, like a drafter's context K/V
        self.m = KVManager(P, N, self.pool)
        self.seqs: list[Seq] = []
        self.pins: list[tuple[Pin, list[int]]] = []
        self.history: list[list[int]] = [[]]  # token sequences to build shared prompts from

    def write(self, seq: Seq, new_len: int) -> None:
        start = seq.kv.length
        slots = self.m.extend(seq.kv, new_len)
        ids = torch.tensor(seq.tokens[start:new_len], dtype=torch.float32)
        for g, (k, v) in enumerate(zip(self.pool.k, self.pool.v)):
            k[slots, 0, 0] = ids + 100 * g
            v[slots, 0, 0] = -ids - 100 * g

    @rule(base=st.integers(0, 99), cut=st.integers(0, MAX_LEN), suffix=TOKENS,
          cap=st.integers(0, MAX_LEN))
    def begin(self, base: int, cut: int, suffix: list[int], cap: int) -> None:
        tokens = (self.history[base % len(self.history)][:cut] + suffix)[:MAX_LEN]
        kv = self.m.begin(tokens, cap)
        assert kv.length <= min(cap, len(tokens))
        for _, pinned in self.pins:  # pinned prefixes are never evicted
            if tokens[: len(pinned)] == pinned and len(pinned) <= cap:
                assert kv.length >= len(pinned)
        self.seqs.append(Seq(kv, tokens, tokens[: kv.length]))
        self.history = (self.history + [tokens])[-20:]

    def promised(self, seq: Seq, total: int) -> None:
        seq.floor = seq.kv.length
        seq.promise = max(total, seq.promise or 0)

    def pick(self, i: int) -> Seq:
        return self.seqs[-1 - i % len(self.seqs)]

    def grow(self, seq: Seq, n: int, fresh: list[int]) -> None:
        """Extend by n tokens (the prompt's next ones, then `fresh` "generated" ones)."""
        kv, before = seq.kv, (list(seq.kv.pages), seq.kv.length, seq.kv.reserved)
        new_len = min(kv.length + n, MAX_LEN)
        missing = new_len - len(seq.tokens)  # beyond the prompt: "generated" tokens
        if missing > 0:
            seq.tokens += (fresh + [0] * missing)[:missing]
        try:
            self.write(seq, new_len)
        except KVPoolExhaustedError:
            assert seq.promise is None or new_len > seq.promise, "a reservation was broken"
            assert (kv.pages, kv.length, kv.reserved) == before

    @precondition(lambda self: self.seqs)
    @rule(i=RECENT, n=st.integers(0, 6), fresh=TOKENS)
    def extend(self, i: int, n: int, fresh: list[int]) -> None:
        self.grow(self.pick(i), n, fresh)

    @precondition(lambda self: self.seqs)
    @rule(n=st.integers(1, 5), order=st.permutations(range(8)), fresh=TOKENS)
    def engine_step(self, n: int, order: list[int], fresh: list[int]) -> None:
        """As the scheduler does: reserve for every sequence, then extend (in any order) those
        that got their reservation; a granted reservation must make its extend succeed."""
        granted = []
        for seq in self.seqs:
            total = min(seq.kv.length + n, MAX_LEN)
            if self.m.reserve(seq.kv, total):
                self.promised(seq, total)
                granted.append(seq)
        for j in order:
            if j < len(granted):
                self.grow(granted[j], n, fresh)

    @precondition(lambda self: self.seqs)
    @rule(i=RECENT, n=st.integers(0, 8))
    def reserve(self, i: int, n: int) -> None:
        seq = self.pick(i)
        total = min(seq.kv.length + n, MAX_LEN)
        before = self.m.stats()
        if self.m.reserve(seq.kv, total):
            self.promised(seq, total)
        else:
            assert self.m.stats() == before

    @precondition(lambda self: self.seqs)
    @rule(i=RECENT, back=st.integers(0, 6) | st.integers(0, MAX_LEN))
    def truncate(self, i: int, back: int) -> None:
        seq = self.pick(i)
        n = max(0, seq.kv.length - back)
        self.m.truncate(seq.kv, n)
        seq.tokens = seq.tokens[:n]  # rejected tokens are redrawn
        if n < seq.floor:
            seq.promise = None

    @precondition(lambda self: self.seqs)
    @rule(i=RECENT)
    def cache(self, i: int) -> None:
        seq = self.pick(i)
        self.m.cache(seq.kv, seq.tokens)
        seq.node_tokens, seq.promise = seq.tokens[: seq.kv.length], None
        self.history = (self.history + [seq.node_tokens])[-20:]

    @precondition(lambda self: self.seqs)
    @rule(i=RECENT, suffix=TOKENS)
    def fork(self, i: int, suffix: list[int]) -> None:
        """Cache a sequence and start another on its full prefix: the two now share the
        (often partial) last page, the case copy-on-write exists for."""
        self.cache(i)
        seq = self.pick(i)
        tokens = seq.node_tokens + suffix
        kv = self.m.begin(tokens, len(seq.node_tokens))
        assert kv.length == len(seq.node_tokens)  # just cached and locked: a full hit
        self.seqs.append(Seq(kv, tokens, tokens[: kv.length]))

    @precondition(lambda self: self.seqs)
    @rule(i=RECENT)
    def pin(self, i: int) -> None:
        seq = self.pick(i)
        self.pins.append((self.m.pin(seq.kv), seq.node_tokens))

    @precondition(lambda self: self.pins)
    @rule(i=RECENT, twice=st.booleans())
    def unpin(self, i: int, twice: bool) -> None:
        pin, _ = self.pins.pop(-1 - i % len(self.pins))
        self.m.unpin(pin)
        if twice:
            self.m.unpin(pin)

    @precondition(lambda self: self.seqs)
    @rule(i=RECENT, twice=st.booleans())
    def release(self, i: int, twice: bool) -> None:
        seq = self.seqs.pop(-1 - i % len(self.seqs))
        self.m.release(seq.kv)
        if twice:
            self.m.release(seq.kv)

    @rule(n=st.integers(0, 16))
    def evict(self, n: int) -> None:
        free = self.m.allocator.num_free
        freed = self.m.evict(n)
        assert self.m.allocator.num_free == free + freed

    @invariant()
    def consistent(self) -> None:
        self.m.check_integrity()
        s = self.m.stats()
        used = set(self.m.radix.page_refs()) | {p for q in self.seqs for p in q.kv.pages}
        assert s["pages_free"] == self.N - len(used)
        assert s["pages_reserved"] <= s["pages_free"]
        assert s["pages_cached"] + s["pages_referenced"] <= len(used)
        assert self.m.max_reservable() == self.N - s["pages_pinned"]

    @invariant()
    def reservations_cover_promises(self) -> None:
        """What extending to a promised length would allocate right now is already reserved,
        whatever other sequences did since (e.g. wrote past a shared partial page)."""
        for seq in self.seqs:
            kv = seq.kv
            if seq.promise is None or seq.promise <= kv.length:
                continue
            need = -(-seq.promise // self.P) - len(kv.pages)
            offset = kv.length % self.P
            if offset and self.m.allocator.fill(kv.pages[-1]) != offset:
                need += 1  # copy-on-write
            assert need <= kv.reserved, "a reservation no longer covers its promise"

    @invariant()
    def content_intact(self) -> None:
        for seq in self.seqs:
            slots = self.m.slots(seq.kv, 0, seq.kv.length)
            want = torch.tensor(seq.tokens[: seq.kv.length], dtype=torch.float32)
            for g, (k, v) in enumerate(zip(self.pool.k, self.pool.v)):
                assert torch.equal(k[slots, 0, 0], want + 100 * g), "K corrupted"
                assert torch.equal(v[slots, 0, 0], -want - 100 * g), "V corrupted"

    def teardown(self) -> None:
        for seq in self.seqs:
            self.m.release(seq.kv)
        for pin, _ in self.pins:
            self.m.unpin(pin)
        tree_refs = self.m.radix.page_refs()
        assert all(self.m.allocator.refcount(p) == tree_refs[p] for p in range(self.N))
        self.m.evict(self.N)
        assert self.m.allocator.num_free == self.N and not self.m.radix.root.children
        self.m.check_integrity()


class OddPageMachine(KVMachine):
    P, N = 3, 18


SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestKVMachine = KVMachine.TestCase
TestKVMachine.settings = settings(max_examples=150, stateful_step_count=50, **SETTINGS)
TestOddPageMachine = OddPageMachine.TestCase
TestOddPageMachine.settings = settings(max_examples=50, stateful_step_count=50, **SETTINGS)
