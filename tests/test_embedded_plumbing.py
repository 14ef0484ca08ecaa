"""The embedded default model's plumbing: where it lives, the `drafter/` convention, the CLI's
default model and drafter, `--no-draft`, `--chat`, and the package-data globs."""

from __future__ import annotations

import glob
import json
import os
import tomllib
from pathlib import Path

import pytest

import agentflash
from agentflash import embedded
from agentflash.cli import _chat_prompt, main
from agentflash.embedded import (
    EMBEDDED_MODEL, embedded_model_dir, model_drafter_dir, resolve_model,
)
from agentflash.engine.errors import CheckpointError
from agentflash.engine.models.dflash import bundled_drafter_dir
from agentflash.tokenizer import load_tokenizer
from conftest import make_dflash_checkpoint

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def save_tokenizer(path: Path, vocab_size: int = 128, eos_token: str = "<|im_end|>",
                   chat_template: str | None = CHATML) -> None:
    """A word-level tokenizer covering ids 0..vocab_size-1: the ChatML specials 0..2, "user" 3,
    "assistant" 4, then "w5".."w{vocab_size-1}" (word "wN" is id N); whitespace separates."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIALS + ["user", "assistant"] + [f"w{i}" for i in range(5, vocab_size)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w5"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos_token,
                                   pad_token="<|endoftext|>", additional_special_tokens=SPECIALS[1:])
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(path)


def set_eos(model_dir: Path, eos: int | None) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["eos_token_id"] = eos
    (model_dir / "config.json").write_text(json.dumps(cfg))


def run(capsys, *args: str) -> dict:
    assert main(["generate", *args, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def fail(capsys, *args: str) -> str:
    assert main(["generate", *args]) == 2
    return capsys.readouterr().err


@pytest.fixture
def fake_embedded(tmp_path, monkeypatch):
    """Points the package's checkpoint directory at tmp_path/checkpoints; returns the embedded
    model's would-be directory (not created)."""
    monkeypatch.setattr(embedded, "CHECKPOINTS_DIR", tmp_path / "checkpoints")
    return tmp_path / "checkpoints" / EMBEDDED_MODEL


# ---- layout and resolution -------------------------------------------------------------------

def test_model_drafter_dir_needs_a_config_json(tmp_path):
    assert model_drafter_dir is bundled_drafter_dir  # one implementation, in the engine
    model = tmp_path / "m"
    model.mkdir()
    assert model_drafter_dir(model) is None
    (model / "drafter").mkdir()
    assert model_drafter_dir(model) is None
    (model / "drafter" / "config.json").write_text("{}")
    assert model_drafter_dir(str(model)) == model / "drafter"


def test_resolve_model_none_is_the_package_checkpoint(tmp_path, monkeypatch):
    package = Path(agentflash.__file__).resolve().parent
    assert EMBEDDED_MODEL == "agentflash-11m"
    assert embedded.CHECKPOINTS_DIR / EMBEDDED_MODEL == package / "checkpoints" / "agentflash-11m"
    fake = tmp_path / "checkpoints" / EMBEDDED_MODEL
    fake.mkdir(parents=True)
    (fake / "config.json").write_text("{}")
    monkeypatch.setattr(embedded, "CHECKPOINTS_DIR", tmp_path / "checkpoints")
    assert resolve_model(None) == embedded_model_dir() == fake
    assert resolve_model("some/dir") == Path("some/dir")
    assert resolve_model(Path("x")) == Path("x")


def test_missing_embedded_model_is_a_checkpoint_error(fake_embedded, capsys):
    with pytest.raises(CheckpointError, match="agentflash-11m.*not installed.*directory missing"):
        embedded_model_dir()
    with pytest.raises(CheckpointError):
        resolve_model(None)
    fake_embedded.mkdir(parents=True)  # a broken install: the directory without config.json
    with pytest.raises(CheckpointError, match="config.json missing"):
        embedded_model_dir()
    err = fail(capsys, "--prompt-ids", "1,2,3")  # no --model: the embedded one
    assert "CheckpointError" in err and "not installed" in err


def test_package_data_globs_cover_the_layout(tmp_path):
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    setuptools = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]
    assert "agentflash.checkpoints" in setuptools["packages"]
    globs = setuptools["package-data"]["agentflash.checkpoints"]
    model = tmp_path / "checkpoints" / EMBEDDED_MODEL
    files = ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
             "tokenizer_config.json", "drafter/config.json", "drafter/model.safetensors"]
    for f in files:
        (model / f).parent.mkdir(parents=True, exist_ok=True)
        (model / f).write_text("x")
    # setuptools expands each pattern with glob relative to the package and keeps files only
    found = {os.path.relpath(p, model) for g in globs
             for p in glob.glob(str(tmp_path / "checkpoints" / g)) if os.path.isfile(p)}
    assert found == set(files)


# ---- CLI: default model and drafter ------------------------------------------------------------

def test_cli_uses_the_models_own_drafter(hf_checkpoint, fake_embedded, tmp_path, capsys):
    path, hf = hf_checkpoint("qwen3", name=f"checkpoints/{EMBEDDED_MODEL}",
                             bos_token_id=None, eos_token_id=None)
    assert path == fake_embedded
    common = ["--prompt-ids", "1,2,3,4,5", "--max-new-tokens", "12"]
    plain = run(capsys, *common)  # no --model: the (patched) embedded model, no drafter yet
    assert plain["model"] == str(path) and "block_size" not in plain
    make_dflash_checkpoint(path / "drafter", hf.config, block_size=4)

    auto = run(capsys, *common, "--speculation", "always")  # every step a full block
    assert auto["drafter"] == str(path / "drafter") and auto["block_size"] == 4
    assert sum(auto["acceptance_lengths"]) == len(auto["output_ids"]) - 1
    assert len(auto["accepted_per_position"]) == 3
    assert auto["output_ids"] == plain["output_ids"]  # greedy speculation is lossless
    explicit_model = run(capsys, "--model", str(path), *common)
    assert explicit_model["drafter"] == str(path / "drafter")

    off = run(capsys, *common, "--no-draft")
    assert "acceptance_lengths" not in off and "drafter" not in off
    assert off["output_ids"] == plain["output_ids"]

    other = make_dflash_checkpoint(tmp_path / "other", hf.config, block_size=3, seed=1)
    chosen = run(capsys, *common, "--draft", str(other))  # --draft beats the bundled one
    assert chosen["drafter"] == str(other) and chosen["block_size"] == 3
    assert "acceptance_lengths" not in run(capsys, *common, "--draft", str(other), "--no-draft")


def test_a_bundled_drafter_for_another_target_is_refused(hf_checkpoint, capsys):
    path, _ = hf_checkpoint("qwen3")
    _, other = hf_checkpoint("qwen3", name="other", hidden_size=32, head_dim=8)
    make_dflash_checkpoint(path / "drafter", other.config)
    assert "DrafterMismatchError" in fail(capsys, "--model", str(path), "--prompt-ids", "1,2")
    assert run(capsys, "--model", str(path), "--prompt-ids", "1,2", "--max-new-tokens", "2",
               "--no-draft")["output_ids"]


# ---- CLI: --chat -----------------------------------------------------------------------------

@pytest.fixture
def chat_model(hf_checkpoint):
    """A tiny random model (no eos in config.json) with a ChatML word-level tokenizer."""
    path, _ = hf_checkpoint("qwen3", bos_token_id=None, eos_token_id=None)
    save_tokenizer(path)
    return path


def test_chat_renders_the_template(chat_model, capsys):
    rendered = [1, 3, 7, 9, 2, 1, 4]  # <|im_start|> user w7 w9 <|im_end|> <|im_start|> assistant
    assert _chat_prompt(load_tokenizer(chat_model), "w7 w9") == rendered
    common = ["--model", str(chat_model), "--max-new-tokens", "6"]
    chat = run(capsys, *common, "--prompt", "w7 w9", "--chat")
    assert chat["prompt_tokens"] == len(rendered)
    same = run(capsys, *common, "--prompt-ids", ",".join(map(str, rendered)))
    assert chat["output_ids"] == same["output_ids"]
    assert run(capsys, *common, "--prompt", "w7 w9")["prompt_tokens"] == 2  # no template


def _first_new(ids: list[int]) -> int:
    """The first index k >= 1 whose token does not occur before it."""
    return next(k for k in range(1, len(ids)) if ids[k] not in ids[:k])


@pytest.mark.parametrize("eos_from", ["config", "tokenizer"])
def test_chat_stops_at_the_models_eos(chat_model, capsys, eos_from):
    args = ["--model", str(chat_model), "--prompt", "w7 w9", "--chat", "--max-new-tokens", "10"]
    free = run(capsys, *args)["output_ids"]  # no eos the model emits
    k = _first_new(free)
    eos = free[k]
    if eos_from == "config":
        set_eos(chat_model, eos)  # what tools/train_target.py writes: eos = end of turn
    else:  # config.json names no (or another) eos; the tokenizer's eos ends the turn
        save_tokenizer(chat_model, eos_token=load_tokenizer(chat_model).convert_ids_to_tokens(eos))
    out = run(capsys, *args)
    assert out["output_ids"] == free[: k + 1] and out["finish_reason"] == "stop"
    tok = load_tokenizer(chat_model)
    assert out["text"] == tok.decode(free[:k])  # the end-of-turn token is not in the text


def test_chat_errors_are_clear(hf_checkpoint, chat_model, capsys):
    bare, _ = hf_checkpoint("qwen3", name="bare")
    assert "--chat needs one" in fail(capsys, "--model", str(bare), "--prompt", "hi", "--chat")
    assert "--chat needs --prompt" in fail(capsys, "--model", str(chat_model), "--prompt-ids",
                                           "1,2", "--chat")
    plain, _ = hf_checkpoint("qwen3", name="plain")
    save_tokenizer(plain, chat_template=None)
    assert "no chat template" in fail(capsys, "--model", str(plain), "--prompt", "w7", "--chat")
    assert run(capsys, "--model", str(plain), "--prompt", "w7", "--max-new-tokens", "2")["text"]
