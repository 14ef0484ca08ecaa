"""Every way a checkpoint directory can be wrong raises a typed error that names the problem."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from agentflash.engine.errors import CheckpointError, UnsupportedModelError
from agentflash.engine.models import load_model, read_safetensors_dir

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def edit_weights(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(path / WEIGHTS)
    edit(tensors)
    save_file(tensors, path / WEIGHTS, metadata={"format": "pt"})


def edit_config(path: Path, **changes: Any) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.fixture
def ckpt(hf_checkpoint) -> Path:
    path, _ = hf_checkpoint("qwen3")
    return path


@pytest.fixture
def sharded(hf_checkpoint, tmp_path: Path) -> Path:
    _, model = hf_checkpoint("llama", name="single")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    return tmp_path / "sharded"


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="does not exist"):
        read_safetensors_dir(tmp_path / "nowhere")


def test_no_config_json(ckpt: Path) -> None:
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(ckpt)


def test_config_lacking_a_field(ckpt: Path) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["hidden_size"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_model(ckpt)


@pytest.mark.parametrize("text, message", [
    ("{not json", "cannot read"),
    ("[2, 0]", "does not hold a JSON object"),
    ('{"eos_token_id": ["end"]}', "invalid eos_token_id"),
])
def test_bad_generation_config(ckpt: Path, text: str, message: str) -> None:
    (ckpt / "generation_config.json").write_text(text)
    with pytest.raises(CheckpointError, match=message):
        load_model(ckpt)


def test_no_weight_files(ckpt: Path) -> None:
    (ckpt / WEIGHTS).unlink()
    with pytest.raises(CheckpointError, match="no weights.*model.safetensors"):
        load_model(ckpt)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors(ckpt: Path, damage: str) -> None:
    data = (ckpt / WEIGHTS).read_bytes()
    (ckpt / WEIGHTS).write_bytes(b"not a safetensors file" if damage == "garbage" else data[:-100])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_model(ckpt)


def test_index_references_missing_shard(sharded: Path) -> None:
    shard = sorted(sharded.glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"shard '{shard.name}', which is missing"):
        load_model(sharded)


def test_index_maps_tensor_to_wrong_shard(sharded: Path) -> None:
    index = json.loads((sharded / INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, s in index["weight_map"].items() if s == shards[0])
    index["weight_map"][name] = shards[1]
    (sharded / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"maps '{name}' to {shards[1]}, which lacks it"):
        load_model(sharded)


def test_unreadable_index(sharded: Path) -> None:
    (sharded / INDEX).write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match="weight_map"):
        load_model(sharded)


def test_missing_tensor(ckpt: Path) -> None:
    edit_weights(ckpt, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(CheckpointError, match=r"lacks 1 tensor.*layers\.1\.self_attn\.k_norm"):
        load_model(ckpt)


def test_missing_lm_head_when_untied(ckpt: Path) -> None:
    edit_weights(ckpt, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load_model(ckpt)


def test_unexpected_tensor(ckpt: Path) -> None:
    edit_weights(ckpt, lambda t: t.update({"model.layers.7.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"does not use: model\.layers\.7\.mlp\.extra"):
        load_model(ckpt)


def test_tied_checkpoint_may_still_hold_lm_head(hf_checkpoint) -> None:
    path, _ = hf_checkpoint("llama", tie_word_embeddings=True)
    edit_weights(path, lambda t: t.update({
        "lm_head.weight": t["model.embed_tokens.weight"].clone(),
        "model.rotary_emb.inv_freq": torch.ones(8),
    }))
    model = load_model(path)
    assert model.lm_head is None


def test_shape_mismatch_with_config(ckpt: Path) -> None:
    edit_config(ckpt, intermediate_size=96)
    message = r"mlp\.gate_proj\.weight' has shape \(128, 64\) but config.json implies \(96, 64\)"
    with pytest.raises(CheckpointError, match=message):
        load_model(ckpt)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(architectures=["MistralForCausalLM"]), "unsupported architecture"),
        (dict(use_sliding_window=True), "sliding-window"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (dict(rope_parameters=dict(rope_type="dynamic", factor=2.0)), "rope.* type 'dynamic'"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    ],
)
def test_unsupported_model(ckpt: Path, changes: dict[str, Any], message: str) -> None:
    edit_config(ckpt, **changes)
    with pytest.raises(UnsupportedModelError, match=message):
        load_model(ckpt)


def test_unsupported_dtype(ckpt: Path) -> None:
    with pytest.raises(ValueError, match="not supported"):
        load_model(ckpt, dtype=torch.int8)
