"""Target-regenerated drafter training data: prompts followed by the target's own greedy
responses, generated with the engine (the spec trains drafters on these, not on the dataset's)."""

from __future__ import annotations

from typing import Sequence

from .engine import Engine
from .models.dflash_train import Example
from .models.qwen3 import CausalLM
from .sampler import SamplingParams


def regenerate(
    target: CausalLM, prompts: Sequence[Sequence[int]], max_new_tokens: int,
    ignore_eos: bool = False,
) -> list[Example]:
    """Prompts followed by the target's own greedy responses (the tokens a drafter must guess)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
    done = Engine(target).generate([list(p) for p in prompts], params)
    return [
        Example(list(p) + c.output_ids, [0] * len(p) + [1] * len(c.output_ids))
        for p, c in zip(prompts, done)
    ]
