"""Loads the tokenizer that sits beside a model's weights, if the directory has one."""

from __future__ import annotations

from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model_dir: str | Path):
    """A transformers tokenizer for `model_dir`, or None when it ships no tokenizer files."""
    path = Path(model_dir)
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
