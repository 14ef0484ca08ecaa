"""Predicted Outputs in the engine: a caller's prediction is verified as drafts, so the output is
the target's own (greedy: token for token; sampling: its distribution), whether the prediction
is right, partly right or wrong, with or without a drafter and under a grammar; a right
prediction takes fewer target forwards, and the counters say how much of it was accepted."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from agentflash.engine.config import CacheConfig, SchedulerConfig, SpecConfig
from agentflash.engine.engine import Engine
from agentflash.engine.errors import RequestError
from agentflash.engine.sampler import SamplingParams
from test_constraint import Cycle, obeys
from test_spec import build, chi_square_pvalue, exact_joint, prompts_for

VOCAB = 16


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build(tmp_path_factory.mktemp("prediction"), vocab=VOCAB, seed=3)


def predictions(plain: list[int], rng: random.Random) -> list[list[int]]:
    """Right, right then wrong, wrong from the start, too long, and empty."""
    cut = len(plain) // 2
    wrong = [(t + 1) % VOCAB for t in plain]
    return [plain, plain[:cut] + wrong[cut:], wrong, plain + plain, [],
            [rng.randrange(VOCAB) for _ in range(5)]]


@pytest.mark.parametrize("with_drafter", [False, True])
def test_greedy_output_is_the_targets_whatever_the_prediction(pair, with_drafter):
    model, drafter = pair
    params = SamplingParams(max_new_tokens=24)
    prompts = prompts_for(6, VOCAB, seed=11)
    plain = Engine(model, CacheConfig(4, 512)).generate(prompts, params)
    engine = Engine(model, CacheConfig(4, 512), SchedulerConfig(max_running=64),
                    drafter=drafter if with_drafter else None, spec=SpecConfig(6),
                    speculation="always")
    rng = random.Random(0)
    for prompt, reference in zip(prompts, plain):
        guesses = predictions(reference.output_ids, rng)
        ids = [engine.submit(prompt, params, prediction=g) for g in guesses]
        while engine.has_work():
            engine.step()
        done = [engine.result(i) for i in ids]
        assert [d.output_ids for d in done] == [reference.output_ids] * len(guesses)
        right, half, wrong = (d.counters for d in done[:3])
        n = len(reference.output_ids)
        assert right.prediction_accepted == right.prediction_tokens == n
        assert half.prediction_accepted == n // 2
        assert wrong.prediction_accepted == 0
        if not with_drafter:  # 16-token verify blocks against one token per plain step
            assert right.target_forwards < reference.counters.target_forwards / 4
            assert wrong.target_forwards <= reference.counters.target_forwards + 1


def test_prediction_under_a_grammar_is_cut_where_the_grammar_disallows_it(pair):
    model, drafter = pair
    params = SamplingParams(max_new_tokens=30)
    prompts = prompts_for(4, VOCAB, seed=5)
    for use_drafter in (None, drafter):
        plain_engine = Engine(model, CacheConfig(4, 512))
        engine = Engine(model, CacheConfig(4, 512), drafter=use_drafter, spec=SpecConfig(5),
                        speculation="always")
        for prompt, length in zip(prompts, (4, 9, 17, 40)):
            reference = plain_engine.generate([prompt], params, constraint=Cycle(length))[0]
            assert obeys(reference.output_ids, length)
            # the right output with a disallowed token spliced in the middle, and junk
            mid = len(reference.output_ids) // 2
            spliced = reference.output_ids[:mid] + [14, 14, 14] + reference.output_ids[mid:]
            for guess in (reference.output_ids, spliced, [14] * 10):
                seq = engine.submit(prompt, params, constraint=Cycle(length), prediction=guess)
                while engine.has_work():
                    engine.step()
                assert engine.result(seq).output_ids == reference.output_ids


def test_sampling_with_a_prediction_keeps_the_target_distribution(tmp_path):
    model, _ = build(tmp_path, vocab=5, seed=2)
    prompt, params = [1, 3, 0, 2], SamplingParams(temperature=1.0, max_new_tokens=3)
    expected = exact_joint(model, prompt, params, 3)
    likely = max(expected, key=expected.get)
    engine = Engine(model, CacheConfig(4, 4096), SchedulerConfig(max_running=128))
    total, counts, accepted = 4000, Counter(), 0
    for start in range(0, total, 500):
        ids = [engine.submit(prompt, SamplingParams(temperature=1.0, max_new_tokens=3, seed=s),
                             prediction=list(likely)) for s in range(start, start + 500)]
        while engine.has_work():
            engine.step()
        for i in ids:
            c = engine.result(i)
            counts[tuple(c.output_ids)] += 1
            accepted += c.counters.prediction_accepted
    assert accepted > 0
    assert chi_square_pvalue(counts, expected, total) > 1e-3


def test_bad_prediction_is_a_request_error(pair):
    model, _ = pair
    with pytest.raises(RequestError, match="prediction"):
        Engine(model, CacheConfig(4, 64)).submit([1, 2], SamplingParams(), prediction=[VOCAB])
