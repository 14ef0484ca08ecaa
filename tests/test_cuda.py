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
from skips import CUDA, LINEAR_CUDA

pytestmark = [pytest.mark.gpu, CUDA.mark]


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
            engine = Engine(model, CacheConfig(4, 256), drafter=d, spec=SpecConfig(4),
                            speculation="always")
            outputs.append([c.output_ids for c in engine.generate(prompts, params)])
    assert all(o == outputs[0] for o in outputs)


def test_cuda_graphs_give_the_eager_engines_tokens(hf_checkpoint, tmp_path):
    """Decode/verify and drafter forwards captured into CUDA graphs (engine.graphs) and replayed:
    the eager CUDA engine's greedy tokens, every step from a graph, graphs reused."""
    path, hf = hf_checkpoint("qwen3", bos_token_id=None, eos_token_id=None)
    make_dflash_checkpoint(tmp_path / "draft", hf.config, block_size=4)
    model = load_model(path, dtype=torch.float32, device="cuda")
    drafter = load_drafter(tmp_path / "draft", model)
    prompts = [[1, 2, 3], list(range(5, 40)), [7] * 20]
    params = SamplingParams(max_new_tokens=16)
    for d in (None, drafter):
        runs = []
        for graphs in (False, True):
            engine = Engine(model, CacheConfig(4, 256), drafter=d, spec=SpecConfig(4),
                            speculation="always", graphs=graphs)
            runs.append([c.output_ids for c in engine.generate(prompts, params)])
        assert runs[0] == runs[1]
        forwards = [engine.runner.decode] + ([engine.runner.drafter.forward] if d else [])
        for forward in forwards:
            assert forward.stats.eager == 0 and forward.stats.captures > 0
            assert forward.stats.replays > forward.stats.captures


def test_linear_attention_kernels_match_the_reference_and_the_cpu_engine(tmp_path):
    """With the `linear-cuda` extra, a Gated DeltaNet prefill on CUDA takes FLA's chunked delta
    rule and causal-conv1d: each equals the torch reference, and a hybrid model's greedy output
    on CUDA equals the CPU engine's."""
    from agentflash.engine.models import gated_deltanet as ref
    from agentflash.kernels import linear_attention
    from test_qwen3_5 import make_hf

    cuda = torch.device("cuda")
    LINEAR_CUDA.need()
    g = torch.Generator(device="cuda").manual_seed(0)
    length, heads, dk, dv, channels = 150, 4, 32, 16, 96
    q = ref.l2_normalise(torch.randn(length, heads, dk, device=cuda, generator=g)) * dk**-0.5
    k = ref.l2_normalise(torch.randn(length, heads, dk, device=cuda, generator=g))
    v = torch.randn(length, heads, dv, device=cuda, generator=g)
    decay = -0.3 * torch.rand(length, heads, device=cuda, generator=g)
    beta = torch.rand(length, heads, device=cuda, generator=g)
    state = torch.randn(heads, dk, dv, device=cuda, generator=g)
    out, final = linear_attention.chunk_delta_rule(q, k, v, decay, beta, state)
    want, want_final = ref.delta_rule_chunked(q, k, v, decay, beta, state)
    torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(final, want_final, atol=2e-3, rtol=2e-3)
    x = torch.randn(length, channels, device=cuda, generator=g)
    window = torch.randn(channels, 3, device=cuda, generator=g)
    weight = torch.randn(channels, 1, 4, device=cuda, generator=g)
    conv, last = linear_attention.causal_conv(x, window, weight)
    want_conv, want_last = ref.causal_conv(x[None], window[None], weight)
    torch.testing.assert_close(conv, want_conv[0], atol=1e-4, rtol=1e-4)
    assert torch.equal(last, want_last[0])

    make_hf(seed=7).save_pretrained(tmp_path)
    prompts = [list(range(1, 90)), [5, 9, 2]]
    params = SamplingParams(max_new_tokens=12)
    outputs = [[c.output_ids for c in Engine(load_model(tmp_path, device=device),
                                              CacheConfig(4, 256)).generate(prompts, params)]
               for device in ("cpu", "cuda")]
    assert outputs[0] == outputs[1]
