"""Graph-replayed decode/verify and drafter forwards (engine.graphs) on CPU: everything but the
CUDA capture. Bucket choice; an engine whose steps replay per-bucket graphs gives the eager
engine's greedy tokens with and without a drafter, over turns whose page tables change; a replay
reads the page tables its own step wrote into the buffers; steps with no bucket, over the graph
limit, or whose capture fails run eager with a message and the same tokens."""

from __future__ import annotations

import logging

import pytest
import torch

from agentflash.engine.attention import PagedAttention
from agentflash.engine.config import CacheConfig, SchedulerConfig, SpecConfig
from agentflash.engine.engine import Engine
from agentflash.engine.graphs import (Bucket, GraphBatch, GraphBuckets, GraphDecodeForward,
                                      eager_replay)
from agentflash.engine.kv.pool import KVPool
from agentflash.engine.models.dflash import load_drafter
from agentflash.engine.models.loader import load_model
from agentflash.engine.sampler import SamplingParams
from conftest import make_dflash_checkpoint, make_hf_model

PAGE = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("graphs")
    hf = make_hf_model("qwen3", vocab_size=64, bos_token_id=None, eos_token_id=None)
    hf.save_pretrained(tmp / "target")
    model = load_model(tmp / "target", dtype=torch.float32, device="cpu")
    make_dflash_checkpoint(tmp / "dflash", hf.config, num_layers=2, block_size=4,
                           layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    make_dflash_checkpoint(tmp / "dflash2", hf.config, block_size=4,
                           layer_types=["sliding_attention"] * 2, sliding_window=5,
                           v2={"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8,
                               "selector_top_k": 4})
    return model, {"dflash": load_drafter(tmp / "dflash", model),
                   "dflash2": load_drafter(tmp / "dflash2", model)}


def _engine(model, drafter=None, graphs=False, max_running=64):
    return Engine(model, CacheConfig(PAGE, 160), SchedulerConfig(max_running=max_running),
                  drafter=drafter, spec=SpecConfig(4), speculation="always", fast_path=False,
                  graphs=graphs)


def _turns(engine):
    """Two rounds: four prompts of different lengths, then each extended by its reply and a
    new message (prefix-cache hits, new pages), in another order; greedy tokens of both."""
    prompts = [[1, 2, 3], list(range(5, 40)), [7] * 9, list(range(3, 20))]
    first = [c.output_ids for c in engine.generate(prompts, SamplingParams(max_new_tokens=12))]
    again = [p + out + [9, 8] for p, out in zip(prompts, first)][::-1]
    second = [c.output_ids for c in engine.generate(again, SamplingParams(max_new_tokens=10))]
    return first, second


def test_buckets_are_the_smallest_that_hold_a_step() -> None:
    buckets = GraphBuckets(batch=(1, 2, 4, 8), queries=(1, 4, 16), pages=(1, 2, 4, 8, 16))
    assert buckets.choose(1, 1, 1) == Bucket(1, 1, 1)
    assert buckets.choose(3, 1, 5) == Bucket(4, 1, 8)
    assert buckets.choose(8, 2, 16) == Bucket(8, 4, 16)
    assert buckets.choose(5, 16, 9) == Bucket(8, 16, 16)
    for beyond in ((9, 1, 1), (1, 17, 1), (1, 1, 17)):
        assert buckets.choose(*beyond) is None
    made = GraphBuckets.for_engine(max_running=12, max_model_len=1000, page_size=16)
    assert made.batch == (1, 2, 4, 8, 16) and made.pages[-1] == 64 and made.queries[0] == 1
    with pytest.raises(ValueError, match="ascending"):
        GraphBuckets(batch=(4, 2))
    with pytest.raises(ValueError, match="max_graphs"):
        GraphBuckets(max_graphs=0)


@pytest.mark.parametrize("draft", [None, "dflash", "dflash2"])
def test_replayed_steps_give_the_eager_engines_tokens(models, draft) -> None:
    model, drafters = models
    drafter = drafters.get(draft)
    eager = _turns(_engine(model, drafter))
    engine = _engine(model, drafter, graphs=True)
    assert _turns(engine) == eager
    assert engine.pool.num_pages == engine.kv.allocator.num_pages + 1  # the scratch page
    engine.kv.check_integrity()
    forwards = [engine.runner.decode] + ([engine.runner.drafter.forward] if drafter else [])
    for forward in forwards:
        stats = forward.stats
        assert stats.eager == 0 and stats.captures == len(forward.graphs.graphs)
        assert stats.replays > 2 * stats.captures  # each graph serves many steps
    if drafter is not None:
        assert engine.counters.draft_forwards > 0 and engine.counters.draft_tokens > 0


def test_a_replay_reads_the_page_tables_its_step_wrote(models) -> None:
    """One bucket, two steps whose sequences sit on other pages: each replay's logits are the
    eager forward's for its own step (a replay reading the first step's tables would not be)."""
    model, _ = models
    cfg = model.config
    torch.manual_seed(0)
    pool = KVPool(PAGE, 9, [(cfg.num_key_value_heads, cfg.head_dim)] * cfg.num_kv_layers)
    for cache in (*pool.k, *pool.v):
        cache.normal_()
    forward = GraphDecodeForward(model, None, PAGE, 8, GraphBuckets(), eager_replay)
    steps = [([[0, 3, 5], [1, 2]], [10, 7], [1, 2]),
             ([[6, 4], [2, 7, 0]], [6, 12], [2, 1])]
    for page_tables, ctx_lens, num_new in steps:
        ids = torch.randint(0, cfg.vocab_size, (sum(num_new),))
        positions = torch.tensor([c - n + i for c, n in zip(ctx_lens, num_new) for i in range(n)])
        k_ref = [c.clone() for c in pool.k]
        v_ref = [c.clone() for c in pool.v]
        attn = PagedAttention.build(k_ref, v_ref, page_tables, ctx_lens, num_new, PAGE,
                                    model.attention_scale)
        with torch.inference_mode():
            want = model.logits(model(ids, positions, attn).hidden)
            batch = forward.args(ids, positions, GraphBatch(pool.k, pool.v, page_tables,
                                                            ctx_lens, num_new))
            got = forward(batch, pool.k, pool.v)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        for mine, theirs in zip(pool.k, k_ref):  # the same K/V stored, nothing else touched
            torch.testing.assert_close(mine[: 8 * PAGE], theirs[: 8 * PAGE])
    assert forward.stats.captures == 1 and forward.stats.replays == 2
    assert list(forward.graphs.graphs) == [Bucket(2, 2, 4)]


def test_steps_without_a_graph_run_eager_and_say_why(models, caplog) -> None:
    model, drafters = models
    want = _turns(_engine(model, drafters["dflash"]))
    small = GraphBuckets(batch=(1, 2), queries=(1, 2, 4), pages=tuple(2 ** i for i in range(7)))
    with caplog.at_level(logging.WARNING, logger="agentflash.engine"):
        engine = _engine(model, drafters["dflash"], graphs=small)
        assert _turns(engine) == want
    decode = engine.runner.decode
    assert decode.stats.eager > 0 and decode.stats.replays > 0
    assert any("beyond the largest bucket" in r.message for r in caplog.records)
    # said once per reason, not once per step
    assert sum("beyond the largest bucket" in r.message and "decode" in r.message
               for r in caplog.records) == 1

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="agentflash.engine"):
        engine = _engine(model, graphs=GraphBuckets(max_graphs=1))
        assert _turns(engine)[0] == _turns(_engine(model))[0]
    assert len(engine.runner.decode.graphs.graphs) == 1 and engine.runner.decode.stats.eager > 0
    assert any("GraphBuckets.max_graphs" in r.message for r in caplog.records)


def test_a_failed_capture_leaves_every_step_eager(models, caplog, monkeypatch) -> None:
    model, _ = models
    want = _turns(_engine(model))
    calls = []

    def failing(forward):
        calls.append(forward)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr("agentflash.engine.graphs.eager_replay", failing)
    with caplog.at_level(logging.WARNING, logger="agentflash.engine"):
        engine = _engine(model, graphs=True)
        assert _turns(engine) == want
    assert len(calls) == 1  # tried once, then never again
    assert engine.runner.decode.stats.replays == 0 and engine.runner.decode.stats.eager > 0
    assert [r.message for r in caplog.records if "capturing failed" in r.message][0].count(
        "stream is capturing") == 1
