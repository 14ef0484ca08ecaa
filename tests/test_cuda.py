"""GPU tier: the engine on CUDA gives the CPU engine's greedy tokens (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from agentflash.engine.config import CacheConfig, SpecConfig
from agentflash.engine.engine import Engine
from agentflash.engine.models.dflash import load_drafter
from agentflash.engine.models.loader import load_model
from agentflash.engine.sampler import SamplingParams
from conftest import make_dflash_checkpoint

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cuda_greedy_equals_cpu_with_and_without_drafter(hf_checkpoint, tmp_path):
    path, hf = hf_checkpoint("qwen3", bos_token_id=None, eos_token_id=None)
    make_dflash_checkpoint(tmp_path / "draft", hf.config, block_size=4)
    prompts = [[1, 2, 3], list(range(5, 40)), [7] * 20]
    params = SamplingParams(max_new_tokens=16)
    outputs = []
    for device in ("cpu", "cuda"):
        model = load_model(path, dtype=torch.float32, device=device)
        drafter = load_drafter(tmp_path / "draft", model)
        for d in (None, drafter):
            engine = Engine(model, CacheConfig(4, 256), drafter=d, spec=SpecConfig(4))
            outputs.append([c.output_ids for c in engine.generate(prompts, params)])
    assert all(o == outputs[0] for o in outputs)
