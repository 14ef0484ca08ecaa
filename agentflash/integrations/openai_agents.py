"""The OpenAI Agents SDK (`openai-agents`, package `agents`) on an in-process `Runtime`.

    agent = agents.Agent(name="a", model=AgentflashModel(runtime), tools=[...], output_type=City)
    result = await agents.Runner.run(agent, "...")

`AgentflashModel(runtime)` is an `agents.Model` for `Agent(model=...)`; `AgentflashProvider(
runtime)` is a `ModelProvider` for `RunConfig(model_provider=...)` that answers every model name
with that model. The SDK's own agent loop (`Runner.run`, `Runner.run_streamed`, tools, handoffs,
guardrails, structured output) then runs on the runtime with no HTTP in between; each model call
is one agentflash.conversation turn, the surface the server uses too.

The SDK's input items become OpenAI chat messages with its own Chat Completions converter and the
streamed reply becomes Responses-style events with its own stream handler. The reply's items
carry the call ids, arguments and text of the generated message, so a history the Runner resends
(`result.to_input_list()`, sessions) renders to the exact tokens of the earlier replies and hits
the prefix cache to the end of the last one. Tool calls (handoffs are tools too) and
`output_type` are constrained to their JSON schemas; usage reports the cached prompt tokens.
Cancelling the run's task aborts the generation and frees its KV.

Supported settings: temperature (default 0: greedy, as agentflash's other adapters), top_p,
max_tokens, tool_choice ("auto", "required", "none" or a tool's name), parallel_tool_calls, and
in extra_args `seed`, `top_k` and `stop`. Not supported: hosted tools (only `FunctionTool`s and
handoffs), MCP tool choices and non-text input (UserError); server-side conversation state
(previous_response_id, conversation_id) and prompt templates (UserError: resend the history,
the prefix cache makes that cheap); penalties, logprobs, reasoning, verbosity and the other
extra_args are ignored. A reply cut by max_tokens before any text or call raises
ModelBehaviorError, as with the SDK's own models; agentflash's typed errors (RequestError,
ToolSchemaError, ContextLengthError, ...) propagate unchanged. Tracing: one generation span per
call (input and output when the run includes data). The caller owns the runtime and closes it.
"""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import Any, AsyncGenerator, AsyncIterator, cast

from agents import (AgentOutputSchemaBase, FunctionTool, Handoff, Model, ModelBehaviorError,
                    ModelProvider, ModelResponse, ModelSettings, ModelTracing, Tool,
                    TResponseInputItem, UserError)
from agents.items import TResponseStreamEvent
from agents.model_settings import MCPToolChoice
from agents.models.chatcmpl_converter import Converter
from agents.models.chatcmpl_stream_handler import ChatCmplStreamHandler
from agents.models.fake_id import FAKE_RESPONSES_ID
from agents.tracing import GenerationSpanData, Span, generation_span
from agents.usage import Usage, model_usage_to_span_usage
from openai import AsyncStream
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion_chunk import (Choice, ChoiceDelta, ChoiceDeltaToolCall,
                                                     ChoiceDeltaToolCallFunction)
from openai.types.completion_usage import (CompletionTokensDetails, CompletionUsage,
                                           PromptTokensDetails)
from openai.types.responses import Response, ToolChoiceFunction
from openai.types.responses.response_prompt_param import ResponsePromptParam
from openai.types.responses.response_usage import InputTokensDetails, OutputTokensDetails

from agentflash import usage as af
from agentflash.conversation import chat
from agentflash.request import (CallArguments, CallChunk, CallStart, ChatEvent, ChatReply,
                                ChatRequest, TextChunk, Turn)
from agentflash.engine.sampler import SamplingParams
from agentflash.runtime import Runtime
from agentflash.structured import TOOL_CHOICES


class AgentflashModel(Model):
    """An Agents SDK model that generates on `runtime` (named `name`, else the runtime's)."""

    def __init__(self, runtime: Runtime, name: str | None = None) -> None:
        self.runtime = runtime
        self.name = name or runtime.model_name

    async def get_response(self, system_instructions: str | None,
                           input: str | list[TResponseInputItem], model_settings: ModelSettings,
                           tools: list[Tool], output_schema: AgentOutputSchemaBase | None,
                           handoffs: list[Handoff], tracing: ModelTracing, *,
                           previous_response_id: str | None = None,
                           conversation_id: str | None = None,
                           prompt: ResponsePromptParam | None = None) -> ModelResponse:
        request = _request(system_instructions, input, model_settings, tools, output_schema,
                           handoffs, previous_response_id, conversation_id, prompt)
        with self._span(request, model_settings, tracing) as span:
            reply = await _reply(chat(self.runtime, request))
            _trace(span, reply, tracing)
        if reply.finish_reason == "length" and reply.text is None and not reply.tool_calls:
            raise ModelBehaviorError(  # as the SDK's own models, and the stream handler, do
                "the reply reached max_tokens before any text or tool call")
        message = ChatCompletionMessage.model_validate(reply.message)
        return ModelResponse(output=Converter.message_to_output_items(message),
                             usage=_usage(reply.usage), response_id=None)

    async def stream_response(self, system_instructions: str | None,
                              input: str | list[TResponseInputItem],
                              model_settings: ModelSettings, tools: list[Tool],
                              output_schema: AgentOutputSchemaBase | None,
                              handoffs: list[Handoff], tracing: ModelTracing, *,
                              previous_response_id: str | None = None,
                              conversation_id: str | None = None,
                              prompt: ResponsePromptParam | None = None,
                              ) -> AsyncIterator[TResponseStreamEvent]:
        request = _request(system_instructions, input, model_settings, tools, output_schema,
                           handoffs, previous_response_id, conversation_id, prompt)
        with self._span(request, model_settings, tracing) as span:
            turn = chat(self.runtime, request)
            choice = request.tool_choice
            response = Response(
                id=FAKE_RESPONSES_ID, created_at=time.time(), model=self.name, object="response",
                output=[], tools=[], parallel_tool_calls=request.parallel_tool_calls,
                tool_choice=choice if choice in TOOL_CHOICES else ToolChoiceFunction(
                    name=choice, type="function"),
                temperature=model_settings.temperature, top_p=model_settings.top_p)
            chunks = self._chunks(turn, span, tracing)
            async with aclosing(chunks), aclosing(ChatCmplStreamHandler.handle_stream(
                    response, cast(AsyncStream[ChatCompletionChunk], chunks), model=self.name,
                    raise_on_length_truncation=True)) as events:
                async for event in events:
                    yield event

    async def _chunks(self, turn: Turn, span: Span[GenerationSpanData],
                      tracing: ModelTracing) -> AsyncGenerator[ChatCompletionChunk, None]:
        """The turn's events as the Chat Completions chunks the SDK's stream handler reads."""
        async with aclosing(turn.events()) as events:
            async for event in events:
                if isinstance(event, ChatReply):
                    _trace(span, event, tracing)
                if isinstance(event, CallChunk) and event.streamed:
                    continue  # sent piece by piece
                yield self._chunk(event)

    def _chunk(self, event: ChatEvent) -> ChatCompletionChunk:
        finish: Any = None
        usage = None
        if isinstance(event, TextChunk):
            delta = ChoiceDelta(content=event.text)
        elif isinstance(event, CallStart):  # the call as it is written: id and name first
            delta = ChoiceDelta(tool_calls=[ChoiceDeltaToolCall(
                index=event.index, id=event.id, type="function",
                function=ChoiceDeltaToolCallFunction(name=event.name, arguments=""))])
        elif isinstance(event, CallArguments):
            delta = ChoiceDelta(tool_calls=[ChoiceDeltaToolCall(
                index=event.index, function=ChoiceDeltaToolCallFunction(arguments=event.text))])
        elif isinstance(event, CallChunk):
            delta = ChoiceDelta(tool_calls=[ChoiceDeltaToolCall(
                index=event.index, id=event.call.id, type="function",
                function=ChoiceDeltaToolCallFunction(
                    name=event.call.name, arguments=event.call.arguments_text()))])
        else:
            delta, finish, usage = ChoiceDelta(), event.finish_reason, _completion_usage(
                event.usage)
        return ChatCompletionChunk(
            id=FAKE_RESPONSES_ID, object="chat.completion.chunk", created=int(time.time()),
            model=self.name, choices=[Choice(index=0, delta=delta, finish_reason=finish)],
            usage=usage)

    def _span(self, request: ChatRequest, model_settings: ModelSettings,
              tracing: ModelTracing) -> Span[GenerationSpanData]:
        return generation_span(
            model=self.name, model_config=model_settings.to_traceable_dict(),
            input=list(request.messages) if tracing.include_data() else None,
            disabled=tracing.is_disabled())


class AgentflashProvider(ModelProvider):
    """A model provider whose every model name (or none) is the runtime's model."""

    def __init__(self, runtime: Runtime) -> None:
        self.model = AgentflashModel(runtime)

    def get_model(self, model_name: str | None) -> Model:
        return self.model


def _request(system_instructions: str | None, input: str | list[TResponseInputItem],
             settings: ModelSettings, tools: list[Tool],
             output_schema: AgentOutputSchemaBase | None, handoffs: list[Handoff],
             previous_response_id: str | None, conversation_id: str | None,
             prompt: ResponsePromptParam | None) -> ChatRequest:
    """The chat request of one model call (UserError for what agentflash cannot run)."""
    if previous_response_id is not None or conversation_id is not None or prompt is not None:
        raise UserError("agentflash keeps no server-side conversation state or prompt "
                        "templates: pass the whole history (its prefix cache makes that cheap)")
    messages: list[dict[str, Any]] = [dict(m) for m in Converter.items_to_messages(input)]
    for m in messages:
        if isinstance(m.get("content"), list) and any(
                isinstance(p, dict) and p.get("type", "text") != "text" for p in m["content"]):
            raise UserError("agentflash models take text input only")
    if system_instructions:
        messages.insert(0, {"role": "system", "content": system_instructions})
    specs: list[dict[str, Any]] = []
    for tool in tools:
        if not isinstance(tool, FunctionTool):
            raise UserError(f"agentflash runs function tools only, not {type(tool).__name__}")
        specs.append(dict(Converter.tool_to_openai(tool)))
    specs += [dict(Converter.convert_handoff_tool(h)) for h in handoffs]
    if isinstance(settings.tool_choice, MCPToolChoice):
        raise UserError("agentflash has no MCP tool choice")
    extra = settings.extra_args or {}
    stop = extra.get("stop") or ()
    params = SamplingParams(
        temperature=0.0 if settings.temperature is None else settings.temperature,
        top_p=1.0 if settings.top_p is None else settings.top_p,
        top_k=extra.get("top_k", 0), seed=extra.get("seed"),
        stop=(stop,) if isinstance(stop, str) else tuple(stop))
    schema = None if output_schema is None or output_schema.is_plain_text() \
        else output_schema.json_schema()
    return ChatRequest(messages=tuple(messages), tools=tuple(specs),
                       tool_choice=settings.tool_choice or "auto",
                       parallel_tool_calls=settings.parallel_tool_calls is not False,
                       output_schema=schema, params=params, max_tokens=settings.max_tokens)


async def _reply(turn: Turn) -> ChatReply:
    """Run the turn to its reply (its last event)."""
    async with aclosing(turn.events()) as events:
        async for event in events:
            if isinstance(event, ChatReply):
                return event
    raise AssertionError("a chat turn ends with its reply")


def _usage(u: af.Usage) -> Usage:
    return Usage(requests=1, input_tokens=u.prompt_tokens, output_tokens=u.completion_tokens,
                 total_tokens=u.total_tokens,
                 input_tokens_details=InputTokensDetails(
                     cached_tokens=u.prompt_tokens_details.cached_tokens, cache_write_tokens=0),
                 output_tokens_details=OutputTokensDetails(reasoning_tokens=0))


def _completion_usage(u: af.Usage) -> CompletionUsage:
    d = u.completion_tokens_details
    return CompletionUsage(
        prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
        total_tokens=u.total_tokens,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=u.prompt_tokens_details.cached_tokens),
        completion_tokens_details=CompletionTokensDetails(
            reasoning_tokens=0, accepted_prediction_tokens=d.accepted_prediction_tokens,
            rejected_prediction_tokens=d.rejected_prediction_tokens))


def _trace(span: Span[GenerationSpanData], reply: ChatReply, tracing: ModelTracing) -> None:
    span.span_data.usage = model_usage_to_span_usage(_usage(reply.usage))
    if tracing.include_data():
        span.span_data.output = [reply.message]
