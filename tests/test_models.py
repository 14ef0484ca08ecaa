"""Our CausalLM and RoPE against transformers (the oracle) on tiny random checkpoints."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from agentflash.engine.attention import DenseCausal
from agentflash.engine.config import ModelConfig
from agentflash.engine.models import CausalLM, ModelOutput, load_model
from agentflash.engine.models.rope import RotaryEmbedding, apply_rope
from conftest import TINY, make_hf_model, save_hf_model
from skips import CUDA

ATOL = 1e-5
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=32, rope_theta=500000.0)
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128, rope_theta=1e6)
ROPES: dict[str, dict[str, Any]] = {
    "default": dict(rope_type="default", rope_theta=10000.0),
    "linear": dict(rope_type="linear", factor=2.0, rope_theta=10000.0),
    "llama3": LLAMA3,
    "yarn": YARN,
    "yarn-untruncated": {**YARN, "truncate": False, "beta_fast": 16.0, "beta_slow": 2.0},
    "yarn-attention-factor": {**YARN, "attention_factor": 0.8},
    "yarn-mscale": {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0},
}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-gqa": ("qwen3", {}),
    "qwen3-mha": ("qwen3", dict(num_key_value_heads=4)),
    "qwen3-tied": ("qwen3", dict(tie_word_embeddings=True)),
    "qwen3-bias": ("qwen3", dict(attention_bias=True)),
    "llama-gqa": ("llama", {}),
    "llama-mha-bias": ("llama", dict(num_key_value_heads=4, attention_bias=True, mlp_bias=True)),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    **{f"llama-{k}": ("llama", dict(rope_parameters=dict(v))) for k, v in ROPES.items()},
    "qwen3-yarn": ("qwen3", dict(rope_parameters=dict(YARN))),
}


def make_pair(path: Path, family: str, **overrides: Any) -> tuple[CausalLM, Any]:
    """(our model loaded from a saved checkpoint, the transformers model it was saved from)."""
    hf = make_hf_model(family, **overrides)
    with torch.no_grad():  # biases start at zero; make them matter
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    save_hf_model(hf, path)
    return load_model(path), hf


def run_ours(
    model: CausalLM, seqs: list[torch.Tensor], starts: list[int], capture: tuple[int, ...] = ()
) -> ModelOutput:
    ids = torch.cat(seqs)
    positions = torch.cat([torch.arange(s, s + len(x)) for x, s in zip(seqs, starts)])
    attn = DenseCausal([len(x) for x in seqs], model.attention_scale)
    return model(ids, positions, attn, capture)


@torch.no_grad()
def run_hf(hf: Any, ids: torch.Tensor, start: int = 0) -> Any:
    positions = torch.arange(start, start + len(ids))[None]
    return hf(ids[None], position_ids=positions, output_hidden_states=True)


def random_seqs(lens: list[int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, TINY["vocab_size"], (n,), generator=g) for n in lens]


def assert_logits_match(model: CausalLM, hf: Any, lens: list[int], starts: list[int]) -> None:
    seqs = random_seqs(lens)
    logits = model.logits(run_ours(model, seqs, starts).hidden)
    assert logits.dtype == torch.float32
    for part, ids, start in zip(logits.split(lens), seqs, starts):
        torch.testing.assert_close(part, run_hf(hf, ids, start).logits[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(tmp_path: Path, case: str) -> None:
    family, overrides = CASES[case]
    model, hf = make_pair(tmp_path / "m", family, **overrides)
    assert_logits_match(model, hf, [24], [0])
    assert_logits_match(model, hf, [16], [300])  # far positions, where RoPE scaling acts


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_sequences_end_to_end_match_separate_forwards(tmp_path: Path, family: str) -> None:
    model, hf = make_pair(tmp_path / "m", family)
    assert_logits_match(model, hf, [5, 1, 17, 9], [0, 0, 40, 3])


@pytest.mark.parametrize("rope", ["linear", "llama3", "yarn-mscale"])
def test_old_rope_scaling_format_parses_the_same(tmp_path: Path, rope: str) -> None:
    params = dict(ROPES[rope])
    model, hf = make_pair(tmp_path / "new", "llama", rope_parameters=dict(params))
    old = tmp_path / "old"
    old.mkdir()
    for f in (tmp_path / "new").iterdir():
        (old / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((old / "config.json").read_text())
    cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = {"type": params.pop("rope_type"), **params}
    (old / "config.json").write_text(json.dumps(cfg))
    assert ModelConfig.from_dir(old) == ModelConfig.from_dir(tmp_path / "new") == model.config
    assert_logits_match(load_model(old), hf, [12], [200])


@pytest.mark.parametrize("rope", ROPES)
def test_rope_tables_equal_transformers_bitwise(rope: str) -> None:
    hf_cfg = transformers.LlamaConfig(**TINY, rope_parameters=dict(ROPES[rope]))
    config = ModelConfig.from_hf({**hf_cfg.to_dict(), "architectures": ["LlamaForCausalLM"]})
    positions = torch.arange(TINY["max_position_embeddings"])
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf_cfg)(torch.zeros(1), positions[None])
    with torch.device("meta"):
        rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)
    rotary.build("cpu")
    cos, sin = rotary.cos_sin(positions)
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])
    q, k = torch.randn(2, 1, 4, len(positions), config.head_dim).unbind(0)
    hf_q, hf_k = apply_rotary_pos_emb(q, k, hf_cos, hf_sin)
    ours = [apply_rope(x[0].transpose(0, 1), cos, sin).transpose(0, 1) for x in (q, k)]
    assert torch.equal(ours[0], hf_q[0]) and torch.equal(ours[1], hf_k[0])


def test_llama3_without_original_max_defaults_like_transformers() -> None:
    params = {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}
    raw = {**TINY, "architectures": ["LlamaForCausalLM"], "rope_parameters": params}
    config = ModelConfig.from_hf(raw)
    assert config.rope.original_max_position_embeddings == TINY["max_position_embeddings"]


@pytest.mark.parametrize("capture", [(0,), (1,), (2,), (0, 2), (2, 0, 1), (1, 1)])
def test_captured_hidden_states(tmp_path: Path, capture: tuple[int, ...]) -> None:
    model, hf = make_pair(tmp_path / "m", "qwen3", num_hidden_layers=3)
    layer_outputs: list[torch.Tensor] = []
    for layer in hf.model.layers:  # a decoder layer returns the residual stream [1, T, H]
        layer.register_forward_hook(lambda mod, args, out: layer_outputs.append(out[0]))
    lens = [6, 11]
    seqs = random_seqs(lens)
    out = run_ours(model, seqs, [0, 0], capture)
    assert out.captured is not None
    assert out.captured.shape == (sum(lens), len(capture) * TINY["hidden_size"])
    for rows, ids in zip(out.captured.split(lens), seqs):
        layer_outputs.clear()
        states = run_hf(hf, ids).hidden_states
        for chunk, layer in zip(rows.split(TINY["hidden_size"], dim=-1), capture):
            torch.testing.assert_close(chunk, layer_outputs[layer], atol=ATOL, rtol=0)
            if layer + 1 < len(model.layers):
                torch.testing.assert_close(chunk, states[layer + 1][0], atol=ATOL, rtol=0)
            else:  # HF's last entry is after the final norm; ours is the residual before it
                torch.testing.assert_close(model.norm(chunk), states[-1][0], atol=ATOL, rtol=0)


def test_capture_defaults_to_none_and_checks_layers(tmp_path: Path) -> None:
    model, _ = make_pair(tmp_path / "m", "llama")
    assert run_ours(model, random_seqs([4]), [0]).captured is None
    with pytest.raises(ValueError, match="capture layers"):
        run_ours(model, random_seqs([4]), [0], capture=(2,))


@pytest.mark.parametrize(
    "dtype, atol", [(torch.bfloat16, 2e-2), (torch.float16, 3e-3), (torch.float64, 1e-6)]
)
def test_load_in_other_dtypes(tmp_path: Path, dtype: torch.dtype, atol: float) -> None:
    _, hf32 = make_pair(tmp_path / "m", "qwen3")
    model = load_model(tmp_path / "m", dtype=dtype)
    assert all(p.dtype == dtype for p in model.parameters())
    hf = copy.deepcopy(hf32).to(dtype)
    (ids,) = random_seqs([20])
    out = run_ours(model, [ids], [0], capture=(0,))
    ref = run_hf(hf, ids)
    assert out.hidden.dtype == dtype
    torch.testing.assert_close(model.logits(out.hidden), ref.logits[0].float(), atol=atol, rtol=0)
    if dtype == torch.float64:  # logits are float32 by contract; compare the states in float64
        torch.testing.assert_close(out.hidden, ref.hidden_states[-1][0], atol=1e-12, rtol=0)
        torch.testing.assert_close(out.captured, ref.hidden_states[1][0], atol=1e-12, rtol=0)


def test_default_dtype_is_the_checkpoints(tmp_path: Path) -> None:
    save_hf_model(make_hf_model("llama").to(torch.bfloat16), tmp_path / "m")
    assert load_model(tmp_path / "m").dtype == torch.bfloat16


def test_sharded_checkpoint(tmp_path: Path) -> None:
    model, hf = make_pair(tmp_path / "single", "qwen3")
    save_hf_model(hf, tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    sharded = load_model(tmp_path / "sharded")
    for key, value in model.state_dict().items():
        assert torch.equal(value, sharded.state_dict()[key]), key
    assert_logits_match(sharded, hf, [10, 7], [0, 5])


@pytest.mark.gpu
@CUDA.mark
def test_cuda_matches_cpu(tmp_path: Path) -> None:
    model, hf = make_pair(tmp_path / "m", "llama", rope_parameters=dict(YARN))
    gpu = load_model(tmp_path / "m", device="cuda")
    assert gpu.device.type == "cuda" and gpu.rotary.cos_half.device.type == "cuda"
    seqs = random_seqs([9, 14])
    ids, positions = torch.cat(seqs), torch.cat([torch.arange(9), torch.arange(14)])
    out = gpu(ids.cuda(), positions.cuda(), DenseCausal([9, 14], gpu.attention_scale))
    cpu = model.logits(run_ours(model, seqs, [0, 0]).hidden)
    torch.testing.assert_close(gpu.logits(out.hidden).cpu(), cpu, atol=1e-4, rtol=0)
