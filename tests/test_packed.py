"""The CPU fast path (engine.cpu.fastpath, engine.cpu.packed): oneDNN-prepacked bfloat16 linears
give F.linear's numbers bit for bit at every row count, and an engine with the fast path
generates exactly what one without it does, plainly and speculatively; beside a decode forward,
the layers serve prefill in buckets of rows (engine.cpu.bucketed)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from agentflash.embedded import embedded_model_dir, model_drafter_dir
from agentflash.engine.config import SpecConfig
from agentflash.engine.engine import Engine
from agentflash.engine.models.dflash import load_drafter
from agentflash.engine.models.loader import load_model
from agentflash.engine.cpu import bucketed
from agentflash.engine.cpu.bucketed import ROW_BUCKET, BucketedLinear, warm_buckets
from agentflash.engine.cpu.kernel_linear import KernelLinear
from agentflash.engine.cpu.packed import PackedLinear
from agentflash.engine.sampler import SamplingParams
from agentflash.kernels import cpu_ops

from conftest import random_linear_case
from skips import CPU_KERNELS, ONEDNN_BF16

pytestmark = ONEDNN_BF16.mark


@pytest.mark.parametrize("shape", [(1152, 384), (4096, 384), (384, 1024), (1024, 3072),
                                   (48, 40)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_f_linear_bit_for_bit(shape, bias):
    w, b, x = random_linear_case(*shape, bias)
    layer = PackedLinear(w, b)
    for rows in range(1, x.shape[0] + 1):
        assert torch.equal(layer(x[:rows]), F.linear(x[:rows], w, b)), rows
    in_f, out_f = shape[1], shape[0]
    assert torch.equal(layer(x.view(3, 11, in_f)), F.linear(x, w, b).view(3, 11, out_f))


def _run(engine: Engine, prompts: list[list[int]], new: int) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    return [c.output_ids for c in engine.generate(prompts, params)]


def test_fast_path_changes_no_token(monkeypatch):
    """The embedded model in bfloat16, with and without the fast path: plain, DFlash (its
    drafter packed too, context K/V rows included), batched. Packing alone: as where
    agentflash's CPU kernels do not run (where they do, decode rows take them: other numbers
    than oneDNN's, tests/test_compiled.py)."""
    monkeypatch.setattr(cpu_ops, "available", lambda: False)
    prompts = [[(7 * i + 11 * j) % 4000 + 5 for i in range(n)] for j, n in
               enumerate((40, 300, 700))]
    path = embedded_model_dir()
    eager = load_model(path, dtype=torch.bfloat16)
    eager_drafter = load_drafter(model_drafter_dir(path), eager)
    fast = load_model(path, dtype=torch.bfloat16)
    fast_drafter = load_drafter(model_drafter_dir(path), fast)
    plain = Engine(fast, fast_path=True)
    assert plain.fast_paths == ["onednn-packed-bf16"]
    assert isinstance(fast.layers[0].mlp.down_proj, PackedLinear)
    assert isinstance(fast.lm_head, PackedLinear)  # tied: a packed copy of the embedding
    want = _run(Engine(eager, fast_path=False), prompts, 48)
    assert _run(plain, prompts, 48) == want  # batched: the same schedule in both
    spec = Engine(fast, drafter=fast_drafter, spec=SpecConfig(16), speculation="always")
    assert fast_drafter.context_kv_proj is not None
    eager_spec = Engine(eager, drafter=eager_drafter, spec=SpecConfig(16), fast_path=False,
                        speculation="always")
    assert _run(spec, prompts, 48) == _run(eager_spec, prompts, 48)
    assert spec.counters.accepted_tokens == eager_spec.counters.accepted_tokens > 0
    # speculative against plain one prompt at a time (batched, prefills split into other chunks)
    assert [_run(spec, [p], 48)[0] for p in prompts] == [_run(plain, [p], 48)[0] for p in prompts]


def test_float32_is_left_as_loaded():
    model = load_model(embedded_model_dir(), dtype=torch.float32)
    engine = Engine(model)
    assert engine.fast_paths == [] and model.lm_head is None
    assert isinstance(model.layers[0].mlp.down_proj, torch.nn.Linear)


@pytest.mark.parametrize("bias", [False, True])
def test_bucketed_linear_rounds_rows_up_to_a_bucket(bias, monkeypatch):
    """Prefill chunks come in every length and oneDNN builds a kernel per matmul shape, so the
    layers serving them pad x to a multiple of ROW_BUCKET rows: each row is that padded
    matmul's, whatever the length, and a decode forward made from the layer computes with the
    CPU kernel on the same weight."""
    w, b, x = random_linear_case(1024, 384, bias)
    layer = BucketedLinear(w, b)
    seen: list[int] = []  # the row counts oneDNN is called with
    real = bucketed.F.linear
    monkeypatch.setattr(bucketed.F, "linear", lambda x, *a: seen.append(x.shape[0]) or real(x, *a))
    for rows in (1, ROW_BUCKET - 1, ROW_BUCKET, ROW_BUCKET + 1, x.shape[0]):
        padded = -(-rows // ROW_BUCKET) * ROW_BUCKET
        want = F.linear(F.pad(x[:rows], (0, 0, 0, padded - rows)), w, b)[:rows]
        assert torch.equal(layer(x[:rows]), want), rows
    assert torch.equal(layer(x.view(3, 11, 384)), layer(x).view(3, 11, 1024))
    assert seen and all(rows % ROW_BUCKET == 0 for rows in seen)
    kernel = layer.kernel_only()
    assert isinstance(kernel, KernelLinear) and kernel.weight is layer.weight


def test_warming_the_buckets_runs_each_layer_shape_once_per_bucket():
    w, b, _ = random_linear_case(64, 32, True)
    other, _, _ = random_linear_case(96, 32, False)
    layers = torch.nn.Sequential(BucketedLinear(w, b), BucketedLinear(w.clone(), None),
                                 BucketedLinear(other, None))
    assert warm_buckets([layers], 4 * ROW_BUCKET) == 2 * 4  # two shapes, buckets 32..128


@CPU_KERNELS.mark
def test_beside_a_decode_forward_the_layers_serve_prefill_in_buckets():
    """Where a decode forward takes decode and verify rows (the CPU kernels), the eager layers
    serve only prefill chunks: bucketed, their kernels built when the engine is made (unless
    the decode forward takes the chunks too: AMX); a second engine on the same model still
    computes decode rows with the kernel (greedy speculative output equal to plain:
    tests/test_embedded.py)."""
    model = load_model(embedded_model_dir(), dtype=torch.bfloat16)
    engine = Engine(model, compile=False)
    assert isinstance(model.layers[0].mlp.down_proj, BucketedLinear)
    assert isinstance(model.lm_head, (PackedLinear, KernelLinear))
    takes_prefill = engine.runner.decode.takes_prefill
    assert takes_prefill == cpu_ops.fast_many_rows()
    assert ("bucket-warm-up" in engine.fast_path_seconds) != takes_prefill
    again = Engine(model, compile=False)
    assert isinstance(again.runner.decode.step.model.layers[0].mlp.down_proj, KernelLinear)
