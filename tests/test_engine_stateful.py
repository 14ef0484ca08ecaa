"""Randomised engine lifecycle: interleaved submit / follow-up / predicted repeat / step / abort /
fork / unpin on a tiny model (Qwen3, and the hybrid Qwen3.5 whose follow-ups, forks and shared
prefixes resume from state snapshots taken inside prompts, at their ends and at replies' ends,
and whose predictions roll the state back), with the KV page and state slot invariants checked
after every operation, every greedy output equal to the same prompt's from scratch (so a
restored snapshot is the state the prefix computes), and a clean pool at the end."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from agentflash.engine.config import CacheConfig, SchedulerConfig
from agentflash.engine.engine import Engine
from agentflash.engine.errors import KVPoolExhaustedError
from agentflash.engine.models.loader import load_model
from agentflash.engine.sampler import SamplingParams
from agentflash.engine.states import LinearStates
from conftest import make_hf_model
from test_qwen3_5 import make_hf as make_hybrid

PREFIXES = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9, 9], [8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8]]


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def tiny_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("m")
    if request.param == "qwen3":
        hf = make_hf_model("qwen3", vocab_size=32, bos_token_id=None, eos_token_id=None)
    else:
        hf = make_hybrid(seed=3, vocab_size=32, bos_token_id=None, eos_token_id=None)
    hf.save_pretrained(path)
    return load_model(path)


class EngineMachine(RuleBasedStateMachine):
    model = None  # set by the test
    scratch: dict[tuple, list[int]] = {}   # (prompt, new) -> greedy output from an empty cache
    resumed = 0   # finished sequences that started from a cached prefix (a snapshot if hybrid)

    def __init__(self) -> None:
        super().__init__()
        # a hybrid model snapshots its state every 4 prompt tokens (partial pages shared
        # mid-prefill) and at prompt ends, as well as where replies end
        self.engine = Engine(self.model, CacheConfig(page_size=3, num_pages=40, state_interval=4),
                             SchedulerConfig(max_batch_tokens=16, max_running=4))
        self.live: set[int] = set()
        self.pins: list = []
        self.history: dict[tuple, list[int]] = {}  # prompt -> greedy output, must never change

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 31), max_size=6),
          new=st.integers(1, 6), pin=st.booleans())
    def submit(self, prefix, tail, new, pin):
        try:
            self.live.add(self.engine.submit(prefix + tail, SamplingParams(max_new_tokens=new),
                                             pin=pin))
        except KVPoolExhaustedError:
            assert self.pins, "only pinned sessions can exhaust this pool"

    @precondition(lambda self: self.history)
    @rule(data=st.data(), tail=st.lists(st.integers(0, 31), min_size=1, max_size=4),
          new=st.integers(1, 6), pin=st.booleans())
    def follow_up(self, data, tail, new, pin):
        """The next turn of a finished conversation (a hybrid model resumes from its state)."""
        (prompt, _), output = data.draw(st.sampled_from(sorted(self.history.items())))
        try:
            self.live.add(self.engine.submit(list(prompt) + output + tail,
                                             SamplingParams(max_new_tokens=new), pin=pin))
        except KVPoolExhaustedError:
            assert self.pins, "only pinned sessions can exhaust this pool"

    @precondition(lambda self: self.history)
    @rule(data=st.data(), wrong=st.integers(0, 5), pin=st.booleans())
    def predicted(self, data, wrong, pin):
        """A prompt run before, with its output as the prediction but one token wrong: verified
        as drafts, rolled back at the wrong one (a hybrid model's state too); the output must
        be what it was."""
        (prompt, new), output = data.draw(st.sampled_from(sorted(self.history.items())))
        guess = list(output)
        guess[wrong % len(guess)] = (guess[wrong % len(guess)] + 1) % 32
        try:
            self.live.add(self.engine.submit(list(prompt), SamplingParams(max_new_tokens=new),
                                             pin=pin, prediction=guess))
        except KVPoolExhaustedError:
            assert self.pins, "only pinned sessions can exhaust this pool"

    @precondition(lambda self: self.live)
    @rule()
    def step(self):
        for update in self.engine.step():
            if update.finished:
                self._collect(update.seq_id)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        seq = data.draw(st.sampled_from(sorted(self.live)))
        self.engine.abort(seq)
        self._collect(seq)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def fork(self, data):
        """A second session on a pinned conversation (a forked agent): its follow-ups and the
        original's resume from the same prefix and diverge."""
        pin = self.pins[data.draw(st.integers(0, len(self.pins) - 1))]
        self.pins.append(self.engine.share_pin(pin))

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        self.engine.unpin(self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1))))

    def _collect(self, seq: int) -> None:
        self.live.discard(seq)
        done = self.engine.result(seq)
        if done.pin is not None:
            self.pins.append(done.pin)
        if done.finish_reason == "length":
            # a prompt's greedy continuation does not depend on what else ran or was cached
            key = (tuple(done.prompt_ids), len(done.output_ids))
            assert done.output_ids == self.from_scratch(key), key
            self.history[key] = done.output_ids
            if done.counters.cached_tokens:
                type(self).resumed += 1

    def from_scratch(self, key: tuple) -> list[int]:
        """The greedy output of (prompt, new) on a fresh engine: nothing cached."""
        if key not in self.scratch:
            engine = Engine(self.model, CacheConfig(page_size=3, num_pages=40))
            (done,) = engine.generate([list(key[0])], SamplingParams(max_new_tokens=key[1]))
            self.scratch[key] = done.output_ids
        return self.scratch[key]

    @invariant()
    def pages_consistent(self):
        self.engine.kv.check_integrity()
        if isinstance(self.engine.states, LinearStates):
            self.engine.states.pool.check_integrity()
            assert self.engine.states.pool.num_snapshots <= self.engine.states.pool.max_snapshots
        s = self.engine.stats()
        assert s["pages_free"] + s["pages_cached"] <= s["pages_total"]
        if not self.live:
            assert s["pages_referenced"] == 0

    def teardown(self):
        while self.engine.has_work():
            for update in self.engine.step():
                if update.finished:
                    self._collect(update.seq_id)
        for pin in self.pins:
            self.engine.unpin(pin)
        s = self.engine.stats()
        assert s["pages_referenced"] == s["pages_pinned"] == s["pages_reserved"] == 0
        self.engine.kv.evict(s["pages_total"])
        assert self.engine.stats()["pages_free"] == s["pages_total"]
        self.engine.kv.check_integrity()
        if isinstance(self.engine.states, LinearStates):  # every slot back, no snapshot left
            assert self.engine.states.pool.num_free == self.engine.states.pool.num_slots
            assert self.engine.states.pool.num_snapshots == 0


def test_engine_lifecycle_keeps_page_invariants(tiny_model):
    EngineMachine.model = tiny_model
    EngineMachine.scratch, EngineMachine.resumed = {}, 0
    case = EngineMachine.TestCase
    case.settings = settings(max_examples=25, stateful_step_count=25, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])
    with torch.inference_mode():
        case("runTest").runTest()
    assert EngineMachine.resumed > 0   # the runs did resume from cached prefixes
