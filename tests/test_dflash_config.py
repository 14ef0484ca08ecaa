"""DFlash drafter configs in the published format, and every typed error the loader raises."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from agentflash.engine.errors import CheckpointError, DrafterMismatchError, UnsupportedModelError
from agentflash.engine.models import CausalLM, load_model
from agentflash.engine.models.dflash import (
    DFlashConfig, DFlashDraftModel, check_compatible, default_target_layer_ids, load_drafter,
)
from conftest import make_dflash_checkpoint, make_hf_model, save_hf_model

# The shape of z-lab's Qwen3-8B-DFlash-b16 config.json (weights are not needed to parse it).
PUBLISHED: dict[str, Any] = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "attention_bias": False,
    "attention_dropout": 0.0, "block_size": 16, "bos_token_id": 151643,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "dtype": "bfloat16", "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 12288, "layer_types": ["full_attention"] * 5,
    "max_position_embeddings": 40960, "max_window_layers": 5, "num_attention_heads": 32,
    "num_hidden_layers": 5, "num_key_value_heads": 8, "num_target_layers": 36,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_default_target_layer_ids() -> None:
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(36, 1) == (18,)
    assert default_target_layer_ids(7, 1) == (3,)
    assert default_target_layer_ids(28, 3) == (1, 13, 25)
    assert default_target_layer_ids(7, 3) == (1, 2, 4)  # round(2.5) == 2: Python's rounding
    cfg = {**PUBLISHED, "dflash_config": {"mask_token_id": 7}}
    assert DFlashConfig.from_hf(cfg).target_layer_ids == (1, 9, 17, 25, 33)


def test_published_config_parses() -> None:
    c = DFlashConfig.from_hf(PUBLISHED)
    assert (c.block_size, c.mask_token_id, c.num_target_layers) == (16, 151669, 36)
    assert c.target_layer_ids == (1, 9, 17, 25, 33)
    assert (c.hidden_size, c.num_hidden_layers, c.num_key_value_heads, c.head_dim) == (
        4096, 5, 8, 128)
    assert c.rope.theta == 1e6 and c.max_position_embeddings == 40960
    assert c.layer_types == ("full_attention",) * 5 and c.sliding_window is None
    assert (c.input_embedding_scale, c.output_multiplier, c.final_logit_softcapping) == (
        1.0, 1.0, None)


def test_newer_format_and_qwen3_sliding_semantics() -> None:
    # Qwen3.5 drafters: block_size inside dflash_config, rope_parameters, no num_target_layers;
    # use_sliding_window without layer_types leaves layers below max_window_layers (28) full.
    cfg = {**PUBLISHED, "rope_parameters": {"rope_type": "default", "rope_theta": 1e7},
           "use_sliding_window": True, "sliding_window": 4096,
           "dflash_config": {"block_size": 8, "mask_token_id": 5, "target_layer_ids": [1, 7]}}
    for key in ("num_target_layers", "rope_theta", "layer_types", "max_window_layers",
                "block_size"):
        cfg.pop(key)
    c = DFlashConfig.from_hf(cfg)
    assert (c.block_size, c.num_target_layers, c.rope.theta) == (8, None, 1e7)
    assert c.layer_types == ("full_attention",) * 5 and c.sliding_window == 4096
    c = DFlashConfig.from_hf({**cfg, "max_window_layers": 3})
    assert c.layer_types == ("full_attention",) * 3 + ("sliding_attention",) * 2
    # transformers drops the window unless use_sliding_window: such layers are causal only
    c = DFlashConfig.from_hf({**PUBLISHED, "sliding_window": 64,
                              "layer_types": ["sliding_attention"] * 5})
    assert c.layer_types == ("sliding_attention",) * 5 and c.sliding_window is None
    v2 = {"mask_token_id": 3, "conv_kernel_size": 4, "conv_group_size": 64, "selector_rank": 32,
          "selector_top_k": 8}
    c = DFlashConfig.from_hf({**PUBLISHED, "architectures": ["DFlash2DraftModel"],
                              "is_causal": False, "dflash_config": v2})
    assert c.v2 is not None and (c.v2.conv_kernel_size, c.v2.conv_group_size, c.v2.selector_rank,
                                 c.v2.selector_top_k) == (4, 64, 32, 8)
    assert c.is_causal is False
    assert DFlashConfig.from_hf(PUBLISHED).v2 is None
    extras = {"mask_token_id": 1, "input_embedding_scale": 2, "final_logit_softcapping": 0.0}
    c = DFlashConfig.from_hf({**PUBLISHED, "dflash_config": extras, "output_multiplier": 0.5})
    assert (c.input_embedding_scale, c.output_multiplier, c.final_logit_softcapping) == (
        2.0, 0.5, None)


@pytest.mark.parametrize("change, error, match", [
    ({"architectures": ["DFlash2DraftModel"]}, CheckpointError,
     r"lacks dflash_config fields \['conv_kernel_size', 'conv_group_size', 'selector_rank'"),
    ({"architectures": ["DFlash2DraftModel"], "dflash_config": {
        "mask_token_id": 3, "conv_kernel_size": 4, "conv_group_size": 64, "selector_rank": 8,
        "selector_top_k": 0}}, CheckpointError, "selector_top_k"),
    ({"architectures": ["Qwen3ForCausalLM"]}, UnsupportedModelError, "not a DFlash drafter"),
    ({"dflash_config": {"target_layer_ids": [1]}}, CheckpointError, "mask_token_id"),
    ({"dflash_config": {"mask_token_id": 3}, "num_target_layers": None}, CheckpointError,
     "target_layer_ids"),
    ({"layer_types": ["chunked_attention"] * 5}, UnsupportedModelError, "chunked_attention"),
    ({"layer_types": ["full_attention"]}, CheckpointError, "1 entries for 5 layers"),
    ({"block_size": 1}, CheckpointError, "block_size"),
    ({"hidden_size": "wide"}, CheckpointError, "invalid field"),
])
def test_bad_configs(change: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        DFlashConfig.from_hf({**PUBLISHED, **change})


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> CausalLM:
    path = tmp_path_factory.mktemp("target")
    return load_model(save_hf_model(make_hf_model("qwen3", num_hidden_layers=4), path))


@pytest.mark.parametrize("kwargs, match", [
    (dict(hidden_size=32), "hidden_size 32 != the target's 64"),
    (dict(vocab_size=200), "vocab_size 200 != the target's 128"),
    (dict(num_target_layers=36), "num_target_layers 36 != the target's 4"),
    (dict(target_layer_ids=[0, 4]), r"target_layer_ids \[4\] outside"),
    (dict(mask_token_id=128), "mask_token_id 128 outside the target's vocabulary"),
])
def test_mismatched_target(target: CausalLM, tmp_path: Path, kwargs: dict[str, Any],
                           match: str) -> None:
    path = make_dflash_checkpoint(tmp_path / "d", target.config, **kwargs)
    with pytest.raises(DrafterMismatchError, match=match):
        load_drafter(path, target)
    with pytest.raises(DrafterMismatchError):
        check_compatible(DFlashConfig.from_hf(json.loads((path / "config.json").read_text())),
                         target.config)


def edit_weights(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def edit_config(path: Path, **changes: Any) -> None:
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **changes}))


BROKEN: dict[str, tuple[Callable[[Path], None], str]] = {
    "missing": (lambda p: edit_weights(p, lambda t: t.pop("layers.1.mlp.up_proj.weight")),
                r"lacks 1 tensor.*layers\.1\.mlp\.up_proj\.weight"),
    "unexpected": (lambda p: edit_weights(p, lambda t: t.update(lm_head=torch.zeros(3))),
                   "does not use: lm_head$"),
    "shape": (lambda p: edit_weights(p, lambda t: t.update(
        {"layers.0.self_attn.k_norm.weight": torch.ones(8)})), r"k_norm.weight.*shape \(8,\)"),
    "fc-width": (lambda p: edit_config(p, dflash_config={"mask_token_id": 1,
                                                          "target_layer_ids": [0, 1]}),
                 r"fc\.weight.*\(64, 256\).*\(64, 128\).*2 target_layer_ids \[0, 1\]"),
    "corrupt": (lambda p: (p / "model.safetensors").write_bytes(b"\x07not safetensors"),
                "corrupt or truncated"),
    "no-weights": (lambda p: (p / "model.safetensors").unlink(), "holds no weights"),
    "no-config": (lambda p: (p / "config.json").unlink(), "no config.json"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_broken_checkpoints(target: CausalLM, tmp_path: Path, case: str) -> None:
    path = make_dflash_checkpoint(tmp_path / "d", target.config)
    assert isinstance(load_drafter(path, target), DFlashDraftModel)
    breaker, match = BROKEN[case]
    breaker(path)
    with pytest.raises(CheckpointError, match=match):
        load_drafter(path, target)


def test_fixture_accepts_any_target_config_form(dflash_checkpoint: Any, target: CausalLM) -> None:
    hf = make_hf_model("qwen3", num_hidden_layers=4)
    for i, form in enumerate([target.config, hf.config, hf.config.to_dict()]):
        model = load_drafter(dflash_checkpoint(form, name=f"d{i}"), target)
        assert model.config.target_layer_ids == (0, 1, 2, 3)
        assert model.config.num_target_layers == 4
