"""DFlash2 drafters: the engine against a float64 oracle of the reference's decoding loop.

The oracle follows the reference (z-lab/dflash `dflash_generate` with `DFlash2DraftModel`)
step by step, written here without caches: the target is transformers' Qwen3 run over the whole
sequence every step; the drafter reads its weights straight from the safetensors file and runs
[anchor, MASK...] over the context features of every committed position, with each sublayer's
grouped dynamic convolution, each query seeing the keys within the sliding window of its own
position (not causal: `is_causal: false`), the target's head, and the candidate selector's greedy
walk from the anchor. One deliberate difference: where the budget leaves room for fewer than a
block's drafts, the reference shortens the drafter's block; the engine drafts the whole block and
verifies the first drafts (so does the oracle).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from agentflash.engine.config import CacheConfig, SchedulerConfig, SpecConfig
from agentflash.engine.engine import Engine
from agentflash.engine.errors import CheckpointError
from agentflash.engine.models import load_model
from agentflash.engine.models.dflash import load_drafter
from agentflash.engine.sampler import SamplingParams
from conftest import make_dflash_checkpoint, make_hf_model
from test_dflash_model import rms, rope
from test_spec import assert_target_distribution, prompts_for

V2 = dict(conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=4)
WINDOW = 6   # shorter than every prompt below
BLOCK = 6


class Oracle:
    """The reference's greedy DFlash2 loop in float64, cache-free."""

    def __init__(self, target, drafter_dir: Path) -> None:
        self.target = target.double()
        self.cfg = json.loads((drafter_dir / "config.json").read_text())
        self.w = {k: v.double() for k, v in load_file(drafter_dir / "model.safetensors").items()}

    def features(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's logits [T, V] and the drafter's context features [T, K*H]."""
        out = self.target(torch.tensor([tokens]), output_hidden_states=True)
        ids = self.cfg["dflash_config"]["target_layer_ids"]
        return out.logits[0], torch.cat([out.hidden_states[i + 1][0] for i in ids], -1)

    def conv(self, x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        b, h = x.shape
        width, groups = base.shape[0], dynamic.shape[-1]
        out = torch.zeros_like(x)
        for t in range(b):
            for o in range(min(width, t + 1)):
                weight = base[o] + dynamic[t, o].repeat_interleave(h // groups)
                out[t] += weight * x[t - o]
        return out

    def draft(self, feats: torch.Tensor, anchor: int) -> list[int]:
        cfg, w = self.cfg, self.w
        extra, eps, theta = cfg["dflash_config"], cfg["rms_norm_eps"], cfg["rope_theta"]
        b, start, d = cfg["block_size"], len(feats), cfg["head_dim"]
        hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        width = extra["conv_kernel_size"]
        ctx = rms(feats @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
        ids = torch.tensor([anchor] + [extra["mask_token_id"]] * (b - 1))
        h = self.target.model.embed_tokens.weight[ids] * extra.get("input_embedding_scale", 1.0)
        q_pos, k_pos = torch.arange(start, start + b), torch.arange(start + b)
        gap = q_pos[:, None] - k_pos[None, :]
        visible = (gap < cfg["sliding_window"]) & (-gap < cfg["sliding_window"])
        for i in range(cfg["num_hidden_layers"]):
            p = f"layers.{i}."

            def lin(name: str, x: torch.Tensor) -> torch.Tensor:
                return x @ w[f"{p}{name}.weight"].T

            def sublayer(conv: str, x: torch.Tensor, body) -> torch.Tensor:
                dyn = lin(f"{conv}.kernel_projection", x).view(b, 2, width, -1)
                base = w[f"{p}{conv}.base_kernel"]
                return self.conv(body(self.conv(x, dyn[:, 0], base[0])), dyn[:, 1], base[1])

            def attention(x: torch.Tensor) -> torch.Tensor:
                q = rope(rms(lin("self_attn.q_proj", x).view(b, hq, d),
                             w[p + "self_attn.q_norm.weight"], eps), q_pos, theta)
                k = torch.cat([lin("self_attn.k_proj", ctx), lin("self_attn.k_proj", x)])
                k = rope(rms(k.view(-1, hkv, d), w[p + "self_attn.k_norm.weight"], eps), k_pos,
                         theta)
                v = torch.cat([lin("self_attn.v_proj", ctx), lin("self_attn.v_proj", x)])
                k, v = k.repeat_interleave(hq // hkv, 1), v.view(-1, hkv, d).repeat_interleave(
                    hq // hkv, 1)
                scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
                probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
                return lin("self_attn.o_proj", torch.einsum("hqk,khd->qhd", probs, v).reshape(b, -1))

            def mlp(x: torch.Tensor) -> torch.Tensor:
                return lin("mlp.down_proj", F.silu(lin("mlp.gate_proj", x)) * lin("mlp.up_proj", x))

            h = h + sublayer("attention_conv", rms(h, w[p + "input_layernorm.weight"], eps),
                             attention)
            h = h + sublayer("mlp_conv", rms(h, w[p + "post_attention_layernorm.weight"], eps), mlp)
        hidden = rms(h, w["norm.weight"], eps)[1:]
        logits = hidden @ self.target.lm_head.weight.T
        unary, candidates = logits.topk(extra["selector_top_k"], -1)
        projected = hidden @ w["candidate_selector.hidden_projection.weight"].T
        previous, drafts = anchor, []
        for j in range(b - 1):
            pair = (w["candidate_selector.predecessor_codebook"][previous] * projected[j]) @ \
                w["candidate_selector.successor_codebook"][candidates[j]].T
            previous = int(candidates[j, int((unary[j] + pair).argmax())])
            drafts.append(previous)
        return drafts

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new: int) -> tuple[list[int], list, list[int]]:
        """(output, drafted blocks, acceptance lengths) as the reference's loop makes them."""
        logits, _ = self.features(prompt)
        tokens = prompt + [int(logits[-1].argmax())]
        blocks, lengths = [], []
        budget = len(prompt) + max_new
        while len(tokens) < budget:
            start = len(tokens) - 1
            _, feats = self.features(tokens[:start])
            drafts = self.draft(feats, tokens[start])[:min(BLOCK, budget - start) - 1]
            logits, _ = self.features(tokens + drafts)
            choice = logits[start:].argmax(-1).tolist()
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == choice[accepted]:
                accepted += 1
            new = (drafts[:accepted] + [choice[accepted]])[:budget - len(tokens)]
            tokens += new
            blocks.append(drafts)
            lengths.append(len(new))
        return tokens[len(prompt):], blocks, lengths


@pytest.fixture(scope="module")
def fixture_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash2")
    hf = make_hf_model("qwen3", seed=3, vocab_size=8, num_hidden_layers=3, bos_token_id=None,
                       eos_token_id=None)
    hf.save_pretrained(root / "target")
    path = make_dflash_checkpoint(
        root / "draft", hf.config, num_layers=2, block_size=BLOCK, target_layer_ids=[0, 1],
        layer_types=["sliding_attention"] * 2, sliding_window=WINDOW, seed=3, v2=V2)
    return hf, root / "target", path


def test_engine_equals_the_reference_loop_in_float64(fixture_pair):
    hf, target_dir, drafter_dir = fixture_pair
    model = load_model(target_dir, dtype=torch.float64)
    drafter = load_drafter(drafter_dir, model)
    oracle = Oracle(hf, drafter_dir)
    prompts = prompts_for(5, 8, seed=11, hi=30)
    prompts = [p + [1] * (WINDOW + 2 - len(p)) if len(p) <= WINDOW else p for p in prompts]
    max_new = 23  # not a multiple of the block: the last verify is cut
    engine = Engine(model, CacheConfig(4, 1024), SchedulerConfig(max_running=3),
                    drafter=drafter, spec=SpecConfig(BLOCK), speculation="always")
    ids = [engine.submit(p, SamplingParams(max_new_tokens=max_new), trace=True) for p in prompts]
    while engine.has_work():
        engine.step()
    accepted = 0
    for seq_id, prompt in zip(ids, prompts):
        result = engine.result(seq_id)
        output, blocks, lengths = oracle.generate(prompt, max_new)
        assert result.output_ids == output
        assert result.counters.drafts == blocks
        assert result.counters.acceptance_lengths == lengths
        accepted += result.counters.accepted_tokens
    assert accepted > 0
    assert engine.stats()["pages_referenced"] == 0


def test_greedy_speculative_equals_plain_batched_under_auto(fixture_pair):
    _, target_dir, drafter_dir = fixture_pair
    model = load_model(target_dir)
    drafter = load_drafter(drafter_dir, model)
    prompts = prompts_for(9, 8, seed=5, hi=40)
    params = SamplingParams(max_new_tokens=30)
    plain = Engine(model, CacheConfig(4, 512)).generate(prompts, params)
    for speculation in ("always", "auto"):
        engine = Engine(model, CacheConfig(4, 512), SchedulerConfig(max_running=4),
                        drafter=drafter, spec=SpecConfig(BLOCK), speculation=speculation)
        assert [c.output_ids for c in engine.generate(prompts, params)] == \
            [c.output_ids for c in plain]
        assert engine.counters.draft_forwards > 0


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, max_new_tokens=3),
    SamplingParams(temperature=0.7, top_p=0.8, max_new_tokens=3),
])
def test_sampling_with_the_selectors_q_matches_the_target_distribution(tmp_path, params):
    """Drafts drawn from the selector's softmax(score / T) over its candidates, judged with that
    q: the outputs have the target's distribution (chi-square, with its power check)."""
    hf = make_hf_model("qwen3", seed=2, vocab_size=5, bos_token_id=None, eos_token_id=None)
    hf.save_pretrained(tmp_path / "target")
    model = load_model(tmp_path / "target")
    make_dflash_checkpoint(tmp_path / "draft", hf.config, block_size=3, seed=2,
                           v2={**V2, "selector_top_k": 3})
    drafter = load_drafter(tmp_path / "draft", model)
    engine = Engine(model, CacheConfig(4, 4096), SchedulerConfig(max_running=128),
                    drafter=drafter, spec=SpecConfig(3), speculation="always")
    assert_target_distribution(engine, model, [1, 3, 0, 2], params)
    assert engine.counters.accepted_tokens > 0


def test_sampled_walks_draw_from_q_and_greedy_walks_take_the_best(fixture_pair):
    _, target_dir, drafter_dir = fixture_pair
    drafter = load_drafter(drafter_dir, load_model(target_dir, dtype=torch.float64))
    selector = drafter.candidate_selector
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 1, drafter.config.hidden_size, generator=g, dtype=torch.float64)
    logits = torch.randn(1, 1, drafter.config.vocab_size, generator=g)
    anchors = torch.tensor([2])
    n = 20000
    walk = selector.walk(hidden.expand(n, 1, -1), logits.expand(n, 1, -1), anchors.expand(n),
                         torch.full((n,), 0.8), torch.rand(n, 1, generator=g))
    q, candidates = walk.q[0, 0], walk.candidates[0, 0]
    seen = Counter(walk.tokens[:, 0].tolist())
    for k in range(selector.top_k):
        assert abs(seen[int(candidates[k])] / n - float(q[k])) < 0.015
    greedy = selector.walk(hidden, logits, anchors, torch.zeros(1), torch.zeros(1, 1))
    scores = selector.candidates(hidden, logits)[0][0, 0] + selector.pair_scores(
        anchors, selector.hidden_projection(hidden).float()[:, 0], candidates[None])[0]
    assert int(greedy.tokens[0, 0]) == int(candidates[int(scores.argmax())])


def test_dflash2_checkpoints_missing_fields_or_tensors_are_clear_errors(tmp_path):
    hf = make_hf_model("qwen3", vocab_size=16, bos_token_id=None, eos_token_id=None)
    hf.save_pretrained(tmp_path / "target")
    model = load_model(tmp_path / "target")
    path = make_dflash_checkpoint(tmp_path / "d", hf.config, v2=V2)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["dflash_config"]["selector_rank"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="selector_rank"):
        load_drafter(path, model)
    path = make_dflash_checkpoint(tmp_path / "e", hf.config, v2={**V2, "conv_group_size": 7})
    with pytest.raises(CheckpointError, match="conv_group_size"):
        load_drafter(path, model)
    path = make_dflash_checkpoint(tmp_path / "f", hf.config, v2=V2)
    tensors = load_file(path / "model.safetensors")
    del tensors["layers.1.mlp_conv.base_kernel"]
    from safetensors.torch import save_file
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="mlp_conv.base_kernel"):
        load_drafter(path, model)
