"""Streaming detokenization: text deltas of a growing token list that never split a character."""

from __future__ import annotations

from typing import Callable


class Detokenizer:
    """Text of a growing token list, emitted as deltas that never split a character.

    Decodes only a window: the tokens of the last delta (context for byte-level merges) and the
    new ones, so a long reply costs O(new tokens) per update, not O(reply)."""

    def __init__(self, decode: Callable[[list[int]], str], skip: frozenset[int]) -> None:
        self._decode, self._skip = decode, skip
        self._ids: list[int] = []
        self._prefix = 0   # window start: the tokens before it were emitted and are settled
        self._read = 0     # tokens whose text was emitted

    def add(self, ids: list[int]) -> str:
        self._ids.extend(i for i in ids if i not in self._skip)
        return self._emit(final=False)

    def flush(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        done = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        # an incomplete UTF-8 sequence (or a re-merge of emitted bytes): wait for more tokens
        if not text.startswith(done) or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(done):]
