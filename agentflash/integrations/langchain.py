"""LangChain chat model over an in-process agentflash `Runtime`: `ChatAgentflash`.

    from agentflash import Runtime
    from agentflash.integrations.langchain import ChatAgentflash
    from langchain.agents import create_agent

    model = ChatAgentflash(runtime=Runtime.load(), max_tokens=256)
    agent = create_agent(model, tools=[...], response_format=MyOutput)

A thin layer over agentflash.conversation (what the OpenAI-compatible server runs too), with no
HTTP in between. LangChain messages become OpenAI-shaped messages and every call is one
`ChatRequest`; the runtime remembers the exact tokens of each reply, so when LangChain sends
the history back (the AIMessage this model returned, then ToolMessages or a new HumanMessage)
the prompt comes from the prefix cache up to the end of that reply.

Supported: invoke / ainvoke / stream / astream (the sync methods run the async path on an
event loop of their own, in a worker thread, so they work from any thread); batch through
LangChain's defaults; `bind_tools` with tool_choice "auto", "required", "any", "none", a tool's
name, {"type": "function", "function": {"name": ...}} or True, and parallel_tool_calls; tool
calls and JSON output are always constrained by grammar (`strict` is accepted);
`with_structured_output` with method "json_schema" (default), "json_mode" or
"function_calling", include_raw too; `create_agent`'s ProviderStrategy (the model's profile
says structured_output, so a bare schema as response_format picks it) and ToolStrategy;
usage_metadata with cached input tokens (input_token_details.cache_read) and agentflash's
speculative counters in response_metadata; cancelling the awaiting task aborts the generation
and frees its KV.
Not supported: non-text content (images, audio, files: ValueError), logprobs, n > 1, OpenAI
built-in tools (only function tools), Predicted Outputs and KV pinning (use the Agent SDK or
the server for those).
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, closing
from operator import itemgetter
from typing import (Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, Generator, Iterator,
                    Literal, Sequence, TypeVar)

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.language_models.model_profile import ModelProfile
from langchain_core.messages import (AIMessage, AIMessageChunk, BaseMessage, ChatMessage,
                                     HumanMessage, SystemMessage, ToolMessage)
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.messages.tool import tool_call, tool_call_chunk
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel, ConfigDict, Field

from agentflash.conversation import chat
from agentflash.request import (CallArguments, CallChunk, CallStart, ChatEvent, ChatReply,
                                ChatRequest, TextChunk, output_schema_of, tool_choice_of)
from agentflash.structured import TOOL_CHOICES
from agentflash.engine.sampler import SamplingParams
from agentflash.runtime import Runtime

T = TypeVar("T")

_ROLES = {SystemMessage: "system", HumanMessage: "user", AIMessage: "assistant",
          ToolMessage: "tool"}
_MEDIA = {"image", "image_url", "audio", "input_audio", "video", "file"}


class ChatAgentflash(BaseChatModel):
    """A LangChain chat model generating on `runtime` (shared with any other users of it)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    runtime: Runtime = Field(exclude=True)
    temperature: float = 0.0
    max_tokens: int | None = None        # None: agentflash's default, capped by the context
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None

    @property
    def _llm_type(self) -> str:
        return "agentflash"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.runtime.model_name, "temperature": self.temperature,
                "max_tokens": self.max_tokens, "top_p": self.top_p, "seed": self.seed,
                "stop": self.stop}

    def _resolve_model_profile(self) -> ModelProfile:
        return ModelProfile(max_input_tokens=self.runtime.engine.max_model_len, text_inputs=True,
                            tool_calling=True, tool_choice=True, structured_output=True)

    # ---- declarative ------------------------------------------------------------------------

    def bind_tools(self, tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
                   *, tool_choice: str | dict[str, Any] | bool | None = None,
                   strict: bool | None = None, **kwargs: Any,
                   ) -> Runnable[LanguageModelInput, AIMessage]:
        """This model with `tools` (converted by convert_to_openai_tool) offered on every call;
        `tool_choice` and `parallel_tool_calls` (kwargs) as in OpenAI's API."""
        formatted = [convert_to_openai_tool(t, strict=strict) for t in tools]
        if tool_choice is not None:
            kwargs["tool_choice"] = tool_choice
        return self.bind(tools=formatted, **kwargs)

    def with_structured_output(
            self, schema: dict[str, Any] | type, *, include_raw: bool = False,
            method: Literal["json_schema", "json_mode", "function_calling"] = "json_schema",
            **kwargs: Any) -> Runnable[LanguageModelInput, dict[str, Any] | BaseModel]:
        """Replies parsed into `schema` (a pydantic class gives instances, anything else
        dicts): "json_schema" constrains the reply to the schema, "json_mode" to a JSON object,
        "function_calling" forces a call of `schema` as a tool (LangChain's default)."""
        if method == "function_calling":
            return super().with_structured_output(schema, include_raw=include_raw, **kwargs)
        kwargs.pop("strict", None)  # the output is always constrained
        if kwargs:
            raise ValueError(f"unsupported arguments {kwargs}")
        json_schema = convert_to_json_schema(schema)
        response_format = {"type": "json_object"} if method == "json_mode" else {
            "type": "json_schema",
            "json_schema": {"name": json_schema.get("title", "output"), "schema": json_schema}}
        llm = self.bind(response_format=response_format, ls_structured_output_format={
            "kwargs": {"method": method}, "schema": schema})
        parser: Runnable[Any, Any] = (
            PydanticOutputParser(pydantic_object=schema)
            if isinstance(schema, type) and is_basemodel_subclass(schema)
            else JsonOutputParser())
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser,
                                            parsing_error=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks(
            [RunnablePassthrough.assign(parsed=lambda _: None)], exception_key="parsing_error")

    # ---- generation -------------------------------------------------------------------------

    def _request(self, messages: list[BaseMessage], stop: list[str] | None,
                 tools: Sequence[dict[str, Any]] = (),
                 tool_choice: str | dict[str, Any] | bool | None = None,
                 parallel_tool_calls: bool = True,
                 response_format: dict[str, Any] | None = None, **extra: Any) -> ChatRequest:
        extra.pop("stream", None)  # LangChain's own switch (invoke(..., stream=True))
        if extra:
            raise ValueError(f"unsupported arguments for ChatAgentflash: {sorted(extra)}")
        params = SamplingParams(
            temperature=self.temperature, top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed, stop=tuple(stop if stop is not None else self.stop or ()))
        return ChatRequest(messages=tuple(_openai_message(m) for m in messages),
                           tools=tuple(tools), tool_choice=_tool_choice(tool_choice, tools),
                           parallel_tool_calls=parallel_tool_calls,
                           output_schema=output_schema_of(response_format), params=params,
                           max_tokens=self.max_tokens)

    async def _events(self, messages: list[BaseMessage], stop: list[str] | None,
                      kwargs: dict[str, Any]) -> AsyncGenerator[ChatEvent, None]:
        turn = chat(self.runtime, self._request(messages, stop, **kwargs))
        # closed early (a consumer stops, a task is cancelled): the turn aborts and frees its KV;
        # Turn.events is an async generator, annotated as an AsyncIterator
        async with aclosing(turn.events()) as events:  # type: ignore[type-var]
            async for event in events:
                yield event

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None,
                         **kwargs: Any) -> ChatResult:
        async for event in self._events(messages, stop, kwargs):
            pass
        return self._result(event)

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        async with aclosing(self._events(messages, stop, kwargs)) as events:
            async for event in events:
                chunk = self._chunk(event)
                if chunk is not None:
                    yield chunk

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None,
                  **kwargs: Any) -> ChatResult:
        for event in _blocking(self._events(messages, stop, kwargs)):
            pass
        return self._result(event)

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None,
                **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        with closing(_blocking(self._events(messages, stop, kwargs))) as events:
            for event in events:
                chunk = self._chunk(event)
                if chunk is not None:
                    yield chunk

    # ---- results ----------------------------------------------------------------------------

    def _result(self, reply: ChatEvent) -> ChatResult:
        assert isinstance(reply, ChatReply)  # a turn's last event
        return ChatResult(generations=[ChatGeneration(message=AIMessage(
            content=reply.text or "",
            tool_calls=[tool_call(name=c.name, args=c.arguments, id=c.id)
                        for c in reply.tool_calls],
            usage_metadata=_usage_metadata(reply), response_metadata=self._metadata(reply)))])

    def _chunk(self, event: ChatEvent) -> ChatGenerationChunk | None:
        """The stream's chunk for `event`: text, a tool call as it is written (its id and name,
        then pieces of its arguments) or whole (unless it came in pieces), or (last) the
        usage."""
        if isinstance(event, TextChunk):
            return ChatGenerationChunk(message=AIMessageChunk(content=event.text)) \
                if event.text else None
        if isinstance(event, CallStart):
            return ChatGenerationChunk(message=AIMessageChunk(content="", tool_call_chunks=[
                tool_call_chunk(name=event.name, id=event.id, index=event.index, args="")]))
        if isinstance(event, CallArguments):
            return ChatGenerationChunk(message=AIMessageChunk(content="", tool_call_chunks=[
                tool_call_chunk(name=None, id=None, index=event.index, args=event.text)]))
        if isinstance(event, CallChunk):
            if event.streamed:
                return None
            call = event.call
            return ChatGenerationChunk(message=AIMessageChunk(content="", tool_call_chunks=[
                tool_call_chunk(name=call.name, id=call.id, index=event.index,
                                args=call.arguments_text())]))
        return ChatGenerationChunk(message=AIMessageChunk(
            content="", usage_metadata=_usage_metadata(event),
            response_metadata=self._metadata(event), chunk_position="last"))

    def _metadata(self, reply: ChatReply) -> dict[str, Any]:
        return {"finish_reason": reply.finish_reason, "model_name": self.runtime.model_name,
                "speculative": reply.usage.speculative.model_dump()}


def _blocking(events: AsyncGenerator[T, None]) -> Generator[T, None, None]:
    """`events` iterated on an event loop of its own in a worker thread (so from any thread,
    one running a loop too); closing this iterator early closes `events`."""
    loop = asyncio.new_event_loop()
    with ThreadPoolExecutor(1, thread_name_prefix="agentflash-langchain") as worker:
        def run(step: Awaitable[Any]) -> Any:
            return worker.submit(loop.run_until_complete, step).result()

        try:
            while True:
                try:
                    item = run(anext(events))
                except StopAsyncIteration:
                    return
                yield item
        finally:
            run(events.aclose())
            worker.submit(loop.close).result()


def _openai_message(m: BaseMessage) -> dict[str, Any]:
    """The OpenAI-shaped message of `m` (an AIMessage renders as agentflash's reply did)."""
    role = m.role if isinstance(m, ChatMessage) else next(
        (r for cls, r in _ROLES.items() if isinstance(m, cls)), None)
    if role is None:
        raise TypeError(f"ChatAgentflash does not take {type(m).__name__}")
    if isinstance(m.content, list) and any(
            isinstance(b, dict) and b.get("type") in _MEDIA for b in m.content):
        raise ValueError("ChatAgentflash takes text content only")
    out: dict[str, Any] = {"role": role, "content": str(m.text)}
    if isinstance(m, AIMessage) and m.tool_calls:
        out["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
            "name": c["name"], "arguments": json.dumps(c["args"], ensure_ascii=False)}}
            for c in m.tool_calls]
    if isinstance(m, ToolMessage):
        out["tool_call_id"] = m.tool_call_id
        if m.name:
            out["name"] = m.name
    return out


def _tool_choice(choice: str | dict[str, Any] | bool | None,
                 tools: Sequence[dict[str, Any]]) -> str:
    """agentflash's tool_choice from LangChain's: OpenAI's, plus True / False, "any" and a
    bare tool name."""
    if isinstance(choice, bool):
        return "required" if choice else "none"
    if choice == "any":
        return "required"
    if isinstance(choice, str) and choice not in TOOL_CHOICES:
        return choice  # a tool's name (ChatRequest checks it is one)
    return tool_choice_of(choice, bool(tools))


def _usage_metadata(reply: ChatReply) -> UsageMetadata:
    u = reply.usage
    return UsageMetadata(
        input_tokens=u.prompt_tokens, output_tokens=u.completion_tokens,
        total_tokens=u.total_tokens,
        input_token_details=InputTokenDetails(cache_read=u.prompt_tokens_details.cached_tokens))
