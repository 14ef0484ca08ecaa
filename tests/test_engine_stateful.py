"""Randomised engine lifecycle: interleaved submit / step / abort / unpin on a tiny model, with
the KV page invariants checked after every operation and a clean pool at the end."""

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
from conftest import make_hf_model

PREFIXES = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9, 9], [8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8]]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("m")
    make_hf_model("qwen3", vocab_size=32, bos_token_id=None, eos_token_id=None).save_pretrained(path)
    return load_model(path)


class EngineMachine(RuleBasedStateMachine):
    model = None  # set by the test

    def __init__(self) -> None:
        super().__init__()
        self.engine = Engine(self.model, CacheConfig(page_size=3, num_pages=40),
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
            assert self.history.setdefault(key, done.output_ids) == done.output_ids

    @invariant()
    def pages_consistent(self):
        self.engine.kv.check_integrity()
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


def test_engine_lifecycle_keeps_page_invariants(tiny_model):
    EngineMachine.model = tiny_model
    case = EngineMachine.TestCase
    case.settings = settings(max_examples=25, stateful_step_count=25, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])
    with torch.inference_mode():
        case("runTest").runTest()
