"""One chat turn on a runtime: the surface the Agent, the server and the framework adapters
share, whichever runtime is underneath.

`chat()` takes a `ChatRequest` (agentflash.request) and checks it, raising typed errors before
anything runs. On a remote runtime it hands the request to agentflash.remote. On the local one
it renders the prompt token-faithfully: from the request's `History` (the Agent's exact tokens),
else through agentflash.history (a resent history continues from the exact tokens of the replies
this runtime produced). The returned `ChatTurn.events()` constrains tool calls and JSON output
with the same grammars as everywhere (agentflash.structured), runs one generation and streams
`TextChunk`s, tool calls as they are written (`CallStart`, `CallArguments`) and whole
(`CallChunk`), then a `ChatReply` with the assistant message, the finish
reason, the usage and the `History` through the reply, and (for requests without a History)
remembers the reply's tokens for the next resent turn. `complete()` is the
raw-text counterpart. Cancelling the iterating task aborts the generation and frees its KV.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from typing import Any, AsyncGenerator, Sequence

from agentflash.engine.sampler import SamplingParams

from .detokenizer import Detokenizer
from .errors import ContextLengthError
from .history import message_text
from .remote import RemoteRuntime
from .request import ChatEvent, ChatReply, ChatRequest, History, TextChunk, Turn, reply_message
from .runtime import Runtime
from .structured import OutputSpec
from .reply_parser import ReplyParser
from .toolcall_parser import CLOSE
from .usage import Usage

def render_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates take them: text content, developer as system, tool-call
    arguments as JSON text."""
    out = []
    for m in messages:
        role = "system" if m["role"] == "developer" else m["role"]
        r: dict[str, Any] = {"role": role, "content": message_text(m.get("content"))}
        if role == "assistant" and m.get("tool_calls"):
            r["tool_calls"] = [_template_call(c) for c in m["tool_calls"]]
        if role == "tool":
            r["tool_call_id"] = m.get("tool_call_id")
            if m.get("name"):
                r["name"] = m["name"]
        out.append(r)
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function") or call
    args = fn.get("arguments", {})
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return {"id": call.get("id"), "type": "function",
            "function": {"name": fn.get("name"), "arguments": args}}


DEFAULT_MAX_TOKENS = 1024
"""Tokens a request may generate when it does not say (capped by what the context has left)."""


def _budget(runtime: Runtime, prompt: list[int], max_tokens: int | None,
            truncate: bool = False) -> int:
    """The generation budget; ContextLengthError when the prompt (and what was asked for,
    unless `truncate`: then at most what the context has room for) does not fit the context."""
    limit = runtime.engine.max_model_len
    room = limit - len(prompt)
    if truncate and max_tokens is not None and room >= 1:
        max_tokens = min(max_tokens, room)
    if room < 1 or (max_tokens is not None and max_tokens > room):
        asked = f" and {max_tokens} to generate" if max_tokens is not None else ""
        raise ContextLengthError(
            f"the model's context holds {limit} tokens; this request has {len(prompt)} in its "
            f"prompt{asked} (at most {max(room, 0)} can be generated after it)")
    return max_tokens if max_tokens is not None else min(DEFAULT_MAX_TOKENS, room)


class ChatTurn:
    """A checked, rendered chat request, ready to run: made by `chat()`, which raises for bad
    input before anything is submitted; iterate `events()` to generate."""

    def __init__(self, runtime: Runtime, request: ChatRequest) -> None:
        self.runtime, self.request = runtime, request
        spec = OutputSpec(request.tools, request.tool_choice, request.output_schema,
                          runtime.chat.call_format)
        self.constraint = runtime.grammars.constraint(spec) \
            if request.constrained else None                 # ToolSchemaError: bad schema
        self.messages = render_messages(request.messages)
        history = request.history
        if history is not None and history.tokens:
            self.prompt = runtime.chat.prompt(list(history.tokens), history.messages,
                                              self.messages, list(request.tools))
            self.remembered = len(history.tokens)
        elif history is not None:  # a caller that keeps its own tokens, before its first reply
            self.prompt, self.remembered = runtime.chat.prompt(
                None, 0, self.messages, list(request.tools)), 0
        else:
            self.prompt, self.remembered = runtime.replies.prompt(self.messages, request.tools)
        params = replace(request.params, max_new_tokens=_budget(
            runtime, self.prompt, request.max_tokens, request.truncate))
        self.calls_allowed = request.calls_allowed
        if self.calls_allowed and not request.parallel_tool_calls \
                and runtime.chat.call_format == "hermes":
            params = replace(params, stop=(*params.stop, CLOSE))  # one call ends the turn
        self.params = params

    async def events(self) -> AsyncGenerator[ChatEvent, None]:
        """Text and tool-call chunks as they are produced, then the `ChatReply`."""
        rt, request = self.runtime, self.request
        t0 = time.perf_counter()
        prediction = rt.chat.encode(request.prediction) if request.prediction else None
        gen = rt.generate(self.prompt, self.params, pin=request.pin,
                          speculative=request.speculative, constraint=self.constraint,
                          reuse=request.reuse, prediction=prediction)
        # calls stream as they are written where the grammar makes them parse
        parser = ReplyParser(rt.chat.call_format, self.calls_allowed,
                             request.parallel_tool_calls, stream_calls=self.constraint is not None)
        detok = Detokenizer(rt.chat.decode, rt.eos_ids)
        trim = StopTrim(request.params.stop)
        output: list[int] = []

        def events(text: str, final: bool = False) -> list[ChatEvent]:
            out = parser.feed(trim.feed(text, final))
            return out + parser.finish() if final else out

        try:
            async for update in gen:
                if not output and update.new_token_ids:
                    yield TextChunk("")  # the first token: the reply has started
                output.extend(update.new_token_ids)
                for event in events(detok.add(update.new_token_ids)):
                    yield event
            done = gen.completion
            assert done is not None
            if done.error is not None:
                raise done.error
            for event in events(detok.flush(), final=True):
                yield event
        finally:
            gen.cancel()  # no-op once finished; otherwise aborts and frees the KV
        text, calls = parser.text, parser.calls
        finish = "tool_calls" if calls else (
            "length" if done.finish_reason == "length" else "stop")
        message = reply_message(text, calls)
        ended = bool(output) and output[-1] in rt.eos_ids
        reply_ids = (output[:-1] if ended else output) + [rt.chat.eos_token_id]
        tokens = self.prompt + reply_ids
        if request.history is None:  # a client that resends messages: remember the tokens
            rt.replies.remember(self.messages, request.tools, render_messages([message])[0],
                                tokens)
        yield ChatReply(text or None, calls, finish,
                        _usage(rt, done, len(self.prompt), output, t0), message, done.pin,
                        output, History(tuple(tokens), len(request.messages) + 1),
                        parser.malformed)


def chat(runtime: Runtime | RemoteRuntime, request: ChatRequest) -> Turn:
    """Check and render `request` (raising RequestError, ToolSchemaError, ToolDefinitionError
    or ContextLengthError); iterate the turn's `events()` to run it."""
    if isinstance(runtime, RemoteRuntime):
        return runtime.turn(request.checked())
    return ChatTurn(runtime, request.checked())


def check_output(runtime: Runtime | RemoteRuntime, tools: Sequence[dict[str, Any]],
                 tool_choice: str, output_schema: dict[str, Any] | None) -> None:
    """Raise ToolSchemaError when the runtime cannot constrain output to these tools and
    schema (each compiled once and cached)."""
    if isinstance(runtime, RemoteRuntime):
        runtime.grammar(OutputSpec(tuple(tools), tool_choice, output_schema,
                                   runtime.call_format))
    else:
        runtime.grammars.constraint(OutputSpec(tuple(tools), tool_choice, output_schema,
                                               runtime.chat.call_format))


@dataclass
class TextReply:
    """The end of a raw completion."""

    text: str
    finish_reason: str                   # "stop" | "length"
    usage: Usage
    output_ids: list[int] = field(default_factory=list)


async def complete(runtime: Runtime, prompt: list[int], params: SamplingParams,
                   max_tokens: int | None = None, prediction: str | None = None,
                   ) -> AsyncGenerator[TextChunk | TextReply, None]:
    """A raw completion of `prompt` (token ids): text chunks, then a `TextReply`. Raises
    ContextLengthError before submitting when it cannot fit."""
    params = replace(params, max_new_tokens=_budget(runtime, prompt, max_tokens))
    t0 = time.perf_counter()
    gen = runtime.generate(prompt, params, prediction=(
        runtime.chat.encode(prediction) if prediction else None))
    detok = Detokenizer(runtime.chat.decode, runtime.eos_ids)
    trim = StopTrim(params.stop)
    output: list[int] = []
    parts: list[str] = []
    try:
        async for update in gen:
            output.extend(update.new_token_ids)
            text = trim.feed(detok.add(update.new_token_ids))
            if text:
                parts.append(text)
                yield TextChunk(text)
        done = gen.completion
        assert done is not None
        if done.error is not None:
            raise done.error
        text = trim.feed(detok.flush(), final=True)
        if text:
            parts.append(text)
            yield TextChunk(text)
    finally:
        gen.cancel()
    finish = "length" if done.finish_reason == "length" else "stop"
    yield TextReply("".join(parts), finish, _usage(runtime, done, len(prompt), output, t0),
                    output)


def _usage(rt: Runtime, done: Any, prompt_tokens: int, output: list[int], t0: float) -> Usage:
    return Usage.from_counters(
        done.counters, prompt_tokens, len(output), rt.target_params, rt.draft_params,
        rt.engine.block_size, str(rt.engine.device), 0.0, time.perf_counter() - t0, rt.pricing)


class StopTrim:
    """Text up to (not including) the first stop string, streamed: text that may be the start
    of a stop string is held back until it is clear."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""
        self._stopped = False

    def feed(self, text: str, final: bool = False) -> str:
        if self._stopped:
            return ""
        if not self._stops:
            return text
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._stopped, self._held = True, ""
            return buf[:min(hits)]
        keep = 0 if final else max(
            (k for s in self._stops for k in range(1, len(s)) if buf.endswith(s[:k])),
            default=0)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]
