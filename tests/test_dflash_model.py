"""The DFlash drafter against a dense, cache-free implementation of the spec written here.

The oracle reads the drafter's weights straight from its safetensors file and follows the spec
step by step in float64 (context features, block [anchor, MASK...], every layer attending over
context K/V plus the block, final norm, the target's head). Our model computes the context K/V
separately (as the engine caches them), then drafts all sequences in one batched call through a
small dense backend over `kernels.torch_ops.draft_attention`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from agentflash.engine.attention import DenseCausal
from agentflash.engine.models import CausalLM, load_model
from agentflash.engine.models.dflash import DFlashDraftModel, load_drafter
from agentflash.kernels import torch_ops
from conftest import make_dflash_checkpoint, make_hf_model, save_hf_model

TARGET_LAYERS = 4
KV = list[tuple[torch.Tensor, torch.Tensor]]  # per drafter layer: (keys, values)
CASES: dict[str, dict[str, Any]] = {
    "full": dict(target_layer_ids=[0, 2, 3]),
    "sliding": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=3),
    "one-layer-bias": dict(num_layers=1, target_layer_ids=[1], attention_bias=True),
    "extras": dict(num_layers=3, block_size=5, dflash_config=dict(
        input_embedding_scale=0.5, output_multiplier=1.7, final_logit_softcapping=2.0)),
}


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> CausalLM:
    path = tmp_path_factory.mktemp("target")
    save_hf_model(make_hf_model("qwen3", num_hidden_layers=TARGET_LAYERS), path)
    return load_model(path, dtype=torch.float64)


def capture(target: CausalLM, tokens: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
    attn = DenseCausal([len(tokens)], target.attention_scale)
    return target(tokens, torch.arange(len(tokens)), attn, layers).captured


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    freqs = pos[:, None].double() / theta ** (torch.arange(0, d, 2).double() / d)
    angles = torch.cat([freqs, freqs], -1)[:, None]
    cos, sin = angles.cos(), angles.sin()
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


def oracle_logits(
    path: Path, target: CausalLM, captured: torch.Tensor, anchor: int
) -> torch.Tensor:
    """Spec forward of one block [B, V] given context features of positions 0..L-1."""
    cfg = json.loads((path / "config.json").read_text())
    w = {k: v.double() for k, v in load_file(path / "model.safetensors").items()}
    extra, eps, theta = cfg["dflash_config"], cfg["rms_norm_eps"], cfg["rope_theta"]
    b, n_ctx, d = cfg["block_size"], len(captured), cfg["head_dim"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    ctx = rms(captured @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    ids = torch.tensor([anchor] + [extra["mask_token_id"]] * (b - 1))
    h = target.embed_tokens.weight.double()[ids] * extra.get("input_embedding_scale", 1.0)
    q_pos = torch.arange(n_ctx, n_ctx + b)
    k_pos = torch.arange(n_ctx + b)
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"layers.{i}."

        def lin(name: str, x: torch.Tensor) -> torch.Tensor:
            return x @ w[f"{p}{name}.weight"].T + w.get(f"{p}{name}.bias", 0.0)

        hn = rms(h, w[p + "input_layernorm.weight"], eps)
        q = rope(rms(lin("self_attn.q_proj", hn).view(b, hq, d), w[p + "self_attn.q_norm.weight"],
                     eps), q_pos, theta)
        k = torch.cat([lin("self_attn.k_proj", ctx), lin("self_attn.k_proj", hn)])
        k = rope(rms(k.view(-1, hkv, d), w[p + "self_attn.k_norm.weight"], eps), k_pos, theta)
        v = torch.cat([lin("self_attn.v_proj", ctx), lin("self_attn.v_proj", hn)]).view(-1, hkv, d)
        k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        visible = torch.ones(b, n_ctx + b, dtype=torch.bool)
        if kind == "sliding_attention":  # causal in the block, window over everything
            gap = q_pos[:, None] - k_pos[None, :]
            visible = (gap >= 0) & (gap < cfg["sliding_window"])
        scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        h = h + lin("self_attn.o_proj", torch.einsum("hqk,khd->qhd", probs, v).reshape(b, -1))
        hn = rms(h, w[p + "post_attention_layernorm.weight"], eps)
        h = h + lin("mlp.down_proj", F.silu(lin("mlp.gate_proj", hn)) * lin("mlp.up_proj", hn))
    logits = rms(h, w["norm.weight"], eps) @ target.lm_head.weight.double().T
    logits = logits * extra.get("output_multiplier", 1.0)
    cap = extra.get("final_logit_softcapping")
    return logits if cap is None else torch.tanh(logits / cap) * cap


class DenseDraftAttention:
    """Test backend: padded per-layer context K/V [N, L, Hkv, D] + the blocks' own K/V."""

    def __init__(self, model: DFlashDraftModel, kv: KV, ctx_lens: torch.Tensor) -> None:
        self.model, self.kv, self.ctx_lens = model, kv, ctx_lens

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n = len(self.ctx_lens)
        causal, window = self.model.layer_kind(layer)
        k_ctx, v_ctx = self.kv[layer]
        out = torch_ops.draft_attention(
            q.unflatten(0, (n, -1)), k_ctx, v_ctx, self.ctx_lens, k.unflatten(0, (n, -1)),
            v.unflatten(0, (n, -1)), self.model.attention_scale, causal, window,
        )
        return out.flatten(0, 1)


def context_kv_all(model: DFlashDraftModel, captured: torch.Tensor, positions: torch.Tensor) -> KV:
    ctx = model.context_features(captured)
    return [model.context_kv(i, ctx, positions) for i in range(len(model.layers))]


def pad(parts: list[torch.Tensor]) -> torch.Tensor:
    out = parts[0].new_zeros(len(parts), max(len(p) for p in parts), *parts[0].shape[1:])
    for i, p in enumerate(parts):
        out[i, : len(p)] = p
        out[i, len(p):] = 1e3  # garbage the mask must hide
    return out


def draft(model: DFlashDraftModel, target: CausalLM, caches: list[KV], anchors: list[int]
          ) -> torch.Tensor:
    """Logits [N, B, V] for sequences whose per-layer context K/V are `caches[n]`."""
    lens = torch.tensor([len(c[0][0]) for c in caches])
    kv = [(pad([c[i][0] for c in caches]), pad([c[i][1] for c in caches]))
          for i in range(len(model.layers))]
    ids = model.block_input_ids(torch.tensor(anchors))
    positions = lens[:, None] + torch.arange(ids.shape[1])
    hidden = model(model.embed_block(target, ids.flatten()), positions.flatten(),
                   DenseDraftAttention(model, kv, lens))
    return model.logits(target, hidden).unflatten(0, ids.shape)


@pytest.mark.parametrize("case", CASES)
def test_batched_drafts_match_dense_spec(target: CausalLM, tmp_path: Path, case: str) -> None:
    path = make_dflash_checkpoint(tmp_path / "d", target.config, **CASES[case])
    model = load_drafter(path, target)
    g = torch.Generator().manual_seed(1)
    lens = [11, 2, 7]  # contexts longer and shorter than the sliding window, batched together
    seqs = [torch.randint(0, target.config.vocab_size, (n + 1,), generator=g) for n in lens]
    layers = model.config.target_layer_ids
    captured = [capture(target, s, layers)[:-1] for s in seqs]  # the anchor's: next step
    flat = context_kv_all(model, torch.cat(captured), torch.cat([torch.arange(n) for n in lens]))
    split = [(k.split(lens), v.split(lens)) for k, v in flat]
    caches = [[(ks[n], vs[n]) for ks, vs in split] for n in range(len(lens))]
    logits = draft(model, target, caches, [int(s[-1]) for s in seqs])
    for n, (s, c) in enumerate(zip(seqs, captured)):
        expected = oracle_logits(path, target, c, int(s[-1]))
        torch.testing.assert_close(logits[n], expected.float(), atol=2e-5, rtol=2e-5)
        assert torch.equal(logits[n, 1:].argmax(-1), expected[1:].argmax(-1))


def test_incremental_context_equals_from_scratch(target: CausalLM, tmp_path: Path) -> None:
    path = make_dflash_checkpoint(tmp_path / "d", target.config, target_layer_ids=[1, 3],
                                  layer_types=["full_attention", "sliding_attention"],
                                  sliding_window=4)
    model = load_drafter(path, target)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, target.config.vocab_size, (14,), generator=g)
    captured = capture(target, tokens, model.config.target_layer_ids)
    cache: KV = []
    for start, end in [(0, 5), (5, 6), (6, 10), (10, 13)]:  # committed positions per step
        new = context_kv_all(model, captured[start:end], torch.arange(start, end))
        cache = new if not cache else [
            (torch.cat([k, k2]), torch.cat([v, v2])) for (k, v), (k2, v2) in zip(cache, new)
        ]
        scratch = context_kv_all(model, captured[:end], torch.arange(end))
        for (k, v), (k2, v2) in zip(cache, scratch):
            torch.testing.assert_close(k, k2, atol=1e-12, rtol=0)
            torch.testing.assert_close(v, v2, atol=1e-12, rtol=0)
        anchor = int(tokens[end])
        torch.testing.assert_close(draft(model, target, [cache], [anchor])[0],
                                   draft(model, target, [scratch], [anchor])[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(draft(model, target, [cache], [anchor])[0],
                                   oracle_logits(path, target, captured[:end], anchor).float(),
                                   atol=2e-5, rtol=2e-5)


def test_extras_applied_where_documented(target: CausalLM, tmp_path: Path) -> None:
    path = make_dflash_checkpoint(tmp_path / "d", target.config, target_layer_ids=[2],
                                  dflash_config=dict(input_embedding_scale=3.0,
                                                     output_multiplier=0.25,
                                                     final_logit_softcapping=0.5))
    model = load_drafter(path, target)
    ids = model.block_input_ids(torch.tensor([5, 9]))
    mask = model.config.mask_token_id
    assert ids.tolist() == [[5] + [mask] * 3, [9] + [mask] * 3]
    torch.testing.assert_close(model.embed_block(target, ids), 3.0 * target.embed(ids))
    hidden = torch.randn(6, target.config.hidden_size, dtype=torch.float64)
    logits = model.logits(target, hidden)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, 0.5 * torch.tanh(target.logits(hidden) * 0.25 / 0.5))
    assert logits.abs().max() <= 0.5


def test_round_trip_weights_dtype_and_device(target: CausalLM, tmp_path: Path) -> None:
    path = make_dflash_checkpoint(tmp_path / "d", target.config, attention_bias=True,
                                  layer_types=["sliding_attention", "full_attention"],
                                  sliding_window=6)
    model = load_drafter(path, target)
    assert (model.dtype, model.device) == (torch.float64, target.device)
    assert [tuple(model.layer_kind(i)) for i in range(2)] == [(True, 6), (False, None)]
    stored = load_file(path / "model.safetensors")
    state = model.state_dict()
    assert torch.equal(state["fc.weight"], stored["fc.weight"].double())
    attn = "layers.1.self_attn."
    qkv = torch.cat([stored[f"{attn}{n}_proj.bias"] for n in "qkv"]).double()
    assert torch.equal(state[f"{attn}qkv_proj.bias"], qkv)
    gate_up = torch.cat([stored[f"layers.0.mlp.{n}_proj.weight"] for n in ("gate", "up")])
    assert torch.equal(state["layers.0.mlp.gate_up_proj.weight"], gate_up.double())
    assert load_drafter(path, target, dtype=torch.float32).dtype == torch.float32
