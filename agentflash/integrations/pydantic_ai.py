"""A native pydantic-ai model over an in-process agentflash `Runtime` (no HTTP in between).

    agent = pydantic_ai.Agent(AgentflashModel(Runtime.load()), output_type=City, tools=[...])

A thin layer over agentflash.conversation, the surface the server uses too: each request becomes
the OpenAI-shaped conversation the server takes, so pydantic-ai's agent loop gets what OpenAI
clients of the server get. Replies come back with the exact text, tool call ids and arguments
agentflash generated, so a resent history continues from the reply's exact tokens and hits the
prefix cache to its end; tool calls and JSON output are constrained by grammars; decoding is
speculative (DFlash); cancelling the run's task aborts the generation and frees its KV.

Supported: text; function and output tools, with `tool_choice` resolved as pydantic-ai does
("auto", "required", "none", one named tool; a subset of several is sent as those tools only);
native and prompted output (decoding constrained to the output schema, which prompted output
also states in the instructions); streaming; the settings temperature (default 0: greedy),
top_p, top_k, seed, max_tokens, stop_sequences, parallel_tool_calls. Usage: input, cached input
and output tokens, and the speculative drafts, draft_tokens and accepted_tokens in `details`.

Not supported: files (images, audio, video, documents), native (provider-side) tools, thinking,
and the settings listed in `unsupported_settings` (pydantic-ai warns about those that matter);
thinking and native tool parts another model left in a history are not sent. A request
agentflash refuses raises `ModelRequestRejectedError`, one past the context
`ModelContextWindowExceededError`, one to a closed runtime `ModelUnavailableError`, each with the
agentflash error as its `__cause__`.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Sequence
from contextlib import aclosing, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import anyio
from pydantic_ai.exceptions import (ModelContextWindowExceededError, ModelRequestRejectedError,
                                    ModelUnavailableError, UserError)
from pydantic_ai.messages import (CachePoint, FinishReason, ModelMessage, ModelRequest,
                                  ModelRequestPart, ModelResponse, ModelResponsePart,
                                  ModelResponseStreamEvent, SystemPromptPart, TextContent,
                                  TextPart, ToolCallPart, ToolReturnPart, UserContent,
                                  UserPromptPart)
from pydantic_ai.models import (Model, ModelRequestParameters, StreamedResponse,
                                _sendable_request_parts)
from pydantic_ai.models._tool_choice import resolve_tool_choice
from pydantic_ai.profiles import ModelProfile
from pydantic_ai.settings import ModelSettings
from pydantic_ai.tools import RunContext
from pydantic_ai.usage import RequestUsage

from agentflash.conversation import chat
from agentflash.request import (CallArguments, CallChunk, CallStart, ChatEvent, ChatReply,
                                ChatRequest, TextChunk, Turn)
from agentflash.engine.sampler import SamplingParams
from agentflash.errors import AgentClosedError, AgentflashError, ContextLengthError, EngineError
from agentflash.runtime import Runtime
from agentflash.usage import Usage

__all__ = ["AgentflashModel", "AgentflashStreamedResponse"]

SYSTEM = "agentflash"
FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length",
                                           "tool_calls": "tool_call"}


class AgentflashModel(Model):
    """A pydantic-ai `Model` answering from `runtime` (which the caller owns and closes)."""

    unsupported_settings = frozenset({
        "timeout", "max_retries", "presence_penalty", "frequency_penalty", "logit_bias",
        "extra_headers", "extra_body", "service_tier", "citations"})
    _unsupported_file_inputs = frozenset({"image", "document", "audio", "video"})

    def __init__(self, runtime: Runtime, *, model_name: str | None = None,
                 settings: ModelSettings | None = None, profile: ModelProfile | None = None,
                 ) -> None:
        """`profile` is merged over this model's (JSON schema output, inline system prompts,
        the runtime's context window)."""
        self.runtime = runtime
        self._model_name = model_name or runtime.model_name
        defaults = ModelProfile(supports_json_schema_output=True, supports_json_object_output=True,
                                supports_inline_system_prompts=True,
                                context_window=runtime.engine.max_model_len)
        super().__init__(settings=settings, profile={**defaults, **(profile or {})})

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def system(self) -> str:
        return SYSTEM

    async def request(self, messages: list[ModelMessage], model_settings: ModelSettings | None,
                      model_request_parameters: ModelRequestParameters) -> ModelResponse:
        turn, _ = self._turn(messages, model_settings, model_request_parameters)
        reply: ChatReply | None = None
        with _mapped_errors(self._model_name):
            async with aclosing(turn.events()) as events:  # cancelled: aborts, frees the KV
                async for event in events:
                    if isinstance(event, ChatReply):
                        reply = event
        assert reply is not None
        parts: list[ModelResponsePart] = [TextPart(reply.text)] if reply.text else []
        parts += [ToolCallPart(c.name, c.arguments, c.id) for c in reply.tool_calls]
        return ModelResponse(parts, usage=_request_usage(reply.usage),
                             model_name=self._model_name, provider_name=SYSTEM,
                             finish_reason=FINISH_REASONS[reply.finish_reason])

    @asynccontextmanager
    async def request_stream(self, messages: list[ModelMessage],
                             model_settings: ModelSettings | None,
                             model_request_parameters: ModelRequestParameters,
                             run_context: RunContext[Any] | None = None,
                             ) -> AsyncGenerator[StreamedResponse, None]:
        turn, params = self._turn(messages, model_settings, model_request_parameters)
        events = turn.events()
        try:
            yield AgentflashStreamedResponse(model_request_parameters=params,
                                             _model_name=self._model_name, _events=events)
        finally:
            with anyio.CancelScope(shield=True):  # closing aborts an unfinished generation
                await events.aclose()

    def _turn(self, messages: list[ModelMessage], model_settings: ModelSettings | None,
              model_request_parameters: ModelRequestParameters,
              ) -> tuple[Turn, ModelRequestParameters]:
        """The checked, rendered chat turn of a request (typed errors before anything runs)."""
        settings, params = self.prepare_request(model_settings, model_request_parameters)
        s = settings or {}
        tools = params.declared_tool_defs
        choice = resolve_tool_choice(settings, params)
        if isinstance(choice, tuple):  # a subset: one tool is named, several are sent alone
            mode, names = choice
            tools = {name: t for name, t in tools.items() if name in names}
            choice = next(iter(tools)) if mode == "required" and len(tools) == 1 else mode
        # native and prompted output (only they keep an output object): constrained to its schema
        output = params.output_object
        with _mapped_errors(self._model_name):
            request = ChatRequest(
                messages=tuple(self._messages(messages, params)),
                tools=tuple({"type": "function", "function": {
                    "name": t.name, "description": t.description or "",
                    "parameters": t.parameters_json_schema}} for t in tools.values()),
                tool_choice=choice if tools else "auto",
                parallel_tool_calls=s.get("parallel_tool_calls", True),
                output_schema=output.json_schema if output is not None else None,
                params=SamplingParams(
                    temperature=s.get("temperature", 0.0), top_p=s.get("top_p", 1.0),
                    top_k=s.get("top_k", 0), seed=s.get("seed"),
                    stop=tuple(s.get("stop_sequences", ()))),
                max_tokens=s.get("max_tokens"))
            return chat(self.runtime, request), params

    def _messages(self, messages: list[ModelMessage],
                  params: ModelRequestParameters) -> list[dict[str, Any]]:
        """The OpenAI-shaped conversation: the instructions after the leading system prompts."""
        out: list[dict[str, Any]] = []
        for message in messages:
            if isinstance(message, ModelRequest):
                out += [_request_message(part) for part in _sendable_request_parts(message.parts)]
                continue
            text = "".join(p.content for p in message.parts if isinstance(p, TextPart))
            reply: dict[str, Any] = {"role": "assistant", "content": text or None}
            calls = [p for p in message.parts if isinstance(p, ToolCallPart)]
            if calls:
                reply["tool_calls"] = [{"id": c.tool_call_id, "type": "function", "function": {
                    "name": c.tool_name, "arguments": c.args_as_dict()}} for c in calls]
            out.append(reply)
        instructions = self._get_instruction_parts(messages, params)
        if instructions:
            lead = next((i for i, m in enumerate(out) if m["role"] != "system"), len(out))
            out.insert(lead, {"role": "system",
                              "content": "\n\n".join(p.content for p in instructions)})
        return out


@dataclass
class AgentflashStreamedResponse(StreamedResponse):
    """The events of one agentflash chat turn as pydantic-ai stream events."""

    _model_name: str
    _events: AsyncGenerator[ChatEvent, None]
    _timestamp: datetime = field(default_factory=lambda: datetime.now(timezone.utc))

    async def _get_event_iterator(self) -> AsyncIterator[ModelResponseStreamEvent]:
        with _mapped_errors(self._model_name):
            async for event in self._events:
                if isinstance(event, TextChunk) and event.text:
                    for e in self._parts_manager.handle_text_delta(
                            vendor_part_id="text", content=event.text,
                            ignore_leading_whitespace=True):
                        yield e
                elif isinstance(event, CallStart):  # the call as it is written
                    for e in self._parts_manager.handle_tool_call_delta_events(
                            vendor_part_id=event.index, tool_name=event.name,
                            tool_call_id=event.id):
                        yield e
                elif isinstance(event, CallArguments):
                    for e in self._parts_manager.handle_tool_call_delta_events(
                            vendor_part_id=event.index, args=event.text):
                        yield e
                elif isinstance(event, CallChunk) and not event.streamed:
                    yield self._parts_manager.handle_tool_call_part(
                        vendor_part_id=event.index, tool_name=event.call.name,
                        args=event.call.arguments, tool_call_id=event.call.id)
                elif isinstance(event, ChatReply):
                    self._usage = _request_usage(event.usage)
                    self.finish_reason = FINISH_REASONS[event.finish_reason]

    async def close_stream(self) -> None:
        await self._events.aclose()

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def provider_name(self) -> str:
        return SYSTEM

    @property
    def provider_url(self) -> None:
        return None

    @property
    def timestamp(self) -> datetime:
        return self._timestamp


def _request_message(part: ModelRequestPart) -> dict[str, Any]:
    if isinstance(part, SystemPromptPart):
        return {"role": "system", "content": part.content}
    if isinstance(part, UserPromptPart):
        return {"role": "user", "content": _text(part.content)}
    if isinstance(part, ToolReturnPart):
        return {"role": "tool", "tool_call_id": part.tool_call_id,
                "content": part.model_response_str()}
    raise UserError(f"agentflash models cannot send a {type(part).__name__}; run requests "
                    "through an Agent, which prepares the messages")


def _text(content: str | Sequence[UserContent]) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for item in content:
        if isinstance(item, (str, TextContent)):
            texts.append(item if isinstance(item, str) else item.content)
        elif not isinstance(item, CachePoint):  # a cache hint: agentflash caches every prefix
            raise UserError(f"agentflash models take text only, not {type(item).__name__}")
    return "\n".join(texts)


def _request_usage(usage: Usage) -> RequestUsage:
    spec = usage.speculative
    return RequestUsage(
        input_tokens=usage.prompt_tokens,
        cache_read_tokens=usage.prompt_tokens_details.cached_tokens,
        output_tokens=usage.completion_tokens,
        details={"drafts": spec.drafts, "draft_tokens": spec.draft_tokens,
                 "accepted_tokens": spec.accepted_tokens})


@contextmanager
def _mapped_errors(model_name: str) -> Iterator[None]:
    """agentflash's typed errors as pydantic-ai's model errors (the original as the cause)."""
    try:
        yield
    except ContextLengthError as e:
        raise ModelContextWindowExceededError(
            model_name, str(e), provider_error_code="context_length_exceeded") from e
    except AgentClosedError as e:
        raise ModelUnavailableError(model_name, str(e)) from e
    except (AgentflashError, EngineError) as e:
        raise ModelRequestRejectedError(model_name, f"{type(e).__name__}: {e}") from e
