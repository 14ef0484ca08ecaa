"""DFlash drafter training: the anchor-block mask, training forward == serving forward, the
published checkpoint round trip, and a real learning signal on a tiny target's own outputs."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from agentflash.engine.attention import DenseCausal
from agentflash.engine.config import RopeConfig
from agentflash.engine.models import CausalLM, load_model
from agentflash.engine.models.dflash import DFlashConfig, DFlashDraftModel, LayerKind, load_drafter
from agentflash.engine.models.dflash_config import DFlash2Extras
from agentflash.engine.engine import Engine
from agentflash.engine.sampler import SamplingParams
from agentflash.training.data import Example, read_jsonl
from agentflash.training.dflash import (TrainConfig, TrainLog, anchor_block_mask, build_batch,
                                        decode_walk, default_gamma, draft_hidden, evaluate,
                                        position_weights, train)
from agentflash.training.drafter_checkpoint import (drafter_config_json, grow_to_v2, init_drafter,
                                                   save_drafter)
from agentflash.training.regenerate import prompts_of, regenerate
from agentflash.kernels import torch_ops
from conftest import make_dflash_checkpoint, make_hf_model, save_hf_model

KINDS = [LayerKind(False, None), LayerKind(True, None), LayerKind(True, 2), LayerKind(False, 3)]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> CausalLM:
    path = tmp_path_factory.mktemp("target")
    save_hf_model(make_hf_model("qwen3", num_hidden_layers=4, attention_bias=True), path)
    return load_model(path, dtype=torch.float64)


def expected_mask(seq_lens: list[int], anchors: list[list[int]], b: int, kind: LayerKind
                  ) -> torch.Tensor:
    """The rule, one (query, key) pair at a time."""
    length, q_len = max(seq_lens), max(len(a) for a in anchors) * b
    mask = torch.zeros(len(seq_lens), q_len, length + q_len, dtype=torch.bool)
    for s, seq_anchors in enumerate(anchors):
        for r in range(q_len):
            if r >= len(seq_anchors) * b:
                mask[s, r, length + r] = True  # padding query: its own key only
                continue
            j, i = divmod(r, b)
            q_pos = seq_anchors[j] + i
            keys = [(c, c) for c in range(seq_anchors[j])]                       # context
            keys += [(length + j * b + k, seq_anchors[j] + k) for k in range(b)]  # own block
            for col, k_pos in keys:
                if kind.causal and k_pos > q_pos:
                    continue
                if kind.window is not None and abs(q_pos - k_pos) >= kind.window:
                    continue
                mask[s, r, col] = True
    return mask


@pytest.mark.parametrize("kind", KINDS)
def test_anchor_block_mask(kind: LayerKind) -> None:
    seq_lens, anchors, b = [6, 9], [[2, 4], [1, 5, 7]], 3
    mask = anchor_block_mask(seq_lens, anchors, b, kind)
    assert torch.equal(mask, expected_mask(seq_lens, anchors, b, kind))
    length = max(seq_lens)
    for s, seq_anchors in enumerate(anchors):
        for j, a in enumerate(seq_anchors):
            rows = mask[s, j * b : (j + 1) * b]
            assert not rows[:, a:length].any()                        # no context >= the anchor
            others = torch.ones(rows.shape[1] - length, dtype=torch.bool)
            others[j * b : (j + 1) * b] = False
            assert not rows[:, length:][:, others].any()              # no other block
            if not kind.causal and kind.window is None:
                assert rows[:, :a].all() and rows[:, length + j * b : length + (j + 1) * b].all()


class ServingAttention:
    """One block over its cached context, as the engine drafts (reference draft_attention)."""

    def __init__(self, model: DFlashDraftModel, kv: list, ctx_len: int) -> None:
        self.model, self.kv, self.lens = model, kv, torch.tensor([ctx_len])

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        causal, window = self.model.layer_kind(layer)
        k_ctx, v_ctx = self.kv[layer]
        out = torch_ops.draft_attention(q[None], k_ctx[None], v_ctx[None], self.lens, k[None],
                                        v[None], self.model.attention_scale, causal, window)
        return out[0]


def serving_logits(target: CausalLM, model: DFlashDraftModel, tokens: torch.Tensor, anchor: int
                   ) -> torch.Tensor:
    """Draft logits [B, V] for a block anchored at `anchor`, the target having seen only the
    tokens before it."""
    context = tokens[:anchor]
    positions = torch.arange(anchor)
    captured = target(context, positions, DenseCausal([anchor], target.attention_scale),
                      model.config.target_layer_ids).captured
    ctx = model.context_features(captured)
    kv = [model.context_kv(i, ctx, positions) for i in range(len(model.layers))]
    ids = model.block_input_ids(tokens[anchor : anchor + 1])[0]
    hidden = model(model.embed_block(target, ids), anchor + torch.arange(len(ids)),
                   ServingAttention(model, kv, anchor))
    return model.logits(target, hidden)


@pytest.mark.parametrize("case", ["fresh", "sliding"])
def test_training_forward_equals_serving(target: CausalLM, tmp_path: Path, case: str) -> None:
    if case == "fresh":
        model = init_drafter(target.config, block_size=4, num_layers=2, seed=3).double()
    else:
        path = make_dflash_checkpoint(tmp_path / "d", target.config, block_size=5,
                                      target_layer_ids=[0, 2], sliding_window=3,
                                      layer_types=["sliding_attention", "full_attention"])
        model = load_drafter(path, target)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 128, (n,), generator=g) for n in (13, 9)]
    examples = [Example(s.tolist(), [0] * 3 + [1] * (len(s) - 3)) for s in seqs]
    anchors = [[3, 7, 11], [4, 5, 7]]  # blocks running past the end included
    b = model.config.block_size
    batch = build_batch(examples, anchors, b, model.config.mask_token_id)
    logits = model.logits(target, draft_hidden(target, model, batch))
    blocks = [(s, a) for s, seq_anchors in enumerate(anchors) for a in seq_anchors]
    for m, (s, a) in enumerate(blocks):
        torch.testing.assert_close(logits[m], serving_logits(target, model, seqs[s], a),
                                   atol=1e-10, rtol=1e-10)
        inside = min(b, len(seqs[s]) - a)
        assert batch.labels[m, : inside - 1].tolist() == seqs[s][a + 1 : a + inside].tolist()
        assert batch.label_mask[m].tolist() == [k < inside for k in range(1, b)]


def test_save_then_load_round_trips(target: CausalLM, tmp_path: Path) -> None:
    model = init_drafter(target.config, block_size=6, num_layers=2, target_layer_ids=[1, 3],
                         mask_token_id=7, seed=1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    path = save_drafter(model, tmp_path / "d")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert (cfg["block_size"], cfg["num_target_layers"]) == (6, 4)
    assert cfg["dflash_config"] == {"mask_token_id": 7, "target_layer_ids": [1, 3]}
    stored = load_file(path / "model.safetensors")
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{name}" for i in range(2) for name in (
            "input_layernorm.weight", "post_attention_layernorm.weight",
            "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight",
            "mlp.up_proj.weight", "mlp.down_proj.weight",
            *(f"self_attn.{p}_proj.{w}" for p in "qkvo" for w in ("weight", "bias")))
    }
    assert set(stored) == expected
    loaded32 = load_drafter(path, target, dtype=torch.float32)
    assert loaded32.config == model.config
    for key, value in model.state_dict().items():
        assert torch.equal(loaded32.state_dict()[key], value), key
    examples = [Example(list(range(10, 30)), [0] * 5 + [1] * 15)]
    batch = build_batch(examples, [[5, 9, 16]], 6, 7)
    with torch.no_grad():  # float64 like the target: the same weights give the same logits
        assert torch.equal(draft_hidden(target, load_drafter(path, target), batch),
                           draft_hidden(target, model.double(), batch))


def test_config_json_round_trips_every_field() -> None:
    config = DFlashConfig(
        block_size=8, mask_token_id=3, target_layer_ids=(0, 5), num_target_layers=6,
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
        attention_bias=True, max_position_embeddings=2048,
        rope=RopeConfig(theta=5e5, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                        high_freq_factor=4.0, original_max_position_embeddings=1024),
        layer_types=("sliding_attention", "full_attention"), sliding_window=64, is_causal=False,
        input_embedding_scale=2.0, final_logit_softcapping=30.0,
    )
    cfg = json.loads(json.dumps(drafter_config_json(config, torch.bfloat16)))
    assert DFlashConfig.from_hf(cfg) == config
    v2 = replace(config, v2=DFlash2Extras(conv_kernel_size=4, conv_group_size=8,
                                          selector_rank=16, selector_top_k=6))
    cfg = json.loads(json.dumps(drafter_config_json(v2, torch.bfloat16)))
    assert cfg["architectures"] == ["DFlash2DraftModel"] and DFlashConfig.from_hf(cfg) == v2


def test_loss_weights_follow_the_recipe() -> None:
    assert [default_gamma(b) for b in (8, 10, 16)] == [4.0, 5.0, 7.0]
    assert 5.0 < default_gamma(12) < 7.0 and default_gamma(2) >= 1.0
    w = position_weights(16)
    assert w.shape == (15,) and w[0] == 1.0
    torch.testing.assert_close(w[7], torch.exp(torch.tensor(-1.0)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[CausalLM, list[Example]]:
    """A vocab-32 target and its own greedy continuations of random prompts."""
    path = tmp_path_factory.mktemp("tiny")
    save_hf_model(make_hf_model("qwen3", vocab_size=32, bos_token_id=None, eos_token_id=None),
                  path)
    model = load_model(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 32, (24, 6), generator=g).tolist()
    return model, regenerate(model, prompts, max_new_tokens=20)


def test_regenerate_marks_the_targets_greedy_response(tiny: tuple[CausalLM, list[Example]]
                                                      ) -> None:
    model, examples = tiny
    ids, mask = examples[0]
    assert mask == [0] * 6 + [1] * 20
    logits = model.logits(model(torch.tensor(ids), torch.arange(len(ids)),
                                DenseCausal([len(ids)], model.attention_scale)).hidden)
    assert logits[5:-1].argmax(-1).tolist() == ids[6:]


def test_sampled_regeneration_is_seeded_per_prompt(tiny: tuple[CausalLM, list[Example]]
                                                  ) -> None:
    model, greedy = tiny
    prompts = prompts_of(greedy)
    runs = [regenerate(model, prompts, 20, temperature=1.0, seed=s) for s in (5, 5, 6)]
    assert runs[0] == runs[1]                                # reproducible
    assert runs[0] != runs[2] and runs[0] != greedy          # the seed and the sampling matter
    assert prompts_of(runs[0]) == prompts
    assert all(e.loss_mask == [0] * 6 + [1] * 20 for e in runs[0])
    # prompt i is seeded by seed + i: shifting the prompts by one shifts the seeds with them
    shifted = regenerate(model, prompts[1:], 20, temperature=1.0, seed=6)
    assert shifted == runs[0][1:]


def test_training_learns_the_targets_outputs(tiny: tuple[CausalLM, list[Example]]) -> None:
    model, examples = tiny
    labels = Counter(t for e in examples for t, r in zip(e.input_ids, e.loss_mask) if r)
    freqs = torch.tensor(list(labels.values()), dtype=torch.float64) / labels.total()
    unigram = float(-(freqs * freqs.log()).sum())  # the best loss without using the context
    drafter = init_drafter(model.config, block_size=4, num_layers=1, seed=0)
    before = evaluate(model, drafter, examples)
    config = TrainConfig(steps=80, batch_size=8, lr=3e-3, warmup=0.1, log_every=40)
    logs: list[TrainLog] = []
    last = train(model, drafter, examples, config, logs.append)
    after = evaluate(model, drafter, examples)
    assert [r.step for r in logs] == [40, 80] and last == logs[-1]
    assert logs[1].scores.loss < logs[0].scores.loss
    assert after.loss < min(0.8 * before.loss, unigram - 0.2), (before, after, unigram)
    assert after.accuracy[0] > before.accuracy[0] + 0.4 and after.tau > before.tau + 0.5


def test_decode_walk_steps_past_the_accepted_tokens() -> None:
    # response at positions 2..9; blocks at 2 accept 3 (commit 4), at 6 accept 0, at 7 accept 5
    mask = [0, 0] + [1] * 8
    leading = {a: 0 for a in range(2, 9)} | {2: 3, 6: 0, 7: 5}
    assert decode_walk(mask, leading) == (7, 3)   # 4 + 1 + 2 (the response ends at 9)


def test_decode_tau_is_the_engines_acceptance_length(tiny: tuple[CausalLM, list[Example]]
                                                     ) -> None:
    """Held-out scoring replays what serving does: the engine's greedy speculative decode of
    the same prompts commits the same tokens per verify step."""
    model, examples = tiny
    drafter = init_drafter(model.config, block_size=4, num_layers=1, seed=0)
    train(model, drafter, examples, TrainConfig(steps=30, batch_size=8, lr=3e-3, warmup=0.1))
    scores = evaluate(model, drafter, examples)
    engine = Engine(model, drafter=drafter, speculation="always")  # full blocks, as scored
    prompts = prompts_of(examples)
    done = engine.generate(prompts, SamplingParams(max_new_tokens=20))
    assert [p + c.output_ids for p, c in zip(prompts, done)] == [e.input_ids for e in examples]
    lengths = [n for c in done for n in c.counters.acceptance_lengths]
    assert scores.decode_tau == pytest.approx(sum(lengths) / len(lengths))
    assert 1.2 < scores.decode_tau < scores.tau  # learned something; the anchor mean is higher


def test_training_is_seeded(tiny: tuple[CausalLM, list[Example]]) -> None:
    model, examples = tiny
    config = TrainConfig(steps=2, batch_size=4, max_anchors=5, seed=7)
    runs = []
    for _ in range(2):
        drafter = init_drafter(model.config, block_size=4, seed=7)
        train(model, drafter, examples, config)
        runs.append(drafter.state_dict())
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(
        name, Path(__file__).parents[1] / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_trains_a_loadable_drafter(tmp_path: Path) -> None:
    tool = _tool("train_drafter")
    target_dir = save_hf_model(make_hf_model("qwen3", vocab_size=32, bos_token_id=None,
                                             eos_token_id=None), tmp_path / "target")
    common = ["--target", str(target_dir), "--response-len", "8", "--block-size", "4",
              "--steps", "2", "--batch-size", "3"]
    data = tmp_path / "data.jsonl"
    tool.main([*common, "--random-prompts", "6", "--prompt-len", "4", "--holdout", "2",
               "--save-data", str(data), "--out", str(tmp_path / "d")])
    summary = json.loads((tmp_path / "d" / "training.json").read_text())
    assert summary["last"]["step"] == 2 and "held_out" in summary
    examples = read_jsonl(data)
    assert len(examples) == 6 and all(e.loss_mask == [0] * 4 + [1] * 8 for e in examples)
    load_drafter(tmp_path / "d", load_model(target_dir))
    again = tmp_path / "again.jsonl"  # the same prompts, regenerated: the same greedy responses
    tool.main([*common, "--data", str(data), "--regenerate", "--save-data", str(again),
               "--out", str(tmp_path / "d2")])
    assert read_jsonl(again) == examples
    regen = _tool("regenerate_data")  # the same, as a data set of its own
    regen.main(["--target", str(target_dir), "--data", str(data), "--response-len", "8",
                "--out", str(tmp_path / "regen.jsonl")])
    assert read_jsonl(tmp_path / "regen.jsonl") == examples
    regen.main(["--target", str(target_dir), "--data", str(data), "--response-len", "8",
                "--temperature", "1", "--seed", "3", "--out", str(tmp_path / "sampled.jsonl")])
    sampled = read_jsonl(tmp_path / "sampled.jsonl")
    assert prompts_of(sampled) == prompts_of(examples) and sampled != examples
    # --init continues a drafter (a zero learning rate keeps it), over several data files
    tool.main([*common, "--data", str(data), str(again), "--init", str(tmp_path / "d"),
               "--lr", "1e-30", "--save-dtype", "float32", "--out", str(tmp_path / "d3")])
    first, cont = (load_file(tmp_path / d / "model.safetensors") for d in ("d", "d3"))
    assert first.keys() == cont.keys()
    assert all(torch.allclose(first[k], cont[k]) for k in first)


def test_a_dflash2_drafter_grown_from_a_dflash_one_drafts_alike_then_trains_as_it_serves(
        tiny: tuple[CausalLM, list[Example]], tmp_path: Path) -> None:
    """grow_to_v2 starts from the DFlash drafter's drafts; trained, the DFlash2 drafter's held-out
    decode tau (its teacher-forced walk over the training forward) is the engine's acceptance
    length, and it saves and loads in the published format."""
    model, examples = tiny
    v1 = init_drafter(model.config, block_size=4, num_layers=1, seed=0)
    train(model, v1, examples, TrainConfig(steps=30, batch_size=8, lr=3e-3, warmup=0.1))
    v2 = grow_to_v2(v1, DFlash2Extras(conv_kernel_size=3, conv_group_size=16, selector_rank=8,
                                      selector_top_k=4))
    prompts = prompts_of(examples)
    params = SamplingParams(max_new_tokens=20)

    def drafted(drafter: DFlashDraftModel) -> list[list[list[int]]]:
        engine = Engine(model, drafter=drafter, speculation="always")
        ids = [engine.submit(p, params, trace=True) for p in prompts]
        while engine.has_work():
            engine.step()
        return [engine.result(i).counters.drafts for i in ids]

    assert drafted(v2) == drafted(v1)
    before = evaluate(model, v2, examples)
    train(model, v2, examples, TrainConfig(steps=30, batch_size=8, lr=3e-3, warmup=0.1))
    scores = evaluate(model, v2, examples)
    assert scores.loss < before.loss
    engine = Engine(model, drafter=v2, speculation="always")
    done = engine.generate(prompts, params)
    lengths = [n for c in done for n in c.counters.acceptance_lengths]
    assert scores.decode_tau == pytest.approx(sum(lengths) / len(lengths))
    path = save_drafter(v2, tmp_path / "v2")
    assert json.loads((path / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    loaded = load_drafter(path, model)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in v2.state_dict().items())
