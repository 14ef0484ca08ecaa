"""One chat turn on a remote server: the streamed chat completion read back as the events a
local turn gives (`TextChunk`s, `CallChunk`s, then a `ChatReply`).

Text deltas and the server's own `tool_calls` deltas (joined by index) go through the same rule
as a local reply (agentflash.reply_parser): a call the server left in the text (a server
without a tool parser) is still a call where calls are allowed, and text where they are not; a
call that does not parse stays in the content. The usage comes from the final
usage chunk (agentflash.remote.wire.reported_usage); time to first token and decode time are
measured here. Cancelling the iterating task closes the stream, and the server aborts the
request.
"""

from __future__ import annotations

import time
from typing import Any, AsyncGenerator, Awaitable, Callable

import anyio
import httpx2 as httpx  # the openai client's HTTP library
import openai

from ..errors import RemoteError
from ..reply_parser import ReplyParser
from ..request import ChatEvent, ChatReply, ChatRequest, TextChunk, reply_message
from ..toolcall_parser import render_call
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
        parser = ReplyParser(self._call_format, request.calls_allowed,
                             request.parallel_tool_calls)
        streamed: dict[int, dict[str, str]] = {}   # the server's tool_calls, by index
        report: dict[str, Any] | None = None
        metrics: dict[str, Any] | None = None
        finish: str | None = None
        first: float | None = None

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
                        for event in parser.feed(delta.content):
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
        for event in parser.finish():
            yield event
        for index in sorted(streamed):
            call = streamed[index]
            markup = render_call(self._call_format, call["name"], call["args"] or "{}")
            for event in parser.server_call(call["id"], call["name"], call["args"], markup):
                yield event
        if report is None:
            raise RemoteError(f"{self._url} reported no usage for the request (agentflash "
                              "asks for it with stream_options.include_usage)")
        first = first if first is not None else end
        timing = Timing(queue_s=None, prefill_s=None, grammar_s=None, ttft_s=first - t0,
                        decode_s=end - first, total_s=end - t0)
        text, calls = parser.text, parser.calls
        reason = "tool_calls" if calls else ("length" if finish == "length" else "stop")
        yield ChatReply(text or None, calls, reason,
                        reported_usage(report, metrics, timing, self._pricing),
                        reply_message(text, calls), malformed=parser.malformed)
