"""Target-regenerated drafter training data: prompts followed by the target's own responses,
generated with the engine (the spec trains drafters on these, not on the dataset's).

Greedy responses are the tokens greedy speculative decoding must guess. Sampled ones
(temperature > 0, each prompt seeded by `seed` + its index, so a data set is reproducible)
add the target's other likely continuations: more training text from the same prompts, still
the target's own."""

from __future__ import annotations

from typing import Sequence

from ..engine.config import CacheConfig, SchedulerConfig
from ..engine.engine import Engine
from ..engine.models.qwen3 import CausalLM
from ..engine.sampler import SamplingParams
from .data import Example


def prompts_of(examples: Sequence[Example]) -> list[list[int]]:
    """Each example's prompt: its tokens before the first response (loss_mask 1) token."""
    return [e.input_ids[: e.loss_mask.index(1) if 1 in e.loss_mask else None] for e in examples]


def regenerate(
    target: CausalLM, prompts: Sequence[Sequence[int]], max_new_tokens: int,
    ignore_eos: bool = False, temperature: float = 0.0, seed: int = 0,
    cache: CacheConfig = CacheConfig(num_pages=4096),
    scheduler: SchedulerConfig = SchedulerConfig(max_batch_tokens=2048),
) -> list[Example]:
    """Prompts followed by the target's own responses (the tokens a drafter must guess): greedy,
    or sampled at `temperature` with prompt i seeded by seed + i. All prompts go to one engine,
    batched; the default pool (64k tokens) keeps the batch wide."""
    params = [SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos,
                             temperature=temperature, seed=seed + i)  # greedy ignores the seed
              for i in range(len(prompts))]
    # Shortest first: sequences batched together have similar lengths, so little padding.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    done = Engine(target, cache, scheduler).generate([list(prompts[i]) for i in order],
                                                     [params[i] for i in order])
    outputs = [[] for _ in prompts]
    for i, c in zip(order, done):
        outputs[i] = c.output_ids
    return [Example(list(p) + out, [0] * len(p) + [1] * len(out))
            for p, out in zip(prompts, outputs)]
