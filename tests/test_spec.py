"""DFlash speculative decoding in the engine: lossless greedy output, exact sampling
distribution, warm drafter state across turns, counters, and clear errors."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from agentflash.engine.attention import DenseCausal
from agentflash.engine.calibration import measure_step_cost
from agentflash.engine.config import CacheConfig, SchedulerConfig, SpecConfig, StepCost
from agentflash.engine.engine import Engine
from agentflash.engine.errors import DrafterMismatchError
from agentflash.engine.models.dflash import load_drafter
from agentflash.engine.models.loader import load_model
from agentflash.engine.sampler import SamplingParams, target_probs
from agentflash.engine.batch import BatchItem
from agentflash.engine.spec import confident_length
from conftest import make_dflash_checkpoint, make_hf_model


def build(tmp_path, vocab: int = 16, draft_layers: int = 2, seed: int = 0, **drafter_kw):
    hf = make_hf_model("qwen3", seed=seed, vocab_size=vocab, bos_token_id=None,
                       eos_token_id=None)
    hf.save_pretrained(tmp_path / "target")
    model = load_model(tmp_path / "target")
    make_dflash_checkpoint(tmp_path / "draft", hf.config, num_layers=draft_layers, seed=seed,
                           **drafter_kw)
    return model, load_drafter(tmp_path / "draft", model)


def prompts_for(n: int, vocab: int, seed: int, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build(tmp_path_factory.mktemp("spec"))


def test_greedy_speculative_equals_plain_over_many_prompts(pair):
    model, drafter = pair
    params = SamplingParams(max_new_tokens=24)
    total = 0
    for block in (2, 3, 4, 6, 8, 11, 16):
        for batch in (1, 3, 8):
            prompts = prompts_for(batch * 3, 16, seed=block * 100 + batch)
            plain = Engine(model, CacheConfig(4, 512)).generate(prompts, params)
            spec = Engine(model, CacheConfig(4, 512), SchedulerConfig(max_running=batch),
                          drafter=drafter, spec=SpecConfig(block),
                          speculation="always").generate(prompts, params)
            assert [c.output_ids for c in spec] == [c.output_ids for c in plain], (block, batch)
            for c in spec:
                assert sum(c.counters.acceptance_lengths) == len(c.output_ids) - 1
                # full blocks, except where the budget's end leaves room for fewer drafts
                n = c.counters.draft_forwards
                assert n <= c.counters.draft_tokens <= (block - 1) * n
            total += len(prompts)
    assert total >= 200


def test_greedy_equality_with_chunked_prefill_sliding_drafter_and_stops(tmp_path):
    model, drafter = build(tmp_path, layer_types=["sliding_attention", "full_attention"],
                           sliding_window=5, seed=1)
    prompts = prompts_for(12, 16, seed=7, hi=50)
    stops = SamplingParams(max_new_tokens=30, stop_token_ids=(3,))
    plain = Engine(model, CacheConfig(4, 512)).generate(prompts, stops)
    spec = Engine(model, CacheConfig(4, 512), SchedulerConfig(max_batch_tokens=13),
                  drafter=drafter, spec=SpecConfig(8),
                  speculation="always").generate(prompts, stops)
    assert [c.output_ids for c in spec] == [c.output_ids for c in plain]
    assert [c.finish_reason for c in spec] == [c.finish_reason for c in plain]


def test_acceptance_happens_and_per_position_counts_are_consistent(pair):
    model, drafter = pair
    engine = Engine(model, CacheConfig(4, 512), drafter=drafter, spec=SpecConfig(4),
                    speculation="always")
    done = engine.generate(prompts_for(16, 16, seed=3), SamplingParams(max_new_tokens=40),
                           trace=True)
    accepted = sum(c.counters.accepted_tokens for c in done)
    assert accepted > 0  # a random 16-token drafter still guesses right sometimes
    for c in done:
        hist = c.counters.acceptance_histogram
        assert sum(hist.values()) == c.counters.draft_forwards
        assert sum(tau * n for tau, n in hist.items()) == sum(c.counters.acceptance_lengths)
        per_pos = c.counters.accepted_per_position
        assert sum(per_pos) == c.counters.accepted_tokens
        assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # a prefix is accepted
        assert len(c.counters.drafts) == c.counters.draft_forwards
        assert c.counters.drafts[0] and all(1 <= len(d) <= 3 for d in c.counters.drafts)
        assert sum(map(len, c.counters.drafts)) == c.counters.draft_tokens
    assert engine.counters.accepted_tokens == accepted
    assert engine.stats()["pages_referenced"] == 0
    engine.kv.check_integrity()


def test_speculation_can_be_turned_off_per_request(pair):
    model, drafter = pair
    engine = Engine(model, CacheConfig(4, 512), drafter=drafter, speculation="always")
    prompts = prompts_for(4, 16, seed=4)
    on, off = engine.generate(prompts[:2], SamplingParams(max_new_tokens=12)), \
        engine.generate(prompts[2:], SamplingParams(max_new_tokens=12), speculative=False)
    assert all(c.counters.draft_forwards > 0 for c in on)
    assert all(c.counters.draft_forwards == 0 for c in off)
    assert all(c.counters.acceptance_lengths == [] for c in off)


@pytest.fixture(scope="module")
def pair_v2(tmp_path_factory):
    return build(tmp_path_factory.mktemp("spec2"), v2=dict(
        conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=4))


@pytest.mark.parametrize("version", ["pair", "pair_v2"], ids=["dflash", "dflash2"])
def test_warm_drafter_state_across_turns(request, version):
    """Turn 2 (after a tool result) drafts from cached context: only new positions computed."""
    model, drafter = request.getfixturevalue(version)
    engine = Engine(model, CacheConfig(4, 512), drafter=drafter, spec=SpecConfig(4),
                    speculation="always")
    turn1 = prompts_for(1, 16, seed=5, hi=30)[0]
    (c1,) = engine.generate([turn1], SamplingParams(max_new_tokens=10), pin=True)
    tool_result = [1, 2, 3, 4, 5, 6]
    turn2 = turn1 + c1.output_ids + tool_result
    seq = engine.submit(turn2, SamplingParams(max_new_tokens=10), pin=True)
    engine.unpin(c1.pin)  # the new turn holds the prefix now
    while not engine.step():
        pass  # until the prompt is prefilled and the first token sampled
    counters = engine.sequence(seq).counters
    new_positions = len(turn2) - (len(turn1) + len(c1.output_ids) - 1)
    assert counters.cached_tokens == len(turn2) - new_positions
    assert counters.prefill_tokens == new_positions
    assert counters.draft_context_tokens == new_positions
    while engine.has_work():
        engine.step()
    c2 = engine.result(seq)
    assert c2.counters.draft_forwards > 0
    plain = Engine(model, CacheConfig(4, 512)).generate([turn2],
                                                        SamplingParams(max_new_tokens=10))
    assert c2.output_ids == plain[0].output_ids


def exact_joint(model, prompt: list[int], params: SamplingParams, n: int) -> dict[tuple, float]:
    """P(first n generated tokens) by enumeration with the target alone."""
    dist = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for prefix, p in dist.items():
            ids = prompt + list(prefix)
            with torch.no_grad():
                out = model(torch.tensor(ids), torch.arange(len(ids)),
                            DenseCausal([len(ids)], model.attention_scale))
                probs = target_probs(model.logits(out.hidden[-1]), params)
            for tok, q in enumerate(probs.tolist()):
                if q > 0:
                    nxt[prefix + (tok,)] = p * q
        dist = nxt
    return dist


def sampled_outputs(engine: Engine, prompt: list[int], params: SamplingParams, total: int
                    ) -> Counter:
    """How often each output comes out of `total` requests for `prompt`, seeded 0 .. total-1."""
    counts: Counter = Counter()
    for start in range(0, total, 500):
        seeded = [SamplingParams(**{**params.__dict__, "seed": s})
                  for s in range(start, min(start + 500, total))]
        for c in engine.generate([prompt] * len(seeded), seeded):
            counts[tuple(c.output_ids)] += 1
    return counts


def chi_square_pvalue(counts: Counter, expected: dict[tuple, float], total: int) -> float:
    stat, df, other_obs, other_exp = 0.0, -1, 0, 0.0
    for key, p in expected.items():
        e = p * total
        if e < 5:
            other_obs, other_exp = other_obs + counts.get(key, 0), other_exp + e
            continue
        stat += (counts.get(key, 0) - e) ** 2 / e
        df += 1
    if other_exp > 0:
        stat += (other_obs - other_exp) ** 2 / other_exp
        df += 1
    if any(key not in expected for key in counts):
        return 0.0  # sampled a sequence the distribution excludes
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))


FREE = StepCost((0.0,) * 3, (1.0,) * 3)  # verifying costs nothing: drafts of either kind


@pytest.mark.parametrize("params,cost", [
    (SamplingParams(temperature=1.0, max_new_tokens=3), None),
    (SamplingParams(temperature=0.7, top_p=0.8, max_new_tokens=3), None),
    (SamplingParams(temperature=1.5, top_k=3, max_new_tokens=3), None),
    (SamplingParams(temperature=1.0, max_new_tokens=4), FREE),  # context drafts too
])
def test_speculative_sampling_matches_target_distribution(tmp_path, params, cost):
    model, drafter = build(tmp_path, vocab=5, seed=2)
    prompt = [1, 3, 0, 2]
    engine = Engine(model, CacheConfig(4, 4096), SchedulerConfig(max_running=128),
                    drafter=drafter, spec=SpecConfig(3, cost=cost),
                    speculation="always" if cost is None else "auto")
    assert_target_distribution(engine, model, prompt, params)
    assert engine.counters.accepted_tokens > 0 and engine.counters.draft_forwards > 0
    if cost is not None:
        assert engine.counters.lookup_accepted > 0


def assert_target_distribution(engine: Engine, model, prompt: list[int], params: SamplingParams,
                               total: int = 4000) -> None:
    """The engine's sampled outputs for `prompt` have the target's joint distribution
    (chi-square), and the test has power: the same samples are rejected against a sharper one."""
    counts = sampled_outputs(engine, prompt, params, total)
    expected = exact_joint(model, prompt, params, params.max_new_tokens)
    assert set(counts) <= set(expected), "sampled a token the distribution excludes"
    assert chi_square_pvalue(counts, expected, total) > 1e-3
    sharper = SamplingParams(**{**params.__dict__, "temperature": params.temperature * 0.5})
    assert chi_square_pvalue(counts, exact_joint(model, prompt, sharper, params.max_new_tokens),
                             total) < 1e-3


def test_a_forward_that_raises_leaves_its_requests_abortable(pair, monkeypatch):
    """A target forward that raises midway (a kernel's check, memory) leaves the step's KV
    extended past what its sequences committed. Aborting them, as the runtime does with every
    live request after a failed step, keeps only their committed tokens' KV, frees every page,
    and the engine serves the next request."""
    model, drafter = pair
    engine = Engine(model, CacheConfig(4, 512), drafter=drafter, spec=SpecConfig(4),
                    speculation="always")
    ids = [engine.submit(p, SamplingParams(max_new_tokens=30)) for p in prompts_for(2, 16, seed=3)]
    engine.step()
    engine.step()

    def boom(*args: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(engine.runner.states, "forward", boom)
    with pytest.raises(RuntimeError, match="boom"):
        engine.step()
    monkeypatch.undo()
    assert any(engine.sequence(i).kv.length > engine.sequence(i).num_tokens for i in ids)
    for i in ids:
        engine.abort(i)
        assert engine.result(i).finish_reason == "abort"
    engine.kv.check_integrity()
    assert engine.stats()["pages_referenced"] == 0
    (done,) = engine.generate(prompts_for(1, 16, seed=4), SamplingParams(max_new_tokens=5))
    assert len(done.output_ids) == 5


def test_bad_speculative_settings_are_clear(tmp_path, pair):
    model, drafter = pair
    with pytest.raises(ValueError, match="block_size"):
        SpecConfig(17)
    with pytest.raises(ValueError, match="block_size"):
        SpecConfig(1)
    other = make_hf_model("qwen3", vocab_size=16, hidden_size=32, num_attention_heads=2,
                          num_key_value_heads=1)
    make_dflash_checkpoint(tmp_path / "small", other.config)
    with pytest.raises(DrafterMismatchError, match="hidden"):
        load_drafter(tmp_path / "small", model)
    make_dflash_checkpoint(tmp_path / "badmask", model.config, mask_token_id=99)
    with pytest.raises(DrafterMismatchError, match="mask"):
        load_drafter(tmp_path / "badmask", model)


def test_confident_length_maximises_tokens_per_unit_of_time():
    cost = StepCost((0.0,) + (0.2,) * 15, tuple(1 + 0.1 * k for k in range(16)))
    # the drafter's 0.2 is paid either way; k tokens commit 1 + 0.9 + 0.9 * 0.8 + ... for
    # 0.2 + 1 + 0.1 (k - 1): 0.83, 1.46, 1.87, 1.79 tokens per plain step for k = 1 .. 4
    assert confident_length([0.9, 0.8, 0.1], cost) == 3
    assert confident_length([0.9, 0.8], cost) == 3              # never past the drafts
    assert confident_length([0.0, 0.9], cost) == 1              # a sure miss first: none
    assert confident_length([], cost) == 1
    steep = StepCost(cost.draft, tuple(1.0 + 4.0 * k for k in range(16)))
    assert confident_length([0.9, 0.8], steep) == 1             # verifying never pays
    flat = StepCost((0.1,) * 16, (1.0,) * 16)                   # a GPU: verifying is free
    assert confident_length([0.3] * 15, flat) == 16
    # the drafter's cost is sunk: even an expensive drafter's drafts are verified if they pay
    dear = StepCost((0.0,) + (50.0,) * 15, cost.verify)
    assert confident_length([0.9, 0.8, 0.1], dear) == 4


def test_step_costs_follow_the_context():
    short = StepCost((0.0, 1.0), (1.0, 2.0), 0.001, context=256)
    long = StepCost((0.0, 1.2), (1.0, 3.0), 0.002, context=2256)
    mid = short.at_context(long, 1256)
    assert mid.context == 1256 and mid.verify == (1.0, 2.5)
    assert mid.draft == pytest.approx((0.0, 1.1)) and mid.plain_s == pytest.approx(0.0015)
    assert short.at_context(long, 10) is short and short.at_context(long, 9999) is long
    spec = SpecConfig(8, cost=short, long_cost=long)
    assert spec.cost_at(1, 1256) == mid
    assert SpecConfig(8, cost=short).cost_at(1, 1256) is short


def drafted_steps(engine: Engine, prompt: list[int], params: SamplingParams, constraint=None):
    """Run one request; per decode step: (drafter ran, drafts verified, tokens committed)."""
    seq = engine.submit(prompt, params, constraint=constraint)
    steps = []
    while engine.has_work():
        forwards = engine.counters.draft_forwards
        for u in engine.step():
            if u.new_token_ids:
                steps.append((engine.counters.draft_forwards > forwards, u.draft_tokens,
                              len(u.new_token_ids)))
    return engine.result(seq), steps[1:]   # the first update is the prefill's token


def test_step_costs_and_confidence_choose_the_verify_length_losslessly(pair):
    model, drafter = pair
    params = SamplingParams(max_new_tokens=40)
    prompts = prompts_for(6, 16, seed=77)
    plain = Engine(model, CacheConfig(4, 512)).generate(prompts, params)
    free = StepCost((0.0,) * 8, (1.0,) * 8)                      # verifying is free
    steep = StepCost((0.0,) * 8, tuple(1.0 + 0.5 * k for k in range(8)))  # a token: +0.5
    for cost in (free, steep, None):
        engine = Engine(model, CacheConfig(4, 512), drafter=drafter,
                        spec=SpecConfig(8, cost=cost, draft_rows=3, lookup=False),
                        speculation="always" if cost is None else "auto")
        for prompt, want in zip(prompts, plain):
            done, steps = drafted_steps(engine, prompt, params)
            assert done.output_ids == want.output_ids
            drafted = [n for ran, n, _ in steps if ran]
            if cost is None:  # full blocks (shorter only where the budget ends)
                assert drafted[:-7] == [7] * (len(drafted) - 7)
            elif cost is free:  # every draft proposed is verified: 3 at first
                assert drafted[0] == 3 and all(n >= 1 for n in drafted)
            else:  # only drafts the drafter is sure enough of (this one never is, of many)
                assert max(drafted) <= 3 and min(drafted) == 0


def test_a_drafter_that_does_not_pay_backs_off_at_doubling_gaps(pair):
    """A drafted step that commits fewer tokens than the plain steps it cost is followed by
    plain steps without the drafter: 1, then 2, 4, .. up to max_backoff (lossless). (The
    drafter's own pacing: no context drafts, which would take the place of its steps.)"""
    model, drafter = pair
    prompt = prompts_for(1, 16, seed=78)[0]
    params = SamplingParams(max_new_tokens=80, ignore_eos=True)
    (plain,) = Engine(model, CacheConfig(4, 512)).generate([prompt], params)
    dear = StepCost((0.0,) + (100.0,) * 7, (1.0,) * 8)          # the drafter never pays
    engine = Engine(model, CacheConfig(4, 512), drafter=drafter,
                    spec=SpecConfig(8, cost=dear, max_backoff=8, lookup=False))
    done, steps = drafted_steps(engine, prompt, params)
    assert done.output_ids == plain.output_ids
    ran = [i for i, (r, _, _) in enumerate(steps) if r]
    gaps = [b - a - 1 for a, b in zip(ran, ran[1:])]
    assert gaps[:5] == [1, 2, 4, 8, 8], steps
    assert all(n == 0 for r, n, _ in steps if not r)             # plain steps in between


def test_draft_rows_grow_after_full_acceptance_and_shrink_back(pair):
    model, drafter = pair
    cheap = StepCost((0.0,) + (0.1,) * 15, (1.0,) * 16)
    engine = Engine(model, CacheConfig(4, 512), drafter=drafter,
                    spec=SpecConfig(16, cost=cheap, draft_rows=3, lookup=False))
    seq_id = engine.submit(prompts_for(1, 16, seed=80)[0], SamplingParams(max_new_tokens=60))
    seq = engine.sequence(seq_id)
    while not seq.output_ids:
        engine.step()
    assert (seq.spec.draft_rows, seq.block_size) == (3, 4)

    def judged(planned: int, drafted: int, accepted: int, kept: int) -> None:
        item = BatchItem(seq, planned)
        item.source, item.cost = "drafter", cheap
        engine.policy.after(item, drafted, accepted, kept, decoding=1)

    judged(4, 3, 3, 4)                          # every draft verified and accepted: double
    assert (seq.spec.draft_rows, seq.block_size) == (7, 8)
    judged(8, 7, 7, 8)
    judged(16, 15, 15, 16)
    assert seq.spec.draft_rows == 15            # never past the block
    judged(16, 4, 2, 3)                         # fewer verified than proposed: halve
    assert seq.spec.draft_rows == 7
    judged(8, 2, 2, 3)
    judged(4, 1, 1, 2)
    assert seq.spec.draft_rows == 3 and seq.spec.cooldown == 0  # not below SpecConfig.draft_rows
    judged(4, 0, 0, 1)                          # one token for a drafter and a verify
    assert seq.spec.cooldown == 1 and seq.block_size == 1
    engine.abort(seq_id)


def test_context_drafts_are_verified_losslessly_where_they_pay(pair):
    """With step costs, a step may verify drafts read from the request's own context instead
    of the drafter's (engine.lookup): greedy output stays plain output, alone or batched, and
    the counters tell the two kinds of drafts apart."""
    model, drafter = pair
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    prompts = prompts_for(6, 16, seed=81)
    plain = Engine(model, CacheConfig(4, 512)).generate(prompts, params)
    steep = StepCost((0.0,) + (0.3,) * 7, tuple(1.0 + 0.2 * k for k in range(8)))
    for batch in (1, 3):
        engine = Engine(model, CacheConfig(4, 512), SchedulerConfig(max_running=batch),
                        drafter=drafter, spec=SpecConfig(8, cost=steep))
        done = engine.generate(prompts, params)
        assert [c.output_ids for c in done] == [c.output_ids for c in plain], batch
        c = engine.counters
        assert c.lookups > 0 and 0 < c.lookup_accepted <= c.lookup_tokens, batch
        for d in done:  # every token after the first: from a plain, drafted or context step
            k = d.counters
            assert k.plain_steps + sum(k.acceptance_lengths) + k.lookup_committed \
                == len(d.output_ids) - 1
        engine.kv.check_integrity()
        assert engine.stats()["pages_referenced"] == 0
    off = Engine(model, CacheConfig(4, 512), drafter=drafter,
                 spec=SpecConfig(8, cost=steep, lookup=False))
    assert [c.output_ids for c in off.generate(prompts, params)] == [c.output_ids for c in plain]
    assert off.counters.lookups == 0


def test_measured_step_costs_are_relative_to_a_plain_step(pair):
    model, drafter = pair
    engine = Engine(model, CacheConfig(4, 512), drafter=drafter, spec=SpecConfig(8),
                    speculation="always")
    cost = measure_step_cost(engine, context=16, steps=2)
    assert cost.plain_s > 0 and cost.context == 16
    assert len(cost.verify) == 8 and cost.verify[0] == 1.0 and min(cost.verify) > 0
    assert len(cost.draft) == 8 and cost.draft[0] == 0.0 and min(cost.draft[1:]) > 0
    assert not engine.has_work() and engine.kv.stats()["pages_cached"] == 0
