"""Incremental parsing of tool calls out of streamed model text.

A reply arrives as text chunks of any size: speculative decoding commits several tokens at once,
so a tag can be split across chunks, and one chunk can end one call and start the next.
`ToolCallParser` turns that stream into events: visible text (`TextDelta`), tool calls
(`ParsedToolCall`) and text in a tool-call position that is not a valid call (`MalformedToolCall`).
Each call event carries its `markup`, the text the model wrote for it, tags included, so that a
caller that does not take it as a call can return it as text (agentflash.reply_parser).
With `stream_calls`, a hermes call being written as `{"name": ..., "arguments": {...}` (the form
the constrained grammar writes) also streams: `CallOpened` once its name is known, then its
arguments' JSON text as the model writes it in `ArgumentsDelta`s, before the call itself. The
events do not depend on where the chunks were cut, except that visible text and arguments may
come split over a different number of deltas.

Formats are chosen by name from the `FORMATS` registry:
- "hermes" (Qwen2.5/Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number per message, with visible text around and between them.
- "llama3_json" (Llama 3.1/3.2 custom tools): a message that starts (after whitespace) with
  `<|python_tag|>` or `{` is one or more `{"name": ..., "parameters": {...}}` objects separated by
  `;` or newlines; any other message is plain text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Literal, Protocol

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
LLAMA3_HEADER = "<|start_header_id|>"


@dataclass(frozen=True)
class TextDelta:
    """Visible (non-tool-call) text."""

    text: str


@dataclass(frozen=True)
class ParsedToolCall:
    """A valid tool call; `raw` is its JSON text as the model wrote it, whitespace stripped;
    `markup` all the text the model wrote for it."""

    name: str
    arguments: dict[str, Any]
    raw: str
    markup: str = field(default="", compare=False)

    @property
    def arguments_text(self) -> str:
        """The arguments as JSON text: as the model wrote them where it wrote an object after
        the name (what `ArgumentsDelta`s streamed), else `arguments` encoded."""
        head = _CALL_HEAD.match(self.raw)
        if head is not None and self.raw.startswith("{", head.end()):
            scanner = _ObjectScanner()
            end = head.end() + scanner.scan(self.raw[head.end():])
            if scanner.done:
                return self.raw[head.end():end]
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass(frozen=True)
class MalformedToolCall:
    """Text in a tool-call position that is not a valid call, and a short reason why;
    `markup` all the text the model wrote for it."""

    raw: str
    reason: str
    markup: str = field(default="", compare=False)


@dataclass(frozen=True)
class CallOpened:
    """A call being written has this name; its `ArgumentsDelta`s follow."""

    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    """The next piece of the JSON text of the arguments of the call last opened."""

    text: str


Event = TextDelta | ParsedToolCall | MalformedToolCall | CallOpened | ArgumentsDelta

# A hermes call's opening up to its arguments' value, as the grammar writes it.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*'
                        r'"(?:arguments|parameters)"\s*:\s*')


class _ObjectScanner:
    """Finds where a JSON object or array ends in text that arrives in pieces (the first piece
    starting with it): brackets counted outside strings, escapes skipped."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.done = False

    def scan(self, text: str) -> int:
        """How many characters of `text` (the continuation) belong to the value."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)

_INVALID = object()  # stands for "not valid JSON" in the decoding helpers
_SEPARATORS = re.compile(r"[\s;]*")


def _decode(text: str, pos: int = 0) -> tuple[Any, int]:
    """The JSON value starting exactly at `pos` and the index after it, or (_INVALID, pos)."""
    try:
        return json.JSONDecoder().raw_decode(text, pos)
    except json.JSONDecodeError:
        return _INVALID, pos


def _loads(text: str) -> Any:
    """The one JSON value that is all of `text` (surrounding whitespace aside), or _INVALID."""
    text = text.strip()
    value, end = _decode(text)
    return value if end == len(text) else _INVALID


def _to_call(value: Any, raw: str, markup: str) -> ParsedToolCall | MalformedToolCall:
    """Validates a decoded value as {"name": str, "arguments" | "parameters": object}.

    Arguments may also be a JSON-encoded string of an object; missing arguments mean {}.
    """
    if not isinstance(value, dict):
        return MalformedToolCall(raw, "not a JSON object", markup)
    name = value.get("name")
    if not isinstance(name, str):
        return MalformedToolCall(raw, 'missing string "name"', markup)
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = _loads(arguments)
    if not isinstance(arguments, dict):
        return MalformedToolCall(raw, "arguments are not a JSON object", markup)
    return ParsedToolCall(name, arguments, raw, markup)


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolCallFormat(Protocol):
    """One message's worth of parsing state for one tool-call syntax."""

    def feed(self, chunk: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


def _hermes_call(body: str, markup: str) -> ParsedToolCall | MalformedToolCall:
    """The call written between `<tool_call>` and `</tool_call>` (`markup`: with its tags)."""
    raw = body.strip()
    value = _loads(raw)
    if value is _INVALID:
        return MalformedToolCall(raw, "invalid JSON", markup)
    return _to_call(value, raw, markup)


class HermesFormat:
    """`<tool_call>` JSON `</tool_call>` spans inside visible text.

    Visible text is emitted as soon as it cannot be the start of `<tool_call>`; a call's name
    and arguments as they are written (when the name comes first and the arguments are an
    object), and the call itself when its `</tool_call>` arrives.
    """

    def __init__(self, stream_calls: bool = False) -> None:
        # Outside a call: a held-back suffix that may begin `<tool_call>`.
        # Inside a call: everything after `<tool_call>` so far.
        self._buf = ""
        self._in_call = False
        self._stream_calls = stream_calls
        self._args_at: int | None = None   # where the streamed arguments start in _buf
        self._sent = 0                     # characters of them streamed
        self._scanner = _ObjectScanner()

    def feed(self, chunk: str) -> list[Event]:
        self._buf += chunk
        events: list[Event] = []
        while True:
            if self._in_call:
                end = self._buf.find(CLOSE)
                events += self._stream(len(self._buf) if end < 0 else end)
                if end < 0:
                    return events
                events.append(_hermes_call(self._buf[:end], OPEN + self._buf[:end] + CLOSE))
                self._buf = self._buf[end + len(CLOSE) :]
                self._in_call = False
            else:
                start = self._buf.find(OPEN)
                if start < 0:
                    cut = len(self._buf) - _partial_tag_len(self._buf, OPEN)
                    if cut:
                        events.append(TextDelta(self._buf[:cut]))
                    self._buf = self._buf[cut:]
                    return events
                if start:
                    events.append(TextDelta(self._buf[:start]))
                self._buf = self._buf[start + len(OPEN) :]
                self._in_call = True
                self._args_at, self._sent, self._scanner = None, 0, _ObjectScanner()

    def _stream(self, limit: int) -> list[Event]:
        """The call's opening and the new part of its arguments within _buf[:limit]."""
        events: list[Event] = []
        if not self._stream_calls:
            return events
        if self._args_at is None:
            head = _CALL_HEAD.match(self._buf, 0, limit)
            if head is None or head.end() == limit or self._buf[head.end()] != "{":
                return events  # not (yet) a name followed by an object
            self._args_at = head.end()
            events.append(CallOpened(json.loads(head.group(1))))
        if not self._scanner.done:
            new = self._buf[self._args_at + self._sent : limit]
            taken = self._scanner.scan(new)
            if taken:
                events.append(ArgumentsDelta(new[:taken]))
                self._sent += taken
        return events

    def finish(self) -> list[Event]:
        if not self._in_call:
            return [TextDelta(self._buf)] if self._buf else []
        # Unterminated call: drop a partial `</tool_call>` and parse what is there.
        body = self._buf[: len(self._buf) - _partial_tag_len(self._buf, CLOSE)]
        events = self._stream(len(body))
        call = _hermes_call(body, OPEN + self._buf)
        if isinstance(call, MalformedToolCall):
            call = replace(call, reason=f"unterminated tool call ({call.reason})")
        return events + [call]


class Llama3JsonFormat:
    """A message that is either plain text or JSON tool calls, decided by how it starts.

    Plain text streams out at once (only leading whitespace, or a prefix of `<|python_tag|>` after
    it, is held back until the message's kind is clear). A message of calls is buffered whole and
    parsed at finish(): Llama 3 puts all of a turn's calls in one message that ends the turn.
    """

    def __init__(self, stream_calls: bool = False) -> None:
        # calls are parsed at the end of the message: nothing of them streams
        self._buf = ""
        self._kind: Literal["text", "calls"] | None = None  # None until the first chars decide

    def feed(self, chunk: str) -> list[Event]:
        if self._kind == "text":
            return [TextDelta(chunk)] if chunk else []
        self._buf += chunk
        if self._kind is None:
            self._kind = _llama3_kind(self._buf)
            if self._kind == "text":
                text, self._buf = self._buf, ""
                return [TextDelta(text)]
        return []

    def finish(self) -> list[Event]:
        if self._kind == "calls":
            return _llama3_calls(self._buf)
        return [TextDelta(self._buf)] if self._buf else []


def _llama3_kind(message: str) -> Literal["text", "calls"] | None:
    """What a message starting with `message` is, or None while that is still open."""
    head = message.lstrip()
    if head.startswith(("{", PYTHON_TAG)):
        return "calls"
    if not head or PYTHON_TAG.startswith(head):
        return None
    return "text"


def _llama3_calls(message: str) -> list[Event]:
    """One event per JSON object of a calls message, or one MalformedToolCall for all of it.
    The calls' markups together are the message: the first holds what precedes it (the python
    tag), each one the separators after it."""
    body = message.lstrip().removeprefix(PYTHON_TAG).strip()
    found: list[tuple[Any, str, int]] = []  # (value, its JSON text, where it starts in body)
    pos = _SEPARATORS.match(body).end()
    while pos < len(body):
        value, end = _decode(body, pos)
        if value is _INVALID:
            return [MalformedToolCall(body, "not JSON tool calls separated by ';' or newlines",
                                      message)]
        found.append((value, body[pos:end], pos))
        pos = _SEPARATORS.match(body, end).end()
    if not found:
        return [MalformedToolCall(body, "no tool call", message)]
    offset = message.index(body)
    bounds = [0] + [offset + start for _, _, start in found[1:]] + [len(message)]
    return [_to_call(value, raw, message[bounds[i]:bounds[i + 1]])
            for i, (value, raw, _) in enumerate(found)]


def render_call(fmt: str, name: str, arguments_text: str) -> str:
    """A call as the format `fmt` writes it (for a call known only by its parts)."""
    head = json.dumps(name, ensure_ascii=False)
    if fmt == "llama3_json":
        return f'{{"name": {head}, "parameters": {arguments_text}}}'
    return f'{OPEN}\n{{"name": {head}, "arguments": {arguments_text}}}\n{CLOSE}'


FORMATS: dict[str, Callable[[bool], ToolCallFormat]] = {  # (stream_calls) -> format
    "hermes": HermesFormat,
    "llama3_json": Llama3JsonFormat,
}


def detect_format(chat_template: str | None) -> str:
    """The FORMATS key for the tool-call syntax a chat template teaches; "hermes" by default."""
    template = chat_template or ""
    if OPEN in template:
        return "hermes"
    if PYTHON_TAG in template or LLAMA3_HEADER in template:
        return "llama3_json"
    return "hermes"


class ToolCallParser:
    """Turns one streamed message into events, in the syntax named by a key of FORMATS.

    Feed chunks as they arrive, then call finish() once at the end of the message.
    stream_calls: also `CallOpened` and `ArgumentsDelta` events where the format streams them.
    """

    def __init__(self, fmt: str, stream_calls: bool = False) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool-call format {fmt!r}; known: {sorted(FORMATS)}")
        self._format = FORMATS[fmt](stream_calls)
        self._text: list[str] = []
        self._calls: list[ParsedToolCall] = []
        self._finished = False

    def feed(self, chunk: str) -> list[Event]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        return self._record(self._format.feed(chunk))

    def finish(self) -> list[Event]:
        """Flushes held-back text and any buffered or unterminated call."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        return self._record(self._format.finish())

    @property
    def text(self) -> str:
        """All visible text so far."""
        return "".join(self._text)

    @property
    def calls(self) -> list[ParsedToolCall]:
        """The valid tool calls so far."""
        return list(self._calls)

    def _record(self, events: list[Event]) -> list[Event]:
        for event in events:
            if isinstance(event, TextDelta):
                self._text.append(event.text)
            elif isinstance(event, ParsedToolCall):
                self._calls.append(event)
        return events
