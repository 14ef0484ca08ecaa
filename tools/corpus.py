"""Corpus conversations (tools/build_corpus.py) as token ids for training and evaluation.

`Tokenized.encode(conv)` renders a conversation with the tokenizer's own chat template and marks
the assistant's tokens (what follows `<|im_start|>assistant\\n`, through `<|im_end|>`): the loss
mask of `agentflash.training.data.Example`. `prompts(conv)` gives every prefix that ends where
the model must start an assistant turn, with the reference reply that followed it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, NamedTuple

from agentflash.training.data import Example


def read_conversations(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class Prompt(NamedTuple):
    ids: list[int]           # the conversation so far, ending with `<|im_start|>assistant\n`
    reply: list[int]         # the reference assistant turn, through `<|im_end|>`
    messages: list[dict]     # the messages before the reply
    tools: list[dict]


class Tokenized:
    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.assistant = self.ids("assistant\n")

    def ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def render(self, messages: list[dict], tools: list[dict], generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                            add_generation_prompt=generation_prompt)

    def encode(self, conv: dict) -> Example:
        ids = self.ids(self.render(conv["messages"], conv["tools"], False))
        mask = [0] * len(ids)
        n = len(self.assistant)
        for i, t in enumerate(ids):
            if t == self.im_start and ids[i + 1:i + 1 + n] == self.assistant:
                j = i + 1 + n
                while j < len(ids):
                    mask[j] = 1
                    if ids[j] == self.im_end:
                        break
                    j += 1
        return Example(ids, mask)

    def prompts(self, conv: dict) -> Iterator[Prompt]:
        messages = conv["messages"]
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.ids(self.render(messages[:k], conv["tools"], True))
            whole = self.ids(self.render(messages[:k + 1], conv["tools"], False))
            if whole[:len(before)] != before:
                continue  # not prefix-stable (never seen with the shipped tokenizer)
            reply = whole[len(before):]
            if self.im_end in reply:
                reply = reply[:reply.index(self.im_end) + 1]
            yield Prompt(before, reply, messages[:k], conv["tools"])
