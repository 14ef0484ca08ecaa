"""The Engine on tiny random float32 Qwen3.5 (hybrid) checkpoints: greedy output equals
transformers' generate with prompts batched together and prefill chunked among decodes; a turn
resumes from the state snapshot where the previous one ended and computes only its new tokens,
with the same output as from scratch; a prefix without a snapshot is recomputed, snapshots are
bounded and go with cleared pages; an abort frees its state slot and KV; speculative decoding
(DFlash drafts, predictions) rolls the linear layers' state back with the KV, so greedy output
equals plain at every block size and sampling keeps the target's distribution."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from agentflash.engine.config import CacheConfig, SchedulerConfig, SpecConfig
from agentflash.engine.engine import Engine
from agentflash.engine.models.dflash import load_drafter
from agentflash.engine.models.gated_deltanet import RecurrentStates, replay
from agentflash.engine.models.loader import load_model
from agentflash.engine.cpu.packed import packing_available
from agentflash.engine.models.qwen3_5 import HybridCausalLM
from agentflash.engine.sampler import SamplingParams, target_probs
from agentflash.engine.states import LinearStates
from agentflash.kernels import cpu_ops
from test_qwen3_5 import TEXT, make_hf, save_conditional
from test_spec import chi_square_pvalue, sampled_outputs
from conftest import assert_rows_independent
from skips import EMULATED_BF16_WITH_KERNELS

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
    assert isinstance(engine.states, LinearStates)
    assert engine.states.pool.num_free == engine.states.pool.num_slots
    engine.kv.check_integrity()
    engine.states.pool.check_integrity()
    engine.clear_cache()
    stats = engine.stats()
    assert stats["pages_free"] == stats["pages_total"], stats
    assert engine.states.pool.num_snapshots == 0


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


def test_graphs_refuse_a_hybrid_target(make: MakeEngine) -> None:
    """Graph-replayed forwards (engine.graphs) carry no linear-attention state: a clear error."""
    with pytest.raises(ValueError, match="hybrid target's linear-attention states"):
        make(graphs=True, fast_path=False)


def test_chunked_prefill_among_decodes(hybrid: tuple[Path, Any], make: MakeEngine) -> None:
    """A 7-token budget and 3 running at once: prompts split over several steps, later ones
    admitted (into freed state slots) and prefilled while others decode."""
    _, hf = hybrid
    prompts = prompts_of([23, 4, 70, 12, 9], seed=1)
    expected = [hf_greedy(hf, p, 8) for p in prompts]
    engine = make(scheduler=SchedulerConfig(max_batch_tokens=7, max_running=3))
    assert isinstance(engine.states, LinearStates) and engine.states.pool.num_slots == 3
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
    assert first.pin is not None and isinstance(engine.states, LinearStates)
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


def test_prompts_sharing_a_prefix_resume_from_the_snapshots_inside_it(
    hybrid: tuple[Path, Any], make: MakeEngine
) -> None:
    """Prefill chunks end at every multiple of state_interval and the state is snapshotted
    there and where the prompt ends: a new conversation sharing the first 40 tokens resumes at
    32, one that keeps the whole prompt but not the reply resumes at its end; outputs exact."""
    _, hf = hybrid
    engine = make(cache=CacheConfig(page_size=4, num_pages=256, state_interval=16))
    prompt, other, reply = prompts_of([47, 9, 5], seed=12)
    first, = engine.generate([prompt], SamplingParams(max_new_tokens=6))
    assert first.counters.target_forwards == 3 + 5  # prefill chunks 16, 16, 15; 5 decodes
    assert isinstance(engine.states, LinearStates)
    assert engine.states.pool.num_snapshots == 4  # 16, 32, 47, reply
    branch = prompt[:40] + other
    done, = engine.generate([branch], SamplingParams(max_new_tokens=6))
    assert done.counters.cached_tokens == 32
    assert done.output_ids == hf_greedy(hf, branch, 6)
    redrafted = prompt + reply  # the same prompt, another reply (re-rendered, say)
    done, = engine.generate([redrafted], SamplingParams(max_new_tokens=6))
    assert done.counters.cached_tokens == 47
    assert done.output_ids == hf_greedy(hf, redrafted, 6)
    assert_idle_and_clean(engine)


def test_snapshots_are_bounded(hybrid: tuple[Path, Any], make: MakeEngine) -> None:
    """With room for one snapshot, the older conversation's is dropped: its next turn computes
    everything (and is still exact); the newer one's resumes."""
    _, hf = hybrid
    engine = make(cache=CacheConfig(page_size=4, num_pages=256, state_snapshots=1))
    a, b, tail = prompts_of([25, 27, 5], seed=8)
    done_a, = engine.generate([a], SamplingParams(max_new_tokens=4))
    done_b, = engine.generate([b], SamplingParams(max_new_tokens=4))
    assert isinstance(engine.states, LinearStates) and engine.states.pool.num_snapshots == 1
    next_a, next_b = a + done_a.output_ids + tail, b + done_b.output_ids + tail
    again_a, = engine.generate([next_a], SamplingParams(max_new_tokens=4))
    assert again_a.counters.cached_tokens == 0
    assert again_a.output_ids == hf_greedy(hf, next_a, 4)
    again_b, = engine.generate([next_b], SamplingParams(max_new_tokens=4))
    assert again_b.counters.cached_tokens == 0  # a's new snapshot took the only place
    assert engine.states.pool.num_snapshots == 1
    assert_idle_and_clean(engine)


def test_abort_frees_state_slot_and_kv(hybrid: tuple[Path, Any], make: MakeEngine) -> None:
    _, hf = hybrid
    engine = make(scheduler=SchedulerConfig(max_running=2))
    assert isinstance(engine.states, LinearStates)
    a, b, c = prompts_of([30, 11, 2], seed=4)
    params = SamplingParams(max_new_tokens=12)
    keep, drop = engine.submit(a, params), engine.submit(b, params)
    for _ in range(4):
        engine.step()
    assert engine.states.pool.num_free == 0
    referenced = engine.stats()["pages_referenced"]
    engine.abort(drop)
    assert engine.result(drop).finish_reason == "abort"
    assert engine.states.pool.num_free == 1
    assert engine.stats()["pages_referenced"] < referenced
    engine.kv.check_integrity()
    engine.states.pool.check_integrity()
    late = engine.submit(c, params)  # takes the aborted request's slot: it must start from zero
    while engine.has_work():
        engine.step()
    assert engine.result(keep).output_ids == hf_greedy(hf, a, 12)
    assert engine.result(late).output_ids == hf_greedy(hf, c, 12)
    assert_idle_and_clean(engine)


def test_a_stepwise_block_is_decode_steps_and_replays_to_any_prefix(
    hybrid: tuple[Path, Any],
) -> None:
    """A verify block runs stepwise through a linear layer: token by token, as decode steps
    (to the rounding of its projections, which see 7 rows at once), and replaying the first k
    of its recorded inputs from the state before it gives the state after k decode steps; all
    7 replayed are bit for bit the state the block left (the same arithmetic), so a rejection
    restores the state at the last kept token."""
    model = load_model(hybrid[0])
    assert isinstance(model, HybridCausalLM)
    layer = model.layers[0].linear_attn
    assert layer is not None
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, model.config.hidden_size, generator=g)
    before = RecurrentStates.zeros(model.config, [1], "cpu", model.dtype)
    for t in (*before.conv, *before.recurrent):
        t.copy_(torch.randn(t.shape, generator=g))

    def fresh(lengths: list[int], stepwise: frozenset[int] = frozenset()) -> RecurrentStates:
        return RecurrentStates(lengths, [c.clone() for c in before.conv],
                               [r.clone() for r in before.recurrent], stepwise)

    block = fresh([7], frozenset({0}))
    with torch.no_grad():
        out = layer(x, block)
        decode = fresh([1])
        rows, after = [], []
        for t in range(7):
            rows.append(layer(x[t:t + 1], decode))
            after.append((decode.conv[0][0].clone(), decode.recurrent[0][0].clone()))
    torch.testing.assert_close(out, torch.cat(rows), rtol=1e-5, atol=1e-6)
    inputs = block.inputs[(0, 0)]
    window, state = replay(before.conv[0][0], before.recurrent[0][0], inputs, 7)
    assert torch.equal(window, block.conv[0][0]) and torch.equal(state, block.recurrent[0][0])
    for k in range(7):
        window, state = replay(before.conv[0][0], before.recurrent[0][0], inputs, k)
        want = (before.conv[0][0], before.recurrent[0][0]) if k == 0 else after[k - 1]
        torch.testing.assert_close(window, want[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state, want[1], rtol=1e-5, atol=1e-6)
    # and far from the state the whole block leaves: the test sees a wrong prefix
    assert not torch.allclose(after[2][1], block.recurrent[0][0], atol=1e-3)


QWEN3_6_STYLE = dict(  # as z-lab's Qwen3.6 drafters: YaRN rope, a sliding-window layer
    layer_types=["sliding_attention", "full_attention"], sliding_window=8,
    rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})


DFLASH2_STYLE = dict(  # a DFlash2 drafter: convolutions, a selector, a window shorter than prompts
    layer_types=["sliding_attention"] * 2, sliding_window=8,
    v2=dict(conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=4))


@pytest.mark.parametrize("style, blocks", [({}, range(2, 17)), (QWEN3_6_STYLE, (2, 5, 16)),
                                           (DFLASH2_STYLE, (2, 8, 16))],
                         ids=["qwen3.5-drafter", "qwen3.6-drafter", "dflash2-drafter"])
def test_greedy_dflash_on_a_hybrid_target_equals_plain_at_every_block_size(
    dflash_checkpoint: Callable[..., Path], tmp_path: Path, style: dict, blocks: range,
) -> None:
    """A drafter whose target layers mix linear (1) and full (3) attention, on a small-vocabulary
    hybrid target so that random drafts are often right: at block sizes 2..16, prompts batched
    and each block partly accepted, the output is plain decoding's token for token, and nothing
    leaks."""
    hf = make_hf(seed=11, vocab_size=6)
    hf.save_pretrained(tmp_path / "target")
    model = load_model(tmp_path / "target")
    drafter = load_drafter(dflash_checkpoint(hf.config, target_layer_ids=[1, 3], block_size=16,
                                             **style), model)
    if style:
        assert drafter.layer_kind(0).window == 8
        assert drafter.config.rope.rope_type == "yarn" or drafter.config.v2 is not None
    rng = random.Random(4)
    prompts = [[rng.randrange(6) for _ in range(rng.randint(3, 30))] for _ in range(5)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = [c.output_ids for c in Engine(model, cache=CACHE).generate(prompts, params)]
    assert plain[0] == hf_greedy(hf, prompts[0], 24)
    for block in blocks:
        engine = Engine(model, cache=CACHE, drafter=drafter, spec=SpecConfig(block),
                        speculation="always")
        out = engine.generate(prompts, params)
        assert [c.output_ids for c in out] == plain, f"block {block}"
        c = engine.counters
        assert 0 < c.accepted_tokens < c.draft_tokens, (block, c.accepted_tokens)
        assert_idle_and_clean(engine)


def test_a_moe_hybrid_target(dflash_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    """Qwen3.5-MoE through the Engine: `from_dir` loads both layouts with greedy output equal
    to transformers' generate, a second turn resumes from the first one's end, and greedy DFlash
    output equals plain decoding at block sizes 2, 7 and 16."""
    hf = make_hf(seed=12, moe=True, vocab_size=6)
    hf.save_pretrained(tmp_path / "target")
    save_conditional(hf, tmp_path / "vl")
    rng = random.Random(5)
    prompts = [[rng.randrange(6) for _ in range(rng.randint(3, 30))] for _ in range(4)]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    plain = []
    for directory in (tmp_path / "target", tmp_path / "vl"):
        engine = Engine.from_dir(directory, cache=CACHE)
        assert engine.config.num_experts == 8
        plain.append([c.output_ids for c in engine.generate(prompts, params)])
    assert plain[0] == plain[1]
    assert plain[0][0] == hf_greedy(hf, prompts[0], 20)
    turn2 = prompts[0] + plain[0][0] + [1, 2, 3]
    (again,) = engine.generate([turn2], SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert again.counters.cached_tokens == len(prompts[0]) + 20 - 1
    assert again.output_ids == hf_greedy(hf, turn2, 8)
    model = engine.model
    drafter = load_drafter(dflash_checkpoint(hf.config, target_layer_ids=[1, 3], block_size=16),
                           model)
    for block in (2, 7, 16):
        engine = Engine(model, cache=CACHE, drafter=drafter, spec=SpecConfig(block),
                        speculation="always")
        assert [c.output_ids for c in engine.generate(prompts, params)] == plain[0], block
        assert 0 < engine.counters.accepted_tokens < engine.counters.draft_tokens
        assert_idle_and_clean(engine)


def test_predictions_on_a_hybrid_target_roll_the_state_back(
    hybrid: tuple[Path, Any], make: MakeEngine,
) -> None:
    """Predicted Outputs verify the caller's guess, right up to a wrong token: the output is
    plain decoding's (the steps after the rejection start from the rolled-back state), the
    right part is accepted, and a second turn resumes exactly from where the first ended."""
    path, hf = hybrid
    prompt = prompts_of([14], seed=8)[0]
    want = hf_greedy(hf, prompt, 20)
    guess = want[:6] + [(want[6] + 1) % TEXT["vocab_size"]] + want[7:]
    engine = make()
    seq = engine.submit(prompt, SamplingParams(max_new_tokens=20), prediction=guess)
    while engine.has_work():
        engine.step()
    done = engine.result(seq)
    assert done.output_ids == want
    assert done.counters.prediction_accepted >= 6
    # the prefill, one verify (6 accepted, the 7th rejected: its state rolled back), 13 steps
    assert done.counters.prediction_accepted == 6
    assert done.counters.target_forwards == 1 + 1 + 13
    turn2 = prompt + want + prompts_of([5], seed=9)[0]
    second = engine.submit(turn2, SamplingParams(max_new_tokens=8))
    while engine.has_work():
        engine.step()
    result = engine.result(second)
    assert result.counters.cached_tokens == len(prompt) + len(want) - 1
    assert result.output_ids == hf_greedy(hf, turn2, 8)
    assert_idle_and_clean(engine)


def hf_joint(hf: Any, prompt: list[int], params: SamplingParams, n: int) -> dict[tuple, float]:
    """P(the first n generated tokens) by enumeration with transformers' model."""
    dist: dict[tuple, float] = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for prefix, p in dist.items():
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + list(prefix)])).logits[0, -1]
            for tok, q in enumerate(target_probs(logits, params).tolist()):
                if q > 0:
                    nxt[prefix + (tok,)] = p * q
        dist = nxt
    return dist


def test_dflash_sampling_on_a_hybrid_target_keeps_its_distribution(
    dflash_checkpoint: Callable[..., Path], tmp_path: Path,
) -> None:
    """Sampled with a drafter (blocks of 3, drafts often accepted and often rejected), the joint
    distribution of the first 3 tokens is the target's (chi-square against transformers'
    probabilities), and the test rejects a sharper one."""
    hf = make_hf(seed=12, vocab_size=5)
    hf.save_pretrained(tmp_path / "target")
    model = load_model(tmp_path / "target")
    drafter = load_drafter(dflash_checkpoint(hf.config, target_layer_ids=[0, 3], block_size=3),
                           model)
    prompt = [1, 3, 0, 2, 4, 1]
    params = SamplingParams(temperature=1.0, max_new_tokens=3, ignore_eos=True)
    engine = Engine(model, cache=CacheConfig(page_size=4, num_pages=2048), drafter=drafter,
                    scheduler=SchedulerConfig(max_running=128), speculation="always")
    total = 3000
    counts = sampled_outputs(engine, prompt, params, total)
    c = engine.counters
    assert 0 < c.accepted_tokens < c.draft_tokens
    assert chi_square_pvalue(counts, hf_joint(hf, prompt, params, 3), total) > 1e-3
    sharper = SamplingParams(**{**params.__dict__, "temperature": 0.5})
    assert chi_square_pvalue(counts, hf_joint(hf, prompt, sharper, 3), total) < 1e-3
    assert_idle_and_clean(engine)


def test_hybrid_models_skip_the_fast_path(hybrid: tuple[Path, Any]) -> None:
    """No compiled or kernel decode forward for hybrid models; on a CPU without native bf16
    matmuls (where the kernels run) their linears take the CPU kernel, else they stay as
    loaded."""
    model = load_model(hybrid[0], dtype=torch.bfloat16)
    engine = Engine(model, cache=CACHE)
    assert engine.runner.decode is None
    kernels = not packing_available() and cpu_ops.available()
    assert engine.fast_paths == (["cpu-kernel-linears"] if kernels else [])
    with pytest.raises(ValueError, match="hybrid"):
        Engine(model, cache=CACHE, quantize="int8")


@EMULATED_BF16_WITH_KERNELS.mark
def test_moe_rows_do_not_depend_on_their_batch(tmp_path: Path) -> None:
    """In bfloat16 where the CPU kernels run, a MoE block's experts take the kernel too, so a
    token's output is the same whatever else is in the forward (how many tokens each expert
    got): what keeps a verify block's rows a plain step's, bit for bit."""
    make_hf(seed=13, moe=True).save_pretrained(tmp_path)
    model = load_model(tmp_path, dtype=torch.bfloat16)
    Engine(model, cache=CACHE)
    mlp = model.layers[0].mlp
    assert mlp.experts.kernel
    x = torch.randn(33, TEXT["hidden_size"], generator=torch.Generator().manual_seed(0))
    assert_rows_independent(mlp, x.to(torch.bfloat16))


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
