"""Token-faithful chat histories for clients that resend the whole conversation every turn.

OpenAI-style clients (and the agent frameworks built on them) keep a conversation as messages
and send all of it with every request. Re-tokenizing an earlier assistant reply from its text can
give other tokens than the ones the model generated (a different merge, a re-serialized tool
call), and the prefix cache then misses from that reply on. `ReplyMemory` remembers, for every
reply this process produced, the exact token list the model saw up to the end of that reply. A
resent history whose messages up to an assistant message match one remembered (compared in a
canonical form: content text, tool call names and arguments as JSON values, tools) continues
from those tokens, so the prompt matches the cache to the end of the last reply; only the
messages after it are rendered (agentflash.chat.ChatFormat.prompt).

One instance serves a whole runtime (the server's chat endpoint and the framework adapters
share it); it is bounded by entries and by tokens held, least recently used first out.
"""

from __future__ import annotations

import collections
import hashlib
import json
import threading
from typing import Any, Sequence

from .chat import ChatFormat


def message_text(content: Any) -> str:
    """The text of an OpenAI message content: a string, None, or a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def _arguments(value: Any) -> Any:
    """A tool call's arguments as a JSON value (clients send a JSON string or an object)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def canonical(message: dict[str, Any]) -> dict[str, Any]:
    """The parts of a message that decide how it renders, in one form whatever the client's
    serialization: role, text, tool calls (name, arguments), the tool result's call id."""
    out: dict[str, Any] = {"role": message.get("role"),
                           "content": message_text(message.get("content")).strip()}
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [
            [(c.get("function") or c).get("name"), _arguments((c.get("function") or c).get(
                "arguments"))] for c in calls]
    if message.get("role") == "tool":
        out["tool_call_id"] = message.get("tool_call_id")
    return out


def _key(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]]) -> bytes:
    text = json.dumps([[canonical(m) for m in messages], list(tools)], sort_keys=True,
                      ensure_ascii=False, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


class ReplyMemory:
    """Exact tokens of the conversations this process replied to (thread-safe, bounded)."""

    def __init__(self, chat: ChatFormat, max_entries: int = 4096,
                 max_tokens: int = 4_000_000) -> None:
        self.chat = chat
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self._entries: collections.OrderedDict[bytes, list[int]] = collections.OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def prompt(self, messages: Sequence[dict[str, Any]],
               tools: Sequence[dict[str, Any]]) -> tuple[list[int], int]:
        """Token ids of the prompt for `messages` (then the assistant's turn), and how many of
        its leading tokens come from a remembered reply (0: rendered from scratch)."""
        messages = list(messages)
        for end in range(len(messages), 0, -1):
            if messages[end - 1].get("role") != "assistant":
                continue
            session = self._get(_key(messages[:end], tools))
            if session is not None:
                return self.chat.prompt(session, end, messages, list(tools)), len(session)
        return self.chat.prompt(None, 0, messages, list(tools)), 0

    def remember(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]],
                 reply: dict[str, Any], tokens: list[int]) -> None:
        """Record that after `messages` the model replied `reply` (the assistant message as the
        client will resend it) and that the conversation's tokens through it are `tokens`
        (ending with the reply's end-of-turn token)."""
        if len(tokens) > self.max_tokens:
            return
        key = _key([*messages, reply], tools)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._tokens -= len(old)
            self._entries[key] = list(tokens)
            self._tokens += len(tokens)
            while self._entries and (len(self._entries) > self.max_entries
                                     or self._tokens > self.max_tokens):
                _, dropped = self._entries.popitem(last=False)
                self._tokens -= len(dropped)

    def _get(self, key: bytes) -> list[int] | None:
        with self._lock:
            tokens = self._entries.get(key)
            if tokens is not None:
                self._entries.move_to_end(key)
            return tokens
