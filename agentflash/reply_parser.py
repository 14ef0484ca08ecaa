"""What of a model's reply is text and what is a tool call: one rule for every front end (the
local chat turn and the remote one, and through them the server, the Agent and the framework
adapters), streamed or not.

- Where calls are not allowed (no tools, tool_choice "none"), the reply's text is the content,
  call markup included: nothing is parsed out.
- Where they are allowed, calls are parsed out of the text in the model's call format
  (agentflash.toolcall_parser). A call that does not parse, is cut off (max_tokens), or is one
  more than the request allows (parallel_tool_calls false) stays in the content as the model
  wrote it, and is reported in `malformed`: no text is ever dropped.
- The content is stripped of leading and trailing whitespace, streamed or not: text streams as
  soon as it can no longer be the start of a call or the end of the content, so that the
  streamed text is the returned content exactly.
- A call streams as it is written (`CallStart`, then `CallArguments`) where the caller asks
  (`stream_calls`: where a grammar guarantees that the call parses). Such a call can still be
  cut off by max_tokens: its markup then goes to the content at the end, after its partial
  arguments streamed (with finish_reason "length", as OpenAI streams a cut call).
"""

from __future__ import annotations

import json
import uuid
from typing import Callable

from .request import CallArguments, CallChunk, CallStart, ChatEvent, TextChunk
from .step import ToolCall
from .toolcall_parser import (ArgumentsDelta, CallOpened, Event, MalformedToolCall,
                              ParsedToolCall, TextDelta, ToolCallParser)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ReplyParser:
    """Feed a reply's text as it arrives (`feed`), then `finish()`; each returns the events to
    pass on. `text`, `calls` and `malformed` hold the whole reply afterwards."""

    def __init__(self, call_format: str, calls_allowed: bool, parallel: bool = True,
                 stream_calls: bool = False, new_id: Callable[[], str] = new_call_id) -> None:
        self._parser = (ToolCallParser(call_format, stream_calls=stream_calls)
                        if calls_allowed else None)
        self._parallel = parallel
        self._new_id = new_id
        self.calls: list[ToolCall] = []
        self.malformed: list[MalformedToolCall] = []
        self._parts: list[str] = []      # the content so far, as streamed
        self._space = ""                 # whitespace held back: it may end the content
        self._opened: CallStart | None = None

    @property
    def text(self) -> str:
        """The content: the reply's text without its calls, stripped."""
        return "".join(self._parts)

    def feed(self, text: str) -> list[ChatEvent]:
        if self._parser is None:
            return self._text(text)
        return self._events(self._parser.feed(text))

    def finish(self) -> list[ChatEvent]:
        """The events the end of the reply releases (held-back text, a cut call)."""
        return [] if self._parser is None else self._events(self._parser.finish())

    def server_call(self, call_id: str, name: str, arguments_text: str,
                    markup: str) -> list[ChatEvent]:
        """A call a server parsed out of the reply itself (its `tool_calls`), by the same rule:
        `markup`, the call as the model's format writes it, is the content's when the call
        does not parse or is one too many."""
        try:
            arguments = json.loads(arguments_text or "{}")
        except ValueError:
            arguments = None
        if isinstance(arguments, dict) and self._parser is not None and self._room():
            self.calls.append(ToolCall(call_id or self._new_id(), name, arguments,
                                       arguments_text or None))
            return [CallChunk(len(self.calls) - 1, self.calls[-1])]
        reason = ("arguments are not a JSON object" if not isinstance(arguments, dict)
                  else "calls are not allowed" if self._parser is None
                  else "a second call where parallel_tool_calls is false")
        self.malformed.append(MalformedToolCall(arguments_text, f"{name}: {reason}", markup))
        return self._text(markup)

    def _events(self, parsed: list[Event]) -> list[ChatEvent]:
        out: list[ChatEvent] = []
        for event in parsed:
            if isinstance(event, TextDelta):
                out += self._text(event.text)
            elif isinstance(event, CallOpened) and self._room():
                self._opened = CallStart(len(self.calls), self._new_id(), event.name)
                out.append(self._opened)
            elif isinstance(event, ArgumentsDelta) and self._opened is not None:
                out.append(CallArguments(self._opened.index, event.text))
            elif isinstance(event, ParsedToolCall) and self._room():
                opened, self._opened = self._opened, None
                self.calls.append(ToolCall(opened.id if opened else self._new_id(), event.name,
                                           event.arguments, event.arguments_text))
                out.append(CallChunk(len(self.calls) - 1, self.calls[-1], opened is not None))
            elif isinstance(event, (ParsedToolCall, MalformedToolCall)):
                self._opened = None
                if isinstance(event, ParsedToolCall):  # one more than the request allows
                    event = MalformedToolCall(event.raw, "a second call where "
                                              "parallel_tool_calls is false", event.markup)
                self.malformed.append(event)
                out += self._text(event.markup)
        return out

    def _room(self) -> bool:
        return self._parallel or not self.calls

    def _text(self, text: str) -> list[ChatEvent]:
        """`text` as content, whitespace at its start dropped and at its end held back."""
        if not self._parts:
            text = text.lstrip()
        body = text.rstrip()
        if not body:
            self._space += text
            return []
        chunk, self._space = self._space + body, text[len(body):]
        self._parts.append(chunk)
        return [TextChunk(chunk)]
