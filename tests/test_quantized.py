"""Weight-only int8 (engine.cpu.quantized, Engine(quantize="int8")): each layer computes what
its dequantized weight does, its kernel rows do not depend on how many share a call, and
speculative greedy output equals the quantized model's own plain output."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from agentflash.embedded import embedded_model_dir, model_drafter_dir
from agentflash.engine.config import SpecConfig
from agentflash.engine.engine import Engine
from agentflash.engine.models.dflash import DFlashDraftModel, load_drafter
from agentflash.engine.models.loader import load_model
from agentflash.engine.models.qwen3 import CausalLM
from agentflash.engine.cpu.packed import packing_available
from agentflash.engine.cpu import fastpath
from agentflash.engine.cpu.kernel_linear import (WIDEN_ROWS, WidenedLinear,
                                                  float32_packing_available, with_kernel_linears)
from agentflash.engine.cpu.quantized import Int8Linear, quantize_drafter_int8, quantize_int8
from agentflash.engine.sampler import SamplingParams

from conftest import assert_rows_independent, random_linear_case
from skips import CPU_KERNELS

needs_int8 = CPU_KERNELS.mark


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
    # a kept float32 weight (Int8Linear.widen) changes no number of the many-row matmul
    plain = layer(x).float()
    layer.widen()
    assert layer._widened is not None and torch.equal(layer(x).float(), plain)
    assert torch.equal(layer(x[:7]), kernel(x[:7]))  # few rows: still the kernel


@needs_int8
def test_quantized_engine_speculates_losslessly():
    path = embedded_model_dir()
    target = load_model(path, dtype=torch.bfloat16)
    drafter = load_drafter(model_drafter_dir(path), target)
    plain = Engine(target, quantize="int8")
    assert plain.fast_paths[0] == "int8-weights"
    assert ("onednn-packed-bf16" in plain.fast_paths) == packing_available()
    assert isinstance(target.layers[0].self_attn.qkv_proj, Int8Linear)
    assert isinstance(target.lm_head, Int8Linear)
    prompts = [[(7 * i + 11 * j) % 4000 + 5 for i in range(n)] for j, n in
               enumerate((40, 300, 700))]
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    # one prompt at a time: batched, the two engines would split prefills into other chunks
    # (decode rows take other shares of the token budget), which moves K/V in the last bits
    want = [plain.generate([p], params)[0].output_ids for p in prompts]
    spec = Engine(target, drafter=drafter, spec=SpecConfig(16),
                  speculation="always")  # already quantized: kept
    assert [spec.generate([p], params)[0].output_ids for p in prompts] == want
    assert spec.counters.accepted_tokens > 0
    # the drafter is int8 too (engine.cpu.fastpath's int8-drafter), its rows quantized to int16 in
    # the kernel (dynamic), and drafts with the target's head: the same buffers, used that way
    assert isinstance(drafter.fc, Int8Linear) and drafter.fc.dynamic
    # where prefill computes float32 (widened-bf16-linears), the int8 layers keep their float32
    # weights for it (within PACK_FLOAT32_BYTES); the head, always the kernel's, does not
    widens = "widened-bf16-linears" in plain.fast_paths
    assert (drafter.fc._widened is not None) == widens
    assert (target.layers[0].mlp.down_proj._widened is not None) == widens
    assert drafter.head._widened is None and target.lm_head._widened is None
    assert drafter.head.dynamic and drafter.head.qweight is target.lm_head.qweight
    assert not target.lm_head.dynamic


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
        Engine(model, quantize="int8")
    with pytest.raises(ValueError, match="choose from"):
        Engine(model, quantize="int4")  # removed: slower than int8 (docs/performance.md)
    with pytest.raises(ValueError, match="needs the fast path"):
        Engine(model, quantize="int8", fast_path=False)


@needs_int8
@pytest.mark.skipif(not float32_packing_available(), reason="needs oneDNN float32 prepacking")
def test_the_float32_budget_packs_the_widened_weights_before_the_int8_copies(monkeypatch):
    """widened-bf16-linears spends PACK_FLOAT32_BYTES on the target's packed weights first and
    on the int8 drafter's float32 copies (Int8Linear.widen) with what is left."""
    def prepared(budget: int) -> tuple[CausalLM, DFlashDraftModel]:
        target = load_model(embedded_model_dir(), dtype=torch.bfloat16)
        drafter = load_drafter(model_drafter_dir(embedded_model_dir()), target)
        quantize_drafter_int8(drafter)
        monkeypatch.setattr(fastpath, "PACK_FLOAT32_BYTES", budget)
        fastpath._kernel_linears(target, drafter, True)
        return target, drafter

    target, drafter = prepared(1 << 40)
    widened = 4 * sum(m.weight.numel() for m in target.modules() if isinstance(m, WidenedLinear))
    assert drafter.head is None  # (int8-drafter gives it the target's; not called here)
    both = widened + 4 * sum(m.qweight.numel() for m in drafter.modules()
                             if isinstance(m, Int8Linear))
    for budget in (widened, both):
        target, drafter = prepared(budget)
        assert target.layers[0].mlp.gate_up_proj._packed is not None
        assert (drafter.fc._widened is not None) == (budget == both)
