"""One OpenAI-shaped chat turn on a Runtime: the surface the server and the framework adapters
share.

A `ChatRequest` holds what an OpenAI chat completion request says (messages, tools, tool_choice,
parallel_tool_calls, an output schema, sampling, stop, a prediction). `chat()` checks it and
renders its prompt token-faithfully (agentflash.history: a resent history continues from the
exact tokens of the replies this runtime produced), raising typed errors before anything runs;
the returned `ChatTurn.events()` constrains tool calls and JSON output with the same grammars as
the Agent SDK (agentflash.structured), runs one generation and streams `TextChunk`s and
`CallChunk`s, then a `ChatReply` with the assistant message, the finish reason and the usage,
and remembers the reply's tokens for the next turn. `complete()` is the raw-text counterpart.
Cancelling the iterating task aborts the generation and frees its KV.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, AsyncGenerator, AsyncIterator, Sequence

from agentflash.engine.kv.manager import Pin
from agentflash.engine.sampler import SamplingParams

from .detokenizer import Detokenizer
from .errors import ContextLengthError, RequestError, ToolDefinitionError
from .history import message_text
from .runtime import Runtime
from .step import ToolCall
from .structured import TOOL_CHOICES, OutputSpec
from .tool import Tool
from .toolcall_parser import CLOSE, ParsedToolCall, TextDelta, ToolCallParser
from .usage import Usage

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatRequest:
    """An OpenAI chat completion request, checked (`checked()` raises typed errors)."""

    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] = ()      # OpenAI function tools
    tool_choice: str = "auto"                   # "auto" | "required" | "none" | a tool's name
    parallel_tool_calls: bool = True
    output_schema: dict[str, Any] | None = None  # response_format json_schema / json_object
    params: SamplingParams = SamplingParams()
    prediction: str | None = None               # Predicted Outputs: expected output text
    max_tokens: int | None = None               # None: DEFAULT_MAX_TOKENS, capped by context
    pin: bool = False                           # keep the conversation's KV pinned after
    speculative: bool = True

    def checked(self) -> ChatRequest:
        """This request with tools in the OpenAI shape; raises RequestError, ToolSchemaError
        or ToolDefinitionError for what cannot run."""
        if not self.messages:
            raise RequestError("messages must not be empty")
        for i, m in enumerate(self.messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise RequestError(f"messages[{i}] has no valid role (one of {', '.join(ROLES)})")
        tools = tuple(Tool.from_schema(t).openai_schema() for t in self.tools)
        names = [t["function"]["name"] for t in tools]
        if len(set(names)) != len(names):
            raise ToolDefinitionError("tool names must be unique")
        if self.tool_choice not in TOOL_CHOICES:
            if self.tool_choice not in names:
                raise ToolDefinitionError(
                    f"tool_choice names the tool {self.tool_choice!r}, which is not among the "
                    f"request's tools ({', '.join(names) or 'none'})")
        elif self.tool_choice == "required" and not tools:
            raise ToolDefinitionError('tool_choice "required" needs at least one tool')
        return replace(self, tools=tools)


def tool_choice_of(choice: str | dict[str, Any] | None, has_tools: bool) -> str:
    """ChatRequest.tool_choice from OpenAI's: "auto" | "required" | "none" | {"type":
    "function", "function": {"name": ...}} | None (auto with tools, none without)."""
    if choice is None:
        return "auto" if has_tools else "none"
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise ToolDefinitionError(f'tool_choice must be "auto", "required", "none" or a '
                                      f"named function, got {choice!r}")
        return choice
    name = (choice.get("function") or {}).get("name") \
        if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(name, str):
        raise ToolDefinitionError('a named tool_choice is {"type": "function", "function": '
                                  f'{{"name": ...}}}}, got {choice!r}')
    return name


def output_schema_of(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """ChatRequest.output_schema from OpenAI's response_format: None or "text" (free text),
    "json_object" (any object) or "json_schema" (its `schema`)."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    schema = ((response_format or {}).get("json_schema") or {}).get("schema")
    if kind != "json_schema" or not isinstance(schema, dict):
        raise RequestError('response_format is {"type": "json_schema", "json_schema": {"name": '
                           '..., "schema": {...}}}, "json_object" or "text"; got '
                           f'{response_format!r}')
    return schema


@dataclass(frozen=True)
class TextChunk:
    """Visible text of the reply; the first (empty) one marks the reply's first token."""

    text: str


@dataclass(frozen=True)
class CallChunk:
    """A complete tool call, the `index`-th of the reply."""

    index: int
    call: ToolCall


@dataclass
class ChatReply:
    text: str | None                     # None when the reply is only tool calls
    tool_calls: list[ToolCall]
    finish_reason: str                   # "stop" | "length" | "tool_calls"
    usage: Usage
    message: dict[str, Any]              # the assistant message, as a client resends it
    pin: Pin | None = None               # the conversation's KV, when the request pinned it
    output_ids: list[int] = field(default_factory=list)


ChatEvent = TextChunk | CallChunk | ChatReply


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


def _budget(runtime: Runtime, prompt: list[int], max_tokens: int | None) -> int:
    """The generation budget; ContextLengthError when the prompt (and what was asked for)
    does not fit the context."""
    limit = runtime.engine.max_model_len
    room = limit - len(prompt)
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
        self.constraint = runtime.grammars.constraint(spec)   # ToolSchemaError: bad schema
        self.messages = render_messages(request.messages)
        self.prompt, self.remembered = runtime.replies.prompt(self.messages, request.tools)
        params = replace(request.params,
                         max_new_tokens=_budget(runtime, self.prompt, request.max_tokens))
        self.calls_allowed = bool(request.tools) and request.tool_choice != "none"
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
                          prediction=prediction)
        parser = ToolCallParser(rt.chat.call_format)
        detok = Detokenizer(rt.chat.decode, rt.eos_ids)
        trim = StopTrim(request.params.stop)
        output: list[int] = []
        calls: list[ToolCall] = []

        def events(text: str, final: bool = False) -> list[ChatEvent]:
            out: list[ChatEvent] = []
            parsed = parser.feed(trim.feed(text, final))
            if final:
                parsed += parser.finish()
            for event in parsed:
                if isinstance(event, TextDelta) and event.text:
                    out.append(TextChunk(event.text))
                elif isinstance(event, ParsedToolCall) and self.calls_allowed and (
                        request.parallel_tool_calls or not calls):
                    calls.append(ToolCall(f"call_{uuid.uuid4().hex[:24]}", event.name,
                                          event.arguments))
                    out.append(CallChunk(len(calls) - 1, calls[-1]))
            return out

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
        text = parser.text.strip()
        finish = "tool_calls" if calls else (
            "length" if done.finish_reason == "length" else "stop")
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {
                    "name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                for c in calls]
        ended = bool(output) and output[-1] in rt.eos_ids
        reply_ids = (output[:-1] if ended else output) + [rt.chat.eos_token_id]
        rt.replies.remember(self.messages, request.tools, render_messages([message])[0],
                            self.prompt + reply_ids)
        yield ChatReply(text or None, calls, finish, _usage(rt, done, len(self.prompt), output,
                                                            t0), message, done.pin, output)


def chat(runtime: Runtime, request: ChatRequest) -> ChatTurn:
    """Check and render `request` (raising RequestError, ToolSchemaError, ToolDefinitionError
    or ContextLengthError); iterate the turn's `events()` to run it."""
    return ChatTurn(runtime, request.checked())


@dataclass
class TextReply:
    """The end of a raw completion."""

    text: str
    finish_reason: str                   # "stop" | "length"
    usage: Usage
    output_ids: list[int] = field(default_factory=list)


async def complete(runtime: Runtime, prompt: list[int], params: SamplingParams,
                   max_tokens: int | None = None, prediction: str | None = None,
                   ) -> AsyncIterator[TextChunk | TextReply]:
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
        rt.engine.block_size, str(rt.engine.device), 0.0, time.perf_counter() - t0, rt.pricing,
        rt.plain_step_s(prompt_tokens + len(output) // 2))


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
