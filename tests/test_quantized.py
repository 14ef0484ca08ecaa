"""Weight-only int8 and int4 (engine.models.quantized, Engine(quantize=...)): each layer computes
what its dequantized weight does, its kernel rows do not depend on how many share a call, and
speculative greedy output equals the quantized model's own plain output."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from agentflash.embedded import embedded_model_dir, model_drafter_dir
from agentflash.engine.config import SpecConfig
from agentflash.engine.engine import Engine
from agentflash.engine.models.dflash import load_drafter
from agentflash.engine.models.loader import load_model
from agentflash.engine.models.packed import packing_available
from agentflash.engine.models.kernel_linear import WIDEN_ROWS, with_kernel_linears
from agentflash.engine.models.quantized import (GROUP_SIZE, Int4Linear, Int8Linear, dequantize,
                                                fits, int4_available, quantize_int8,
                                                quantize_weight)
from agentflash.engine.sampler import SamplingParams
from agentflash.kernels import cpu_ops

from conftest import assert_rows_independent, random_linear_case

needs_int4 = pytest.mark.skipif(not int4_available(), reason="no CPU int4 kernel in this torch")
needs_int8 = pytest.mark.skipif(not cpu_ops.available(), reason="agentflash's CPU kernels do "
                                "not run here")
QUANTIZED = {"int8": (Int8Linear, needs_int8), "int4": (Int4Linear, needs_int4)}


def test_int8_error_is_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 300, generator=g) * 3).to(torch.bfloat16)
    w[5] = 0  # an all-zero row keeps a usable scale
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.min() >= -127 and q.max() <= 127
    assert (q.abs().amax(1)[torch.arange(64) != 5] == 127).all()  # each row uses its range
    err = (q.float() * scale[:, None] - w.float()).abs()
    assert (err <= 0.5 * scale[:, None] + 1e-6 * w.float().abs()).all()  # + float32 rounding


@needs_int8
@pytest.mark.parametrize("shape", [(1152, 384), (384, 1024), (37, 100)])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_is_its_dequantized_weight_and_row_invariant(shape, bias):
    w, b, x = random_linear_case(*shape, bias, rows=WIDEN_ROWS + 5)
    layer = Int8Linear(w, b)
    q, scale = quantize_int8(w)
    want = F.linear(x.float(), q.float() * scale[:, None], None if b is None else b.float())
    for rows in (1, 7, WIDEN_ROWS, WIDEN_ROWS + 5):  # the kernel, then float32 past WIDEN_ROWS
        got = layer(x[:rows]).float()
        assert (got - want[:rows]).abs().max() <= 0.01 * want.abs().max()  # bf16 rounding
    kernel = with_kernel_linears(layer)
    assert kernel.kernel_rows is None and kernel.qweight is layer.qweight
    assert_rows_independent(kernel, x[:20])


@needs_int4
def test_int4_error_is_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 4 * GROUP_SIZE, generator=g) * 3).to(torch.bfloat16)
    q, scales_zeros = quantize_weight(w)
    assert q.min() >= 0 and q.max() <= 15
    step = scales_zeros[..., 0].float().transpose(0, 1).repeat_interleave(GROUP_SIZE, 1)
    err = (dequantize(q, scales_zeros) - w.float()).abs()
    # half a step, plus what rounding scale and zero to bfloat16 moves the grid at its ends
    assert (err <= 0.55 * step).all()


@needs_int4
@pytest.mark.parametrize("shape", [(1152, 384), (384, 1024), (1024, 3072)])
@pytest.mark.parametrize("bias", [False, True])
def test_int4_linear_is_its_dequantized_weight_and_row_invariant(shape, bias):
    w, b, x = random_linear_case(*shape, bias)
    layer = Int4Linear(w, b)
    want = F.linear(x.float(), dequantize(*quantize_weight(w)), None if b is None else b.float())
    got = layer(x).float()
    assert (got - want).abs().max() <= 0.02 * want.abs().max()  # bf16 output rounding
    assert_rows_independent(layer, x)


def test_shapes_the_kernel_does_not_take_stay_as_they_were():
    assert fits(torch.zeros(48, GROUP_SIZE)) and not fits(torch.zeros(40, GROUP_SIZE))
    assert not fits(torch.zeros(48, GROUP_SIZE + 8))


@pytest.mark.parametrize("quantize", [pytest.param(name, marks=mark)
                                      for name, (_, mark) in QUANTIZED.items()])
def test_quantized_engine_speculates_losslessly(quantize):
    path = embedded_model_dir()
    target = load_model(path, dtype=torch.bfloat16)
    drafter = load_drafter(model_drafter_dir(path), target)
    plain = Engine(target, quantize=quantize)
    assert plain.fast_paths[0] == f"{quantize}-weights"
    assert ("onednn-packed-bf16" in plain.fast_paths) == packing_available()
    layer, _ = QUANTIZED[quantize]
    assert isinstance(target.layers[0].self_attn.qkv_proj, layer)
    assert isinstance(target.lm_head, Int8Linear) == (quantize == "int8")
    prompts = [[(7 * i + 11 * j) % 4000 + 5 for i in range(n)] for j, n in
               enumerate((40, 300, 700))]
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    # one prompt at a time: batched, the two engines would split prefills into other chunks
    # (decode rows take other shares of the token budget), which moves K/V in the last bits
    want = [plain.generate([p], params)[0].output_ids for p in prompts]
    spec = Engine(target, drafter=drafter, spec=SpecConfig(16))  # already quantized: kept
    assert [spec.generate([p], params)[0].output_ids for p in prompts] == want
    assert spec.counters.accepted_tokens > 0


@needs_int8
def test_int8_keeps_the_trained_model_greedy_output():
    """Per-channel int8 is close enough to the checkpoint that the shipped model's greedy
    continuations stay the bfloat16 model's (measured: all 48 tokens of each prompt)."""
    path = embedded_model_dir()
    prompts = [[(7 * i + 11 * j) % 4000 + 5 for i in range(n)] for j, n in
               enumerate((40, 300, 700))]
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    runs = {}
    for quantize in (None, "int8"):
        engine = Engine(load_model(path, dtype=torch.bfloat16), quantize=quantize)
        runs[quantize] = [engine.generate([p], params)[0].output_ids for p in prompts]
    same = sum(a == b for want, got in zip(runs[None], runs["int8"]) for a, b in zip(want, got))
    assert same >= 0.9 * 3 * 32, f"{same} of 96 greedy tokens agree"


def test_bad_quantize_requests_are_clear():
    model = load_model(embedded_model_dir(), dtype=torch.float32)
    with pytest.raises(ValueError, match="bfloat16 model on CPU"):
        Engine(model, quantize="int4")
    with pytest.raises(ValueError, match="choose from"):
        Engine(model, quantize="int3")
    with pytest.raises(ValueError, match="needs the fast path"):
        Engine(model, quantize="int4", fast_path=False)
