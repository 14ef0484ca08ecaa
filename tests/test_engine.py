"""End-to-end engine checks on tiny random checkpoints: greedy output equals transformers'
generate, batching and chunked prefill change nothing, turn 2 reuses turn 1's KV, sampling is
seeded and restricted as asked, and every bad input gets a typed error leaving the engine usable."""

from __future__ import annotations

import json
import random

import pytest
import torch
import transformers

from agentflash.engine.config import CacheConfig, SchedulerConfig
from agentflash.engine.engine import Engine
from agentflash.engine.errors import ContextLengthError, KVPoolExhaustedError, RequestError
from agentflash.engine.models.loader import load_model
from agentflash.engine.sampler import SamplingParams, target_probs

GREEDY = SamplingParams(max_new_tokens=12)


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def random_prompts(n: int, seed: int = 0, vocab: int = 128, lo: int = 1, hi: int = 40):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(params=["qwen3", "llama"])
def pair(request, hf_checkpoint):
    """(our engine factory, transformers model) on the same float64 weights."""
    # no EOS id, so both sides generate exactly max_new_tokens
    path, hf = hf_checkpoint(request.param, bos_token_id=None, eos_token_id=None)
    hf = hf.double()
    model = load_model(path, dtype=torch.float64)

    def make(**kwargs) -> Engine:
        kwargs.setdefault("cache", CacheConfig(page_size=4, num_pages=256))
        return Engine(model, **kwargs)

    return make, hf


def test_greedy_matches_transformers_unbatched_and_batched(pair):
    make, hf = pair
    prompts = random_prompts(10)
    expected = [hf_greedy(hf, p, GREEDY.max_new_tokens) for p in prompts]
    engine = make()
    for p, exp in zip(prompts, expected):  # one at a time
        assert engine.generate([p], GREEDY)[0].output_ids == exp
    batched = make().generate(prompts, GREEDY)  # all together, mixed lengths
    assert [c.output_ids for c in batched] == expected


def test_chunked_prefill_and_small_batches_change_nothing(pair):
    make, hf = pair
    prompts = random_prompts(6, seed=1, lo=20, hi=60)
    expected = [hf_greedy(hf, p, 8) for p in prompts]
    engine = make(scheduler=SchedulerConfig(max_batch_tokens=7, max_running=3))
    got = engine.generate(prompts, SamplingParams(max_new_tokens=8))
    assert [c.output_ids for c in got] == expected
    assert engine.stats()["pages_referenced"] == 0


def test_turn_two_computes_only_new_tokens(pair):
    make, hf = pair
    engine = make()
    turn1 = random_prompts(1, seed=2, lo=30, hi=30)[0]
    (c1,) = engine.generate([turn1], GREEDY, pin=True)
    assert c1.counters.cached_tokens == 0 and c1.counters.prefill_tokens == len(turn1)
    new = [5, 6, 7, 8, 9]
    turn2 = turn1 + c1.output_ids + new
    (c2,) = engine.generate([turn2], GREEDY, pin=True)
    # every token of turn 1 whose KV exists (all but the last sampled one) is reused
    assert c2.counters.cached_tokens == len(turn1) + len(c1.output_ids) - 1
    assert c2.counters.prefill_tokens == len(new) + 1
    assert c2.output_ids == hf_greedy(hf, turn2, GREEDY.max_new_tokens)
    engine.unpin(c1.pin)
    engine.unpin(c2.pin)
    stats = engine.stats()
    assert stats["pages_pinned"] == 0 and stats["pages_referenced"] == 0


def test_shared_prefix_across_concurrent_sequences(pair):
    make, hf = pair
    engine = make()
    system = random_prompts(1, seed=3, lo=25, hi=25)[0]
    engine.generate([system + [1]], SamplingParams(max_new_tokens=1))
    prompts = [system + tail for tail in ([2, 3], [4], [5, 6, 7])]
    got = engine.generate(prompts, GREEDY)
    for p, c in zip(prompts, got):
        assert c.counters.cached_tokens == len(system)
        assert c.output_ids == hf_greedy(hf, p, GREEDY.max_new_tokens)


def test_prompts_arriving_together_compute_their_shared_prefix_once(pair):
    """Agents of one application start with the same system prompt: submitted together, the
    first computes it and the others wait while that saves HOLD_MIN_TOKENS or more (with a
    chunked prefill, each chunk is reusable once computed); a prompt identical to one being
    prefilled computes only its last token. Outputs are transformers' either way."""
    make, hf = pair
    system = random_prompts(1, seed=11, lo=100, hi=100)[0]
    prompts = [system + tail for tail in ([2, 3], [4], [5, 6, 7])] + [system + [2, 3]]
    # whole prompts in one chunk: the three wait for all of it; chunks of 32, a step's whole
    # budget: after two chunks waiting would save less than HOLD_MIN_TOKENS (64), and they
    # enter in the next step with budget left, after the third
    for chunk, reused in ((512, [0, 100, 100, 101]), (32, [0, 96, 96, 96])):
        engine = make(scheduler=SchedulerConfig(max_batch_tokens=chunk))
        got = engine.generate(prompts, GREEDY)
        assert [c.counters.cached_tokens for c in got] == reused
        assert [c.counters.prefill_tokens for c in got] == \
            [len(p) - n for p, n in zip(prompts, reused)]
        for p, c in zip(prompts, got):
            assert c.output_ids == hf_greedy(hf, p, GREEDY.max_new_tokens)
        assert engine.stats()["pages_referenced"] == 0
        engine.kv.check_integrity()


def test_a_prompt_is_shared_while_its_sequence_decodes(pair):
    """A running sequence's prompt is reusable as soon as it is prefilled, not only once the
    sequence ends; a request with reuse=False neither waits nor reuses."""
    make, hf = pair
    engine = make()
    system = random_prompts(1, seed=12, lo=70, hi=70)[0]
    first = engine.submit(system + [1], SamplingParams(max_new_tokens=30))
    engine.step()
    assert engine.sequence(first).output_ids  # prefilled, decoding
    later = [system + [9, 8], system + [7]]
    (c,) = engine.generate(later[:1], GREEDY)
    assert c.counters.cached_tokens == len(system)
    assert c.output_ids == hf_greedy(hf, later[0], GREEDY.max_new_tokens)
    a = engine.submit(system[:5] + [1] + system[5:], GREEDY)   # shares 5 tokens: too few
    b = engine.submit(later[1], GREEDY, reuse=False)
    engine.step()
    assert not engine.scheduler.waiting  # neither held
    while engine.has_work():
        engine.step()
    ra, rb = engine.result(a), engine.result(b)
    assert rb.counters.cached_tokens == 0
    assert rb.output_ids == hf_greedy(hf, later[1], GREEDY.max_new_tokens)
    assert ra.output_ids == hf_greedy(hf, system[:5] + [1] + system[5:], GREEDY.max_new_tokens)
    assert len(engine.result(first).output_ids) == 30
    assert engine.stats()["pages_referenced"] == 0
    engine.kv.check_integrity()


def test_waiting_prompts_are_prefilled_before_decode_rows_for_a_bounded_run(pair):
    """A prompt that arrives while another request decodes gets its chunks first (decode rows
    wait) for at most prefill_first_steps steps in a row; with 0, decode rows go in every step.
    Outputs are transformers' either way."""
    make, hf = pair
    first, second = random_prompts(2, seed=13, lo=30, hi=30)
    first = first[:5]
    for bound, grown in ((2, [0, 0, 1, 0, 1]), (0, [1, 1, 1, 1, 1])):
        engine = make(scheduler=SchedulerConfig(max_batch_tokens=8, prefill_first_steps=bound))
        a = engine.submit(first, SamplingParams(max_new_tokens=40))
        engine.step()  # prefilled: its first token
        b = engine.submit(second, GREEDY)  # four chunks of 8
        lengths = [len(engine.sequence(a).output_ids)]
        for _ in range(5):
            engine.step()
            lengths.append(len(engine.sequence(a).output_ids))
        assert [n - m for m, n in zip(lengths, lengths[1:])] == grown
        assert engine.sequence(b).output_ids  # prefilled within the five steps
        while engine.has_work():
            engine.step()
        assert engine.result(a).output_ids == hf_greedy(hf, first, 40)
        assert engine.result(b).output_ids == hf_greedy(hf, second, GREEDY.max_new_tokens)


def test_sampling_is_seeded_and_batch_independent(pair):
    make, _ = pair
    engine = make()
    prompts = random_prompts(4, seed=4)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=123, max_new_tokens=10)
    alone = engine.generate([prompts[0]], params)[0].output_ids
    together = engine.generate(prompts, params)[0].output_ids
    assert alone == together
    other = engine.generate([prompts[0]], SamplingParams(temperature=0.8, seed=7,
                                                         max_new_tokens=10))[0].output_ids
    assert other != alone  # a different seed gives a different sample (10 tokens at T=0.8)


def test_top_k_one_is_greedy_and_top_k_bounds_support(pair):
    make, hf = pair
    engine = make()
    prompt = random_prompts(1, seed=5)[0]
    k1 = SamplingParams(temperature=1.0, top_k=1, seed=0, max_new_tokens=8)
    assert engine.generate([prompt], k1)[0].output_ids == hf_greedy(hf, prompt, 8)
    logits = hf(torch.tensor([prompt])).logits[0, -1]
    allowed = set(torch.topk(logits, 3).indices.tolist())
    firsts = {engine.generate([prompt], SamplingParams(temperature=2.0, top_k=3, seed=s,
                                                       max_new_tokens=1))[0].output_ids[0]
              for s in range(30)}
    assert firsts <= allowed and len(firsts) > 1


def test_target_probs_top_p_keeps_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert torch.allclose(p, torch.tensor([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert torch.allclose(p, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_stop_conditions(pair):
    make, hf = pair
    prompt = random_prompts(1, seed=6)[0]
    ref = hf_greedy(hf, prompt, 12)
    engine = make()
    stop_tok = ref[4]
    first = ref.index(stop_tok)
    got = engine.generate([prompt], SamplingParams(max_new_tokens=12, stop_token_ids=(stop_tok,)))
    assert got[0].output_ids == ref[: first + 1] and got[0].finish_reason == "stop"
    # stop strings through a detokenizer (here: each id becomes one letter)
    text_engine = make(detokenize=lambda ids: "".join(chr(65 + t % 26) for t in ids))
    stop_str = "".join(chr(65 + t % 26) for t in ref[3:5])
    got = text_engine.generate([prompt], SamplingParams(max_new_tokens=12, stop=(stop_str,)))
    text = "".join(chr(65 + t % 26) for t in got[0].output_ids)
    assert text.endswith(stop_str) and text.count(stop_str) == 1
    assert got[0].finish_reason == "stop"


def test_generation_config_eos_ends_generation_like_transformers(hf_checkpoint):
    """generation_config.json's eos_token_id, not config.json's, is where transformers' generate
    stops (Qwen3 chat models add <|endoftext|> there); the engine stops at the same tokens."""
    path, hf = hf_checkpoint("qwen3", bos_token_id=None, eos_token_id=None)
    prompt = random_prompts(1, seed=3)[0]
    ref = hf_greedy(hf, prompt, 12)
    cfg = json.loads((path / "config.json").read_text())
    cfg["eos_token_id"] = next(t for t in range(128) if t not in ref)  # never generated
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [ref[5], ref[8]]}))
    expected = transformers.AutoModelForCausalLM.from_pretrained(path).generate(
        torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    first = min(ref.index(ref[5]), ref.index(ref[8]))
    assert expected == ref[: first + 1]
    engine = Engine(load_model(path), cache=CacheConfig(page_size=4, num_pages=64))
    got = engine.generate([prompt], SamplingParams(max_new_tokens=12))[0]
    assert got.output_ids == expected and got.finish_reason == "stop"


def test_context_limit(pair):
    make, hf = pair
    engine = make(max_model_len=32)
    with pytest.raises(ContextLengthError, match="32"):
        engine.submit(list(range(32)))
    prompt = list(range(28))
    (c,) = engine.generate([prompt], SamplingParams(max_new_tokens=50))
    assert len(c.output_ids) == 4 and c.finish_reason == "length"
    assert c.output_ids == hf_greedy(hf, prompt, 4)


def test_bad_requests_are_typed_and_leave_engine_usable(pair):
    make, hf = pair
    engine = make()
    with pytest.raises(RequestError, match="empty"):
        engine.submit([])
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.submit([1, 2, 999])
    with pytest.raises(RequestError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(RequestError, match="tokenizer"):
        engine.submit([1, 2], SamplingParams(stop=("x",)))
    prompt = [3, 4, 5]
    assert engine.generate([prompt], GREEDY)[0].output_ids == hf_greedy(hf, prompt, 12)


def test_pool_exhausted_by_pinned_sessions(pair):
    make, hf = pair
    engine = make(cache=CacheConfig(page_size=4, num_pages=12))
    prompt = random_prompts(1, seed=7, lo=30, hi=30)[0]
    (c,) = engine.generate([prompt], SamplingParams(max_new_tokens=4), pin=True)
    assert engine.stats()["pages_pinned"] == 9
    other = [7] * 20
    with pytest.raises(KVPoolExhaustedError, match="pinned"):
        engine.generate([other], SamplingParams(max_new_tokens=4))
    engine.unpin(c.pin)
    assert engine.generate([other], SamplingParams(max_new_tokens=4))[0].output_ids == \
        hf_greedy(hf, other, 4)
    assert engine.stats()["pages_referenced"] == 0


def test_abort_releases_pages(pair):
    make, _ = pair
    engine = make()
    a = engine.submit(random_prompts(1, seed=8)[0], SamplingParams(max_new_tokens=50))
    b = engine.submit(random_prompts(1, seed=9)[0], SamplingParams(max_new_tokens=50))
    engine.step()
    engine.step()
    engine.abort(a)
    assert engine.result(a).finish_reason == "abort"
    while engine.has_work():
        engine.step()
    assert len(engine.result(b).output_ids) == 50
    stats = engine.stats()
    assert stats["pages_referenced"] == 0 and stats["pages_pinned"] == 0
    engine.kv.check_integrity()
