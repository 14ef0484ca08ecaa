"""Token constraints inside the speculative loop (engine level, a toy grammar on a tiny random
model): every token obeys the grammar, constrained greedy output is identical with and without
speculation, sampling stays inside the grammar, and a failing constraint fails only its own
sequence."""

from __future__ import annotations

import pytest
import torch

from agentflash.engine.config import CacheConfig, SpecConfig, StepCost
from agentflash.engine.constraint import mask_rows_, masked, pack, penalty, settle_greedy
from agentflash.engine.engine import Engine
from agentflash.engine.errors import RequestError
from agentflash.engine.sampler import SamplingParams
from test_spec import build, drafted_steps, prompts_for

VOCAB = 16
STOP = 15


class Cycle:
    """Toy grammar: the k-th generated token must be congruent to k mod 3 (tokens < STOP);
    after `length` tokens only STOP is allowed, which terminates it. Counts its rollbacks."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.tokens: list[int] = []
        self.done = False
        self.rolled_back = 0

    def allowed_set(self) -> torch.Tensor:
        mask = torch.zeros(VOCAB, dtype=torch.bool)
        if len(self.tokens) >= self.length:
            mask[STOP] = True
        else:
            mask[len(self.tokens) % 3:STOP:3] = True
        return mask

    def allowed(self) -> torch.Tensor:
        return pack(self.allowed_set())

    def accept(self, token: int) -> bool:
        if self.done or not self.allowed_set()[token]:
            return False
        self.tokens.append(token)
        self.done = token == STOP
        return True

    def rollback(self, num_tokens: int) -> None:
        self.rolled_back += num_tokens
        for _ in range(num_tokens):
            self.done = False
            self.tokens.pop()

    def is_terminated(self) -> bool:
        return self.done


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build(tmp_path_factory.mktemp("constraint"), vocab=VOCAB)


def obeys(output: list[int], length: int) -> bool:
    body = output[:-1] if output[-1:] == [STOP] else output
    return all(t % 3 == k % 3 and t != STOP for k, t in enumerate(body)) and len(body) <= length


def run(model, drafter, prompts, params, lengths, block=None, spec=None):
    engine = Engine(model, CacheConfig(4, 512), drafter=drafter,
                    spec=spec or (SpecConfig(block) if block else SpecConfig()),
                    speculation="auto" if spec is not None else "always")
    constraints = [Cycle(n) for n in lengths]
    ids = [engine.submit(p, params, constraint=c) for p, c in zip(prompts, constraints)]
    while engine.has_work():
        engine.step()
    return [engine.result(i) for i in ids], constraints, engine


def test_constrained_greedy_speculative_equals_plain(pair):
    model, drafter = pair
    params = SamplingParams(max_new_tokens=30)
    prompts = prompts_for(8, VOCAB, seed=3)
    lengths = [5, 9, 13, 40, 2, 17, 8, 25]
    plain, _, _ = run(model, None, prompts, params, lengths)
    for block in (2, 5, 16):
        spec, constraints, engine = run(model, drafter, prompts, params, lengths, block)
        assert [c.output_ids for c in spec] == [c.output_ids for c in plain], block
        for done, n in zip(spec, lengths):
            assert obeys(done.output_ids, n)
            # the grammar's end stops the sequence even though STOP is no eos of the model
            assert done.finish_reason == ("stop" if n < 30 else "length")
        # drafts were proposed past rejections and rolled back
        assert sum(c.rolled_back for c in constraints) > 0
        engine.kv.check_integrity()
        assert engine.stats()["pages_referenced"] == 0


def test_a_dflash2_selectors_walk_follows_the_grammar_losslessly(tmp_path):
    """A DFlash2 drafter under a grammar: its walk takes the best candidate the grammar allows
    (or the allowed argmax), the output is the plain constrained output."""
    model, drafter = build(tmp_path, vocab=VOCAB, v2=dict(
        conv_kernel_size=2, conv_group_size=16, selector_rank=4, selector_top_k=4))
    params = SamplingParams(max_new_tokens=30)
    prompts = prompts_for(6, VOCAB, seed=4)
    lengths = [5, 13, 40, 2, 17, 25]
    plain, _, _ = run(model, None, prompts, params, lengths)
    spec, constraints, engine = run(model, drafter, prompts, params, lengths, 6)
    assert [c.output_ids for c in spec] == [c.output_ids for c in plain]
    assert all(obeys(done.output_ids, n) for done, n in zip(spec, lengths))
    assert engine.counters.accepted_tokens > 0
    assert sum(c.rolled_back for c in constraints) > 0
    assert engine.stats()["pages_referenced"] == 0


def test_step_costs_choose_a_constrained_requests_verify_length_too(pair):
    """With step costs ("auto"), a constrained request verifies only the drafts the drafter is
    sure enough of, as an unconstrained one does (the grammar then walks only those), and its
    output stays the plain constrained output."""
    model, drafter = pair
    params = SamplingParams(max_new_tokens=30)
    prompts = prompts_for(4, VOCAB, seed=5)
    plain, _, _ = run(model, None, prompts, params, [40] * len(prompts))
    steep = StepCost((0.0,) * 8, tuple(1.0 + 0.5 * k for k in range(8)))  # a token: +0.5
    for cost in (steep, None):
        engine = Engine(model, CacheConfig(4, 512), drafter=drafter,
                        spec=SpecConfig(8, cost=cost, draft_rows=3, lookup=False),
                        speculation="always" if cost is None else "auto")
        for prompt, want in zip(prompts, plain):
            done, steps = drafted_steps(engine, prompt, params, Cycle(40))
            assert done.output_ids == want.output_ids
            drafted = [n for ran, n, _ in steps if ran]
            if cost is None:  # full blocks
                assert max(drafted) == 7
            else:  # only drafts the drafter is sure enough of (this one never is, of many)
                assert max(drafted) <= 3 and min(drafted) == 0


def test_context_drafts_follow_the_grammar_losslessly(pair):
    """Context drafts (engine.lookup) under a grammar: cut where it rejects them, judged under
    its masks, rolled back with it; the output stays the plain constrained output."""
    model, drafter = pair
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    prompts = [p * 3 for p in prompts_for(4, VOCAB, seed=6)]  # repeats to read drafts from
    plain, _, _ = run(model, None, prompts, params, [60] * len(prompts))
    steep = StepCost((0.0,) + (0.3,) * 7, tuple(1.0 + 0.2 * k for k in range(8)))
    done, _, engine = run(model, drafter, prompts, params, [60] * len(prompts),
                          spec=SpecConfig(8, cost=steep))
    assert [c.output_ids for c in done] == [c.output_ids for c in plain]
    assert all(obeys(c.output_ids, 60) for c in done)
    assert engine.counters.lookups > 0 and engine.counters.lookup_accepted > 0
    engine.kv.check_integrity()


def test_constrained_sampling_stays_in_grammar(pair):
    model, drafter = pair
    params = SamplingParams(temperature=1.0, seed=7, max_new_tokens=24)
    prompts = prompts_for(6, VOCAB, seed=4)
    for d in (None, drafter):
        done, _, _ = run(model, d, prompts, params, [10] * 6)
        for c in done:
            assert obeys(c.output_ids, 10) and c.output_ids[-1] == STOP


class Broken(Cycle):
    """Allows nothing after its third token."""

    def allowed_set(self) -> torch.Tensor:
        mask = super().allowed_set()
        return mask & False if len(self.tokens) >= 3 else mask


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_failing_constraint_fails_only_its_sequence(pair, temperature):
    """Greedy rows (checked at commit) and sampled ones (masked before judging) alike."""
    model, drafter = pair
    engine = Engine(model, CacheConfig(4, 512), drafter=drafter, spec=SpecConfig(4),
                    speculation="always")
    params = SamplingParams(temperature=temperature, seed=1, max_new_tokens=12)
    good = engine.submit([1, 2, 3], params, constraint=Cycle(8))
    bad = engine.submit([1, 2, 3], params, constraint=Broken(8))
    while engine.has_work():
        engine.step()
    ok, failed = engine.result(good), engine.result(bad)
    assert ok.error is None and obeys(ok.output_ids, 8)
    assert isinstance(failed.error, RequestError) and failed.finish_reason == "error"
    assert obeys(failed.output_ids, 3) and len(failed.output_ids) <= 3
    engine.kv.check_integrity()
    assert engine.stats()["pages_referenced"] == 0


def test_masking_a_steps_rows_at_once_is_masking_each_row():
    """A step's constrained rows are masked in one call (engine._mask): row first + k of each
    block as `masked` makes it with the allowed set after k drafts, tokens past a shorter mask
    disallowed, other rows untouched; a block with a row whose grammar allows nothing is
    reported (the request's error) and the others are still masked."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 40, generator=g)
    sets = [torch.rand(36, generator=g) < 0.5 for _ in range(4)]  # tokens 36.. have no bit
    for k, mask in enumerate(sets):
        mask[k] = True
    masks = [pack(m) for m in sets]
    allowed = torch.isfinite(penalty(torch.stack(masks), 70))
    assert torch.equal(allowed[:, :36], torch.stack(sets)) and not allowed[:, 36:].any()
    blocks = [(0, masks[:3]), (4, masks[3:])]  # rows 3, 5 and 6 have no mask
    want = logits.clone()
    for first, block in blocks:
        for k, mask in enumerate(block):
            want[first + k] = masked(logits[first + k], mask)
    for k, mask in enumerate(sets[:3]):
        assert torch.equal(want[k, :36][mask], logits[k, :36][mask])
        assert torch.isinf(want[k, :36][~mask]).all() and torch.isinf(want[k, 36:]).all()
    assert torch.equal(want[3], logits[3])
    got = logits.clone()
    assert mask_rows_(got, blocks) == []
    assert torch.equal(got, want)
    empty = pack(torch.zeros(36, dtype=torch.bool))
    got = logits.clone()
    assert mask_rows_(got, [(0, masks[:3]), (4, [masks[3], empty])]) == [1]
    assert torch.equal(got[:3], want[:3])
    with pytest.raises(RequestError, match="allows no next token"):
        masked(logits[0], empty)


def test_greedy_rows_settled_without_masks_are_the_masked_verdict():
    """settle_greedy (greedy rows judged unmasked, a mask only where the grammar refuses a
    row's argmax) commits what masking every row and judging greedily commits, and leaves the
    matcher after those tokens: random rows and grammatical drafts, the target often refusing
    the grammar and often agreeing with a draft only once masked; with and without some of the
    states' masks handed on by the draft walk."""
    g = torch.Generator().manual_seed(0)
    resumed = 0
    for trial in range(300):
        length = int(torch.randint(2, 9, (1,), generator=g))
        grammar = Cycle(length)
        drafts, states = [], [grammar.allowed()]  # each state's mask, for the walk's hand-on
        for _ in range(int(torch.randint(0, 6, (1,), generator=g))):
            ok = grammar.allowed_set().nonzero().flatten()
            token = int(ok[torch.randint(len(ok), (1,), generator=g)])
            if grammar.is_terminated() or not grammar.accept(token):
                break
            drafts.append(token)
            states.append(grammar.allowed())
        known = [m if float(torch.rand(1, generator=g)) < 0.5 else None for m in states]
        rows = torch.randn(len(drafts) + 1, VOCAB, generator=g)
        for k, d in enumerate(drafts):  # the target often agrees with a draft, or nearly
            rows[k, d] += float(torch.rand(1, generator=g)) * 3
        # reference: every row masked with its state's allowed set, judged greedily
        ref = Cycle(length)
        want, want_accepted = [], 0
        for k in range(len(drafts) + 1):
            if ref.is_terminated():
                break
            choice = int(masked(rows[k], pack(ref.allowed_set())).argmax())
            ref.accept(choice)
            want.append(choice)
            if k == len(drafts) or choice != drafts[k]:
                break
            want_accepted += 1
        raw = rows.argmax(-1).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == raw[accepted]:
            accepted += 1
        got_accepted, got = settle_greedy(grammar, drafts, accepted, raw[accepted], rows,
                                          known if trial % 2 else None)
        assert (got_accepted, got) == (want_accepted, want), trial
        assert grammar.tokens == ref.tokens and grammar.done == ref.done
        resumed += got_accepted > accepted
    assert resumed > 0  # a masked row agreed with its draft and verification went on

