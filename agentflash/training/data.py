"""Drafter training data: `Example(input_ids, loss_mask)` records, loss_mask 1 on the response
tokens a drafter learns to predict, and their JSONL files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple, Sequence


class Example(NamedTuple):
    input_ids: list[int]
    loss_mask: list[int]  # 1 on response tokens: the ones the drafter learns to predict


def read_jsonl(path: str | Path) -> list[Example]:
    """Examples from JSONL lines `{"input_ids": [...], "loss_mask": [0|1 ...]}` of equal length."""
    examples = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            ids, mask = [int(t) for t in obj["input_ids"]], [int(m) for m in obj["loss_mask"]]
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}:{n}: expected input_ids and loss_mask lists: {e!r}") from None
        example = Example(ids, mask)
        if len(example.input_ids) != len(example.loss_mask) or set(example.loss_mask) - {0, 1}:
            raise ValueError(f"{path}:{n}: loss_mask must be 0/1 and as long as input_ids")
        examples.append(example)
    return examples


def write_jsonl(path: str | Path, examples: Sequence[Example]) -> None:
    lines = (json.dumps({"input_ids": e.input_ids, "loss_mask": e.loss_mask}) for e in examples)
    Path(path).write_text("".join(line + "\n" for line in lines))
