"""One chat turn on a remote server: the streamed chat completion read back as the events a
local turn gives (`TextChunk`s, `CallChunk`s, then a `ChatReply`).

Text deltas go through the same tool-call parser as a local reply, so a call the server left in
the text (a server without a tool parser) is still a call, and the call markup never shows as
text; the server's own `tool_calls` deltas are joined by index. The usage comes from the final
usage chunk (agentflash.remote.wire.reported_usage); time to first token and decode time are
measured here. Cancelling the iterating task closes the stream, and the server aborts the
request.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncGenerator, Awaitable, Callable

import anyio
import httpx2 as httpx  # the openai client's HTTP library
import openai

from ..errors import RemoteError
from ..request import CallChunk, ChatEvent, ChatReply, ChatRequest, TextChunk, reply_message
from ..step import ToolCall
from ..toolcall_parser import MalformedToolCall, ParsedToolCall, TextDelta, ToolCallParser
from ..usage import Pricing, Timing
from .wire import reported_usage
from .faults import raise_mapped


class RemoteTurn:
    """A checked request for a remote runtime: iterate `events()` to run it."""

    def __init__(self, request: ChatRequest, start: Callable[[], Awaitable[Any]],
                 call_format: str, url: str, pricing: Pricing | None) -> None:
        self.request = request
        self._start = start           # opens the stream (RemoteRuntime.create)
        self._call_format, self._url, self._pricing = call_format, url, pricing

    async def events(self) -> AsyncGenerator[ChatEvent, None]:
        """Text and tool-call chunks as they are produced, then the `ChatReply`."""
        request = self.request
        t0 = time.perf_counter()
        stream = await self._start()
        parser = ToolCallParser(self._call_format)
        calls: list[ToolCall] = []
        malformed: list[MalformedToolCall] = []
        streamed: dict[int, dict[str, str]] = {}   # the server's tool_calls, by index
        report: dict[str, Any] | None = None
        metrics: dict[str, Any] | None = None
        finish: str | None = None
        first: float | None = None

        def add(call: ToolCall) -> list[ChatEvent]:
            if not request.calls_allowed or (calls and not request.parallel_tool_calls):
                return []
            calls.append(call)
            return [CallChunk(len(calls) - 1, call)]

        def parsed(events: list[Any]) -> list[ChatEvent]:
            out: list[ChatEvent] = []
            for event in events:
                if isinstance(event, TextDelta) and event.text:
                    out.append(TextChunk(event.text))
                elif isinstance(event, ParsedToolCall):
                    out += add(ToolCall(_call_id(), event.name, event.arguments))
                elif isinstance(event, MalformedToolCall):
                    malformed.append(event)
            return out

        try:
            async for chunk in stream:
                if chunk.usage is not None:
                    report = chunk.usage.model_dump()
                extra = chunk.model_extra or {}
                if isinstance(extra.get("metrics"), dict):
                    metrics = extra["metrics"]
                for choice in chunk.choices:
                    if choice.index != 0:
                        continue
                    delta = choice.delta
                    if first is None:  # servers send the first chunk with the first token
                        first = time.perf_counter()
                        yield TextChunk("")  # the reply has started
                    if delta.content:
                        for event in parsed(parser.feed(delta.content)):
                            yield event
                    for part in delta.tool_calls or ():
                        call = streamed.setdefault(part.index, {"id": "", "name": "", "args": ""})
                        call["id"] = part.id or call["id"]
                        if part.function is not None:
                            call["name"] += part.function.name or ""
                            call["args"] += part.function.arguments or ""
                    if choice.finish_reason:
                        finish = choice.finish_reason
        except (openai.APIError, httpx.HTTPError) as e:
            raise_mapped(e, self._url)
        finally:
            with anyio.CancelScope(shield=True):
                await stream.close()  # on cancellation: the server sees the client leave
        end = time.perf_counter()
        for event in parsed(parser.finish()):
            yield event
        for index in sorted(streamed):
            call = streamed[index]
            try:
                arguments = json.loads(call["args"] or "{}")
                if not isinstance(arguments, dict):
                    raise ValueError("the arguments are not a JSON object")
            except ValueError as e:
                malformed.append(MalformedToolCall(call["args"], f"{call['name']}: {e}"))
                continue
            for event in add(ToolCall(call["id"] or _call_id(), call["name"], arguments,
                                      call["args"] or None)):
                yield event
        if report is None:
            raise RemoteError(f"{self._url} reported no usage for the request (agentflash "
                              "asks for it with stream_options.include_usage)")
        first = first if first is not None else end
        timing = Timing(queue_s=None, prefill_s=None, grammar_s=None, ttft_s=first - t0,
                        decode_s=end - first, total_s=end - t0)
        text = parser.text.strip()
        reason = "tool_calls" if calls else ("length" if finish == "length" else "stop")
        yield ChatReply(text or None, calls, reason,
                        reported_usage(report, metrics, timing, self._pricing),
                        reply_message(text, calls), malformed=malformed)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
