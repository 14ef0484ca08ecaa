"""Our Qwen3.5 (HybridCausalLM over Gated DeltaNet and gated attention) against transformers, on
tiny random float32 checkpoints of both layouts, dense and mixture-of-experts: one-shot prefill,
chunked prefill with state and paged KV carried between chunks, sequences laid end to end, and
greedy decoding."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

from agentflash.engine.attention import DenseCausal, PagedAttention
from agentflash.engine.errors import CheckpointError, UnsupportedModelError
from agentflash.engine.kv import KVPool
from agentflash.engine.models.gated_deltanet import (RecurrentStates, delta_rule_chunked,
                                                     delta_rule_step)
from agentflash.engine.models.qwen3_5 import HybridCausalLM, HybridConfig, load_qwen3_5
from agentflash.engine.models.rope import apply_rope

ATOL = 1e-4
PAGE = 16
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
        "mrope_section": [2, 1, 1], "mrope_interleaved": True}
TEXT: dict[str, Any] = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=512,
    rms_norm_eps=1e-6, rope_parameters=ROPE,
)
MOE: dict[str, Any] = dict(  # Qwen3.5-MoE: every MLP routed (2 of 8 experts) plus a shared one
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=48)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=2,
              spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
              num_position_embeddings=16)


def perturb(model: Any, seed: int) -> Any:
    """Norms off their init (else logits are nearly flat) and decays spread from slow to fast
    (A in [0.01, 4], dt_bias around 0) so the state carries across chunks."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(math.log(0.01), math.log(4.0),
                                                       generator=g))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return model.float().eval()


def make_hf(seed: int = 0, moe: bool = False, **overrides: Any) -> Any:
    """A random transformers Qwen3.5 (with MoE: Qwen3.5-MoE) causal LM, float32."""
    torch.manual_seed(seed)
    if moe:
        text = {k: v for k, v in TEXT.items() if k != "intermediate_size"}
        cfg = transformers.Qwen3_5MoeTextConfig(**{**text, **MOE, **overrides})
        return perturb(transformers.Qwen3_5MoeForCausalLM(cfg), seed)
    cfg = transformers.Qwen3_5TextConfig(**{**TEXT, **overrides})
    return perturb(transformers.Qwen3_5ForCausalLM(cfg), seed)


@pytest.fixture(scope="module", params=["dense", "moe"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[HybridCausalLM, Any]:
    hf = make_hf(moe=request.param == "moe")
    path = tmp_path_factory.mktemp("qwen3_5")
    hf.save_pretrained(path)
    return load_qwen3_5(path), hf


def random_ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, TEXT["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed))


def run_fresh(model: HybridCausalLM, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Logits of sequences from position 0, laid end to end in one uncached forward."""
    lens = [len(s) for s in seqs]
    positions = torch.cat([torch.arange(n) for n in lens])
    states = RecurrentStates.zeros(model.config, lens, "cpu", model.dtype)
    out = model(torch.cat(seqs), positions, DenseCausal(lens, model.attention_scale), states)
    return list(model.logits(out.hidden).split(lens))


@torch.no_grad()
def hf_logits(hf: Any, ids: torch.Tensor) -> torch.Tensor:
    return hf(ids[None], use_cache=False).logits[0]


class Session:
    """Sequences run together through our model chunk by chunk: full-attention K/V in a paged
    pool (8 pages each), linear-attention state in RecurrentStates rows, one per sequence."""

    def __init__(self, model: HybridCausalLM, num_seqs: int) -> None:
        cfg = model.config
        self.model = model
        shapes = [(cfg.num_key_value_heads, cfg.head_dim)] * cfg.num_full_layers
        self.pool = KVPool(PAGE, 8 * num_seqs, shapes, dtype=model.dtype)
        self.pages = [list(range(8 * s, 8 * s + 8)) for s in range(num_seqs)]
        self.states = RecurrentStates.zeros(cfg, [1] * num_seqs, "cpu", model.dtype)
        self.ctx = [0] * num_seqs

    def step(self, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        """Feed every sequence its next tokens; returns their logits."""
        lens = [len(c) for c in chunks]
        positions = torch.cat([torch.arange(c, c + n) for c, n in zip(self.ctx, lens)])
        self.ctx = [c + n for c, n in zip(self.ctx, lens)]
        attn = PagedAttention.build(self.pool.k, self.pool.v, self.pages, self.ctx, lens, PAGE,
                                    self.model.attention_scale)
        states = RecurrentStates(lens, self.states.conv, self.states.recurrent)
        out = self.model(torch.cat(chunks), positions, attn, states)
        return list(self.model.logits(out.hidden).split(lens))


def test_prefill_longer_than_a_chunk_matches_transformers(pair: tuple[HybridCausalLM, Any]) -> None:
    model, hf = pair
    ids = random_ids(70)
    (logits,) = run_fresh(model, [ids])
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hf_logits(hf, ids), atol=ATOL, rtol=0)


def save_conditional(hf: Any, path: Path) -> Any:
    """`hf`'s weights as the text model of a Qwen3_5[Moe]ForConditionalGeneration (with a tiny
    vision tower), saved at `path`; returns that model."""
    torch.manual_seed(1)
    moe = isinstance(hf, transformers.Qwen3_5MoeForCausalLM)
    config_cls = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    model_cls = (transformers.Qwen3_5MoeForConditionalGeneration if moe
                 else transformers.Qwen3_5ForConditionalGeneration)
    cfg = config_cls(text_config=hf.config.to_dict(), vision_config=VISION)
    full = model_cls(cfg).float().eval()
    full.model.language_model.load_state_dict(hf.model.state_dict())
    full.lm_head.load_state_dict(hf.lm_head.state_dict())
    full.save_pretrained(path)
    return full


def test_conditional_generation_layout_loads_the_text_model(
    tmp_path: Path, pair: tuple[HybridCausalLM, Any], caplog: pytest.LogCaptureFixture
) -> None:
    model, hf = pair
    full = save_conditional(hf, tmp_path / "vl")
    with caplog.at_level(logging.INFO, logger="agentflash.engine.models.qwen3_5"):
        ours = load_qwen3_5(tmp_path / "vl")
    visual = sum(1 for n in full.state_dict() if n.startswith("model.visual."))
    assert any(f"skipped {visual} tensors" in r.getMessage() for r in caplog.records)
    assert ours.config == model.config
    ids = random_ids(70, seed=1)
    (logits,) = run_fresh(ours, [ids])
    assert torch.equal(logits, run_fresh(model, [ids])[0])
    with torch.no_grad():
        want = full(input_ids=ids[None], use_cache=False).logits[0]
    torch.testing.assert_close(logits, want, atol=ATOL, rtol=0)
    session = Session(ours, 1)   # and prefilled in chunks, state and KV carried between them
    chunked = torch.cat([session.step([chunk])[0] for chunk in ids.split([29, 1, 40])])
    torch.testing.assert_close(chunked, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("split", [(37, 1, 32), (2, 65, 3)])
def test_chunked_prefill_carries_state_and_kv(
    pair: tuple[HybridCausalLM, Any], split: tuple[int, ...]
) -> None:
    model, hf = pair
    ids = random_ids(70)
    session = Session(model, 1)
    logits = torch.cat([session.step([chunk])[0] for chunk in ids.split(list(split))])
    torch.testing.assert_close(logits, run_fresh(model, [ids])[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits, hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_sequences_end_to_end_match_separate_forwards(pair: tuple[HybridCausalLM, Any]) -> None:
    model, hf = pair
    seqs = [random_ids(70), random_ids(9, seed=2), random_ids(1, seed=3), random_ids(5, seed=4)]
    for logits, ids in zip(run_fresh(model, seqs), seqs):
        torch.testing.assert_close(logits, run_fresh(model, [ids])[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(logits, hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_greedy_decoding_matches_generate(pair: tuple[HybridCausalLM, Any]) -> None:
    """Two prompts prefilled in one forward, then decoded together one token per step (the
    recurrent form, both rows in one batched step)."""
    model, hf = pair
    prompts = [random_ids(70), random_ids(13, seed=5)]
    session = Session(model, len(prompts))
    logits = session.step(prompts)
    generated: list[list[int]] = [[], []]
    for _ in range(12):
        nxt = [int(row[-1].argmax()) for row in logits]
        for out, t in zip(generated, nxt):
            out.append(t)
        logits = session.step([torch.tensor([t]) for t in nxt])
    for prompt, ours in zip(prompts, generated):
        with torch.no_grad():
            # an explicit mask: generate would otherwise take the prompt's 0s for padding
            want = hf.generate(prompt[None], attention_mask=torch.ones(1, len(prompt)),
                               max_new_tokens=12, min_new_tokens=12, do_sample=False,
                               pad_token_id=0)
        assert ours == want[0, len(prompt):].tolist()


def test_tied_embeddings(tmp_path: Path) -> None:
    hf = make_hf(seed=3, tie_word_embeddings=True)
    hf.save_pretrained(tmp_path / "tied")
    model = load_qwen3_5(tmp_path / "tied")
    assert model.lm_head is None
    ids = random_ids(20, seed=6)
    torch.testing.assert_close(run_fresh(model, [ids])[0], hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_text_rope_equals_transformers_mrope_bitwise() -> None:
    cfg = transformers.Qwen3_5TextConfig(**TEXT)
    with torch.device("meta"):
        model = HybridCausalLM(HybridConfig.from_hf({**cfg.to_dict(),
                                                     "architectures": ["Qwen3_5ForCausalLM"]}))
    model.rotary.build("cpu")
    positions = torch.arange(TEXT["max_position_embeddings"])
    hf_cos, hf_sin = Qwen3_5TextRotaryEmbedding(cfg)(torch.zeros(1), positions[None])
    cos, sin = model.rotary.cos_sin(positions, torch.float32)
    assert cos.shape[-1] == 8
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])
    x = torch.randn(len(positions), 2, 8)
    assert torch.equal(apply_rope(x, cos, sin), apply_rope(x, hf_cos[0], hf_sin[0]))


def test_recurrent_and_chunked_forms_agree() -> None:
    g = torch.Generator().manual_seed(0)
    length, heads, dk, dv = 70, 3, 8, 5
    q, k = (torch.nn.functional.normalize(torch.randn(length, heads, dk, generator=g), dim=-1)
            for _ in range(2))
    v = torch.randn(length, heads, dv, generator=g)
    decay = -0.3 * torch.rand(length, heads, generator=g)
    beta = torch.rand(length, heads, generator=g)
    state0 = torch.randn(heads, dk, dv, generator=g)
    out, state = delta_rule_chunked(q, k, v, decay, beta, state0)
    step_state, rows = state0[None], []
    for t in range(length):
        row, step_state = delta_rule_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], decay[t:t + 1],
                                          beta[t:t + 1], step_state)
        rows.append(row)
    torch.testing.assert_close(out, torch.cat(rows), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, step_state[0], atol=1e-5, rtol=1e-5)


def test_config_layouts_and_defaults() -> None:
    text = {**transformers.Qwen3_5TextConfig(**TEXT).to_dict(),
            "architectures": ["Qwen3_5ForCausalLM"]}
    nested = {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text,
              "tie_word_embeddings": False}
    config = HybridConfig.from_hf(text)
    assert HybridConfig.from_hf(nested) == config
    assert (config.rotary_dim, config.num_linear_layers, config.num_full_layers) == (8, 3, 1)
    interval = {k: v for k, v in text.items() if k != "layer_types"}
    interval.update(num_hidden_layers=8, full_attention_interval=4)
    assert HybridConfig.from_hf(interval).layer_types == (
        ("linear_attention",) * 3 + ("full_attention",)) * 2
    with pytest.raises(UnsupportedModelError):
        HybridConfig.from_hf({**text, "architectures": ["Qwen3ForCausalLM"]})


def test_moe_experts_stored_stacked_load_as_stored(tmp_path: Path) -> None:
    """A MoE checkpoint saved with transformers' in-memory layout (experts stacked in one
    [E, ...] tensor each) loads like the per-expert one transformers writes."""
    import json

    from safetensors.torch import save_file

    hf = make_hf(seed=2, moe=True)
    hf.save_pretrained(tmp_path / "per_expert")
    (tmp_path / "stacked").mkdir()
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()},
              tmp_path / "stacked" / "model.safetensors")
    (tmp_path / "stacked" / "config.json").write_text(
        (tmp_path / "per_expert" / "config.json").read_text())
    assert "model.layers.0.mlp.experts.gate_up_proj" in json.dumps(list(hf.state_dict()))
    ids = random_ids(30, seed=8)
    logits = run_fresh(load_qwen3_5(tmp_path / "stacked"), [ids])[0]
    assert torch.equal(logits, run_fresh(load_qwen3_5(tmp_path / "per_expert"), [ids])[0])
    torch.testing.assert_close(logits, hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_moe_config() -> None:
    text = {**make_hf(moe=True).config.to_dict(), "architectures": ["Qwen3_5MoeForCausalLM"]}
    config = HybridConfig.from_hf(text)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            config.shared_expert_intermediate_size) == (8, 2, 32, 48)
    nested = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "text_config": text}
    assert HybridConfig.from_hf(nested) == config
    with pytest.raises(UnsupportedModelError, match="mlp_only_layers"):
        HybridConfig.from_hf({**text, "mlp_only_layers": [0]})
    with pytest.raises(CheckpointError, match="num_experts_per_tok"):
        HybridConfig.from_hf({**text, "num_experts_per_tok": 9})
    with pytest.raises(CheckpointError, match="moe_intermediate_size"):
        HybridConfig.from_hf({k: v for k, v in text.items() if k != "moe_intermediate_size"})
