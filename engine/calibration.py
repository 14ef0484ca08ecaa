"""What the speculation policy and the savings counterfactuals weigh: step and prefill costs,
measured on this engine, on this machine, at load.

`measure_step_cost` times plain decode steps and verify/drafter forwards of 2, 4, 8 ..
block_size tokens on synthetic requests (StepCost, in units of a plain step);
`measure_prefill_cost` fits the shape of prefill forwards (PrefillCost). `step_costs` is what
speculation="auto" serves with: batch 1 at a short and a long context, and batches of 4 and 16
as far as the pool holds them. Each needs an idle engine and leaves it idle with an empty cache.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any, Iterable, Protocol, Sequence as Seq

from .accounting import Completion, EngineCounters
from .config import ModelConfig, PrefillCost, SpecConfig, StepCost
from .errors import ContextLengthError, KVPoolExhaustedError
from .kv.manager import KVManager
from .policy import SpeculationPolicy
from .sampler import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence

BATCH_COSTS = (4, 16)
"""Batch sizes whose step costs `step_costs` measures beside batch 1."""


class Measured(Protocol):
    """What the measurements drive: an idle engine.engine.Engine (a protocol, so that the
    engine can import this module)."""

    drafter: Any
    block_size: int
    max_model_len: int
    config: ModelConfig
    kv: KVManager
    scheduler: Scheduler
    policy: SpeculationPolicy
    counters: EngineCounters

    def submit(self, prompt_ids: Seq[int], params: SamplingParams = ...,
               reuse: bool = ...) -> int: ...
    def step(self) -> Any: ...
    def sequence(self, seq_id: int) -> Sequence: ...
    def result(self, seq_id: int) -> Completion | None: ...
    def abort(self, seq_id: int) -> None: ...
    def generate(self, prompts: Any, params: SamplingParams = ...) -> list[Completion]: ...
    def clear_cache(self) -> int: ...
    def has_work(self) -> bool: ...


def step_costs(engine: Measured, spec: SpecConfig) -> SpecConfig:
    """`spec` with the step costs speculation="auto" decides with: batch 1 after 256 tokens
    and after 2048 (or half the context), and batches of `BATCH_COSTS` as far as the scheduler
    and the pool hold them (shorter contexts where the model's or the pool's are)."""
    cost = measure_step_cost(engine)
    long = measure_step_cost(engine, context=min(2048, engine.max_model_len // 2))
    if long.context <= cost.context:  # a short model or a small pool: no longer context
        long = None
    batches = []
    for batch in BATCH_COSTS:
        if batch > engine.scheduler.config.max_running:
            break
        try:
            batches.append(measure_step_cost(engine, steps=3, batch=batch))
        except KVPoolExhaustedError:
            break
    return replace(spec, cost=cost, long_cost=long, batch_costs=tuple(batches))


def measure_step_cost(engine: Measured, context: int = 256, steps: int = 8,
                      batch: int = 1) -> StepCost:
    """A plain decode step of `batch` requests after a `context`-token prompt each (shorter
    where the model's context is), and the cost of verifying 2, 4, 8 .. block_size tokens
    each and of the drafter forwards for them in units of it (linear in between)."""
    assert engine.drafter is not None, "needs a speculative engine"
    block = engine.block_size
    lengths = [k for k in (1, 2, 4, 8) if k < block] + [block]
    context, target, draft = _time_blocks(engine, context, lengths, steps, batch)
    plain = target[0]
    per_k = lambda ys: tuple(float(y) / plain for y in   # noqa: E731
                             _interpolate(lengths, ys, range(1, block + 1)))
    return StepCost(per_k(draft), per_k(target), plain, context, batch)


def measure_prefill_cost(engine: Measured, tokens: int = 256, context: int = 1024,
                         rounds: int = 3) -> PrefillCost:
    """The shape of prefill costs (PrefillCost), fitted to the median times of three
    forwards, interleaved over `rounds`: `tokens` prompt tokens and 16 computed after none
    cached, and `tokens` after `context` cached (shorter where the model's context is)."""
    assert not engine.has_work(), "needs an idle engine"
    page = engine.kv.page_size
    room = (engine.kv.max_reservable() - 2) * page  # tokens one request can hold here
    n1 = min(tokens, engine.scheduler.config.max_batch_tokens, engine.max_model_len // 4,
             room // 2)
    if n1 < 2:
        raise KVPoolExhaustedError("measuring prefill needs more free KV pages")
    n2 = max(1, min(16, n1 // 4))
    context = max(0, min(context, engine.max_model_len - n1 - 2, room - n1)) // page * page
    cases = [(n1, 0), (n2, 0), (n1, context)]
    times: list[list[float]] = [[] for _ in cases]
    starts = [0] * len(cases)
    for r in range(rounds):
        for i, (n, start) in enumerate(cases):
            prompt = [(13 * j + 7 * r + 5 * i + 1) % engine.config.vocab_size
                      for j in range(start + n)]
            if start:  # the context, cached by a request of its own
                engine.generate([prompt[:start]], SamplingParams(max_new_tokens=1))
            seq_id = engine.submit(prompt, SamplingParams(max_new_tokens=1, ignore_eos=True))
            t0 = engine.counters.target_s
            done = None
            while done is None:
                engine.step()
                done = engine.result(seq_id)
            times[i].append(engine.counters.target_s - t0)
            starts[i] = done.counters.cached_tokens
            engine.clear_cache()
    # (starts[2]: the context that was cached; a hybrid target may reuse less)
    return PrefillCost.fit(n1, n2, starts[2], *(statistics.median(t) for t in times))


def _time_blocks(
    engine: Measured, context: int, blocks: list[int], steps: int, batch: int = 1
) -> tuple[int, list[float], list[float]]:
    """`batch` synthetic requests: a `context`-token prompt each, then `steps` rounds of one
    step at each verify length in `blocks`, longest first, the plain step (length 1) after
    an untimed plain step. Interleaved, so that a shared machine's load drift falls on
    every length alike; in that order, so that the plain step, the unit of every cost, is
    timed as plain decoding pays it: a long verify slows the next few steps (caches refill),
    which would make verifies look cheaper than the decode loop pays. Returns the context
    used and the median target and drafter seconds per step of each length."""
    assert not engine.has_work(), "needs an idle engine"
    budget = steps * (sum(blocks) + 1) + 1
    context = min(context, engine.max_model_len - budget)  # a short model: a shorter prompt
    if context < 1:
        raise ContextLengthError(f"measuring step costs needs more than {budget} positions; "
                                 "use speculation='always'")
    page = engine.kv.page_size
    room = (engine.kv.max_reservable() // batch - 1) * page - budget  # per request
    context = min(context, room)  # a small pool: a shorter prompt
    if context < 1:
        raise KVPoolExhaustedError(
            f"measuring step costs with {batch} requests needs "
            f"{batch * (-(-(budget + 1) // page) + 1)} free KV pages; enlarge the pool or use "
            "speculation='always'")
    vocab = engine.config.vocab_size
    policy = engine.policy
    spec, policy.spec = policy.spec, replace(policy.spec, cost=None, batch_costs=(),
                                             long_cost=None)
    try:
        ids = [engine.submit([(7 * i + 11 * r + 3) % vocab for i in range(context)],
                             SamplingParams(max_new_tokens=budget, ignore_eos=True),
                             reuse=False) for r in range(batch)]
        seqs = [engine.sequence(i) for i in ids]
        while any(seq.prefilling for seq in seqs) or len(engine.scheduler.running) < batch:
            engine.step()  # admit and prefill them all
        target: list[list[float]] = [[] for _ in blocks]
        draft: list[list[float]] = [[] for _ in blocks]
        c = engine.counters
        for _ in range(steps):
            for i, k in reversed(list(enumerate(blocks))):
                for seq in seqs:
                    seq.block_size = k
                if k == 1:
                    engine.step()
                t0, d0 = c.target_s, c.draft_s
                engine.step()
                target[i].append(c.target_s - t0)
                draft[i].append(c.draft_s - d0)
        for seq_id in ids:
            engine.abort(seq_id)
            engine.result(seq_id)
        engine.clear_cache()
    finally:
        policy.spec = spec
    return (context, [statistics.median(t) for t in target],
            [statistics.median(d) for d in draft])


def _interpolate(xs: list[int], ys: list[float], at: Iterable[int]) -> list[float]:
    """Piecewise-linear y at each point of `at` through the points (xs, ys), xs increasing."""
    out = []
    for x in at:
        i = max(j for j in range(len(xs)) if xs[j] <= x)
        if xs[i] == x or i == len(xs) - 1:
            out.append(ys[i])
        else:
            t = (x - xs[i]) / (xs[i + 1] - xs[i])
            out.append(ys[i] + t * (ys[i + 1] - ys[i]))
    return out
