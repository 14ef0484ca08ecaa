"""The Engine on tiny random float32 Qwen3.5 (hybrid) checkpoints: greedy output equals
transformers' generate with prompts batched together and prefill chunked among decodes; a turn
resumes from the state snapshot where the previous one ended and computes only its new tokens,
with the same output as from scratch; a prefix without a snapshot is recomputed, snapshots are
bounded and go with cleared pages; an abort frees its state slot and KV; speculation on a
hybrid target is refused."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from agentflash.engine.config import CacheConfig, SchedulerConfig
from agentflash.engine.engine import Engine
from agentflash.engine.errors import RequestError, UnsupportedModelError
from agentflash.engine.models.dflash import load_drafter
from agentflash.engine.models.loader import load_model
from agentflash.engine.models.qwen3_5 import HybridCausalLM
from agentflash.engine.sampler import SamplingParams
from test_qwen3_5 import TEXT, make_hf, save_conditional

CACHE = CacheConfig(page_size=4, num_pages=256)
MakeEngine = Callable[..., Engine]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """(checkpoint directory, the transformers model saved there)."""
    hf = make_hf(seed=7)
    path = tmp_path_factory.mktemp("qwen3_5")
    hf.save_pretrained(path)
    return path, hf


@pytest.fixture(scope="module")
def make(hybrid: tuple[Path, Any]) -> MakeEngine:
    model = load_model(hybrid[0])

    def make_engine(**kwargs: Any) -> Engine:
        kwargs.setdefault("cache", CACHE)
        return Engine(model, **kwargs)

    return make_engine


def hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                          min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(TEXT["vocab_size"]) for _ in range(n)] for n in lengths]


def assert_idle_and_clean(engine: Engine) -> None:
    """No page referenced, every state slot free, bookkeeping consistent; and once the cache
    is cleared, every page free and no snapshot left."""
    stats = engine.stats()
    assert stats["pages_referenced"] == 0 and stats["pages_pinned"] == 0, stats
    assert engine.states is not None and engine.states.num_free == engine.states.num_slots
    engine.kv.check_integrity()
    engine.states.check_integrity()
    engine.clear_cache()
    stats = engine.stats()
    assert stats["pages_free"] == stats["pages_total"], stats
    assert engine.states.num_snapshots == 0


def test_from_dir_loads_both_layouts(hybrid: tuple[Path, Any], tmp_path: Path) -> None:
    path, hf = hybrid
    save_conditional(hf, tmp_path / "vl")
    prompt = prompts_of([9], seed=3)[0]
    outputs = []
    for directory in (path, tmp_path / "vl"):
        engine = Engine.from_dir(directory, cache=CACHE)
        assert isinstance(engine.model, HybridCausalLM)
        assert engine.pool.num_layers == engine.config.num_full_layers == 1
        outputs.append(engine.generate([prompt], SamplingParams(max_new_tokens=6))[0].output_ids)
    assert outputs[0] == outputs[1] == hf_greedy(hf, prompt, 6)


def test_eos_ids_come_from_generation_config(hybrid: tuple[Path, Any], tmp_path: Path) -> None:
    path, hf = hybrid
    hf.save_pretrained(tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert load_model(tmp_path / "m").config.eos_token_ids == (5, 7)


def test_greedy_matches_transformers_batched(hybrid: tuple[Path, Any], make: MakeEngine) -> None:
    _, hf = hybrid
    prompts = prompts_of([1, 5, 17, 70, 33, 2])
    expected = [hf_greedy(hf, p, 10) for p in prompts]
    engine = make()
    done = engine.generate(prompts, SamplingParams(max_new_tokens=10))
    assert [c.output_ids for c in done] == expected
    for prompt, c in zip(prompts, done):
        assert c.counters.cached_tokens == 0 and c.counters.prefill_tokens == len(prompt)
    assert_idle_and_clean(engine)


def test_chunked_prefill_among_decodes(hybrid: tuple[Path, Any], make: MakeEngine) -> None:
    """A 7-token budget and 3 running at once: prompts split over several steps, later ones
    admitted (into freed state slots) and prefilled while others decode."""
    _, hf = hybrid
    prompts = prompts_of([23, 4, 70, 12, 9], seed=1)
    expected = [hf_greedy(hf, p, 8) for p in prompts]
    engine = make(scheduler=SchedulerConfig(max_batch_tokens=7, max_running=3))
    assert engine.states is not None and engine.states.num_slots == 3
    ids = [engine.submit(p, SamplingParams(max_new_tokens=8)) for p in prompts]
    mixed = False
    while engine.has_work():
        running = engine.scheduler.running
        mixed |= (any(s.prefilling for s in running)
                  and any(not s.prefilling for s in running))
        engine.step()
    assert mixed, "no step mixed a prefill chunk with decodes"
    assert [engine.result(i).output_ids for i in ids] == expected
    assert_idle_and_clean(engine)


def test_same_prompt_twice_recomputes_it(hybrid: tuple[Path, Any], make: MakeEngine) -> None:
    """The first request's state is kept where it ended, past the prompt: the second one has
    no snapshot to resume from inside its prompt and computes it all (no stale state)."""
    _, hf = hybrid
    prompt = prompts_of([3], seed=2)[0]  # short: a stale state would weigh on every token
    engine = make()
    first, = engine.generate([prompt], SamplingParams(max_new_tokens=10))
    second, = engine.generate([prompt], SamplingParams(max_new_tokens=10))
    assert second.output_ids == first.output_ids == hf_greedy(hf, prompt, 10)
    assert second.counters.cached_tokens == 0
    assert second.counters.prefill_tokens == len(prompt)
    assert_idle_and_clean(engine)


def test_turn_two_computes_only_its_new_tokens(hybrid: tuple[Path, Any], make: MakeEngine
                                               ) -> None:
    """A conversation's next turn resumes from the state snapshot where the last one ended:
    it computes only its new tokens, and its output equals a from-scratch run (and HF's)."""
    _, hf = hybrid
    engine = make()
    prompt, extra, more = prompts_of([40, 9, 6], seed=5)
    first, = engine.generate([prompt], SamplingParams(max_new_tokens=8), pin=True)
    assert first.pin is not None and engine.states is not None
    turn2 = prompt + first.output_ids + extra
    second, = engine.generate([turn2], SamplingParams(max_new_tokens=8), pin=True)
    ended = len(prompt) + len(first.output_ids) - 1   # the last sampled token has no KV yet
    assert second.counters.cached_tokens == ended
    assert second.counters.prefill_tokens == len(turn2) - ended
    assert second.output_ids == hf_greedy(hf, turn2, 8)
    turn3 = turn2 + second.output_ids + more
    third, = engine.generate([turn3], SamplingParams(max_new_tokens=8))
    assert third.counters.cached_tokens == len(turn2) + len(second.output_ids) - 1
    scratch, = engine.generate([turn3], SamplingParams(max_new_tokens=8), reuse=False)
    assert third.output_ids == scratch.output_ids == hf_greedy(hf, turn3, 8)
    for done in (first, second):
        engine.unpin(done.pin)
    assert_idle_and_clean(engine)


def test_a_prefix_without_a_snapshot_is_not_reused(hybrid: tuple[Path, Any], make: MakeEngine
                                                   ) -> None:
    """A prompt that leaves a cached conversation inside it (no state is kept there) resumes
    from the last snapshot before that point, here none: computed whole, output exact."""
    _, hf = hybrid
    engine = make()
    prompt, other = prompts_of([30, 12], seed=6)
    engine.generate([prompt], SamplingParams(max_new_tokens=6))
    branch = prompt[:20] + other
    done, = engine.generate([branch], SamplingParams(max_new_tokens=6))
    assert done.counters.cached_tokens == 0
    assert done.output_ids == hf_greedy(hf, branch, 6)
    assert_idle_and_clean(engine)


def test_snapshots_are_bounded(hybrid: tuple[Path, Any], make: MakeEngine) -> None:
    """With room for one snapshot, the older conversation's is dropped: its next turn computes
    everything (and is still exact); the newer one's resumes."""
    _, hf = hybrid
    engine = make(cache=CacheConfig(page_size=4, num_pages=256, state_snapshots=1))
    a, b, tail = prompts_of([25, 27, 5], seed=8)
    done_a, = engine.generate([a], SamplingParams(max_new_tokens=4))
    done_b, = engine.generate([b], SamplingParams(max_new_tokens=4))
    assert engine.states is not None and engine.states.num_snapshots == 1
    next_a, next_b = a + done_a.output_ids + tail, b + done_b.output_ids + tail
    again_a, = engine.generate([next_a], SamplingParams(max_new_tokens=4))
    assert again_a.counters.cached_tokens == 0
    assert again_a.output_ids == hf_greedy(hf, next_a, 4)
    again_b, = engine.generate([next_b], SamplingParams(max_new_tokens=4))
    assert again_b.counters.cached_tokens == 0  # a's new snapshot took the only place
    assert engine.states.num_snapshots == 1
    assert_idle_and_clean(engine)


def test_abort_frees_state_slot_and_kv(hybrid: tuple[Path, Any], make: MakeEngine) -> None:
    _, hf = hybrid
    engine = make(scheduler=SchedulerConfig(max_running=2))
    assert engine.states is not None
    a, b, c = prompts_of([30, 11, 2], seed=4)
    params = SamplingParams(max_new_tokens=12)
    keep, drop = engine.submit(a, params), engine.submit(b, params)
    for _ in range(4):
        engine.step()
    assert engine.states.num_free == 0
    referenced = engine.stats()["pages_referenced"]
    engine.abort(drop)
    assert engine.result(drop).finish_reason == "abort"
    assert engine.states.num_free == 1
    assert engine.stats()["pages_referenced"] < referenced
    engine.kv.check_integrity()
    engine.states.check_integrity()
    late = engine.submit(c, params)  # takes the aborted request's slot: it must start from zero
    while engine.has_work():
        engine.step()
    assert engine.result(keep).output_ids == hf_greedy(hf, a, 12)
    assert engine.result(late).output_ids == hf_greedy(hf, c, 12)
    assert_idle_and_clean(engine)


def test_speculation_on_hybrid_target_is_refused(
    hybrid: tuple[Path, Any], make: MakeEngine, dflash_checkpoint: Callable[..., Path]
) -> None:
    path, hf = hybrid
    drafter_dir = dflash_checkpoint(hf.config, target_layer_ids=[1, 3])
    with pytest.raises(UnsupportedModelError, match="speculative decoding on hybrid targets"):
        Engine.from_dir(path, draft=drafter_dir, cache=CACHE)
    model = load_model(path)
    with pytest.raises(UnsupportedModelError, match="speculative decoding on hybrid targets"):
        Engine(model, cache=CACHE, drafter=load_drafter(drafter_dir, model))
    engine = make()
    with pytest.raises(RequestError, match="hybrid"):
        engine.submit([1, 2, 3], prediction=[4, 5, 6])
    assert not engine.has_work()


def test_hybrid_models_skip_the_fast_path(hybrid: tuple[Path, Any]) -> None:
    model = load_model(hybrid[0], dtype=torch.bfloat16)
    assert Engine(model, cache=CACHE).fast_paths == []
    with pytest.raises(ValueError, match="hybrid"):
        Engine(model, cache=CACHE, quantize="int4")


@pytest.mark.anyio
async def test_an_agent_on_a_hybrid_model_reuses_its_turns(tmp_path: Path) -> None:
    """The Agent API on a (random) hybrid model with the embedded tokenizer: its second turn
    is cached to the end of the first reply, the state resumed from the snapshot there."""
    import shutil

    from agentflash import Agent, Runtime
    from agentflash.embedded import embedded_model_dir

    make_hf(seed=9, vocab_size=4096, max_position_embeddings=1024).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_model_dir() / name, tmp_path / name)
    runtime = Runtime.load(tmp_path, draft=False)
    try:
        async with Agent(runtime, "You are a helpful assistant.", max_tokens=8) as agent:
            first = await agent.step("Say hello.")
            second = await agent.step("Thanks.")
        u1, u2 = first.usage, second.usage
        assert u2.cached_tokens == u1.prompt_tokens + u1.completion_tokens - 1
        assert u2.compute is not None
        assert u2.compute.prefill_tokens_computed == u2.prompt_tokens - u2.cached_tokens
        assert runtime.stats()["pages_pinned"] == 0
    finally:
        runtime.close()
