"""The OpenAI wire format: request bodies (pydantic, so they make the OpenAPI document),
their translation into the runtime's `ChatRequest` / sampling parameters, response and chunk
bodies, usage, and OpenAI's error shape."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from agentflash.request import ChatRequest, output_schema_of, tool_choice_of
from agentflash.engine.sampler import SamplingParams
from agentflash.errors import RequestError
from agentflash.step import ToolCall
from agentflash.usage import Usage

MAX_N = 16
"""Most choices one request may ask for."""


class _Body(BaseModel):
    # OpenAI clients send fields this server does not use (metadata, store, user, ...): accepted
    # and ignored, as vLLM does; the ones that would change the output are refused below
    model_config = ConfigDict(extra="allow")


class Session(BaseModel):
    """agentflash's session hint (extra_body): pin the conversation's KV for `ttl_s` seconds."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1, max_length=256)
    ttl_s: float = Field(default=300.0, gt=0, le=86400)


class StreamOptions(BaseModel):
    include_usage: bool = False


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class Prediction(BaseModel):
    type: Literal["content"] = "content"
    content: str | list[dict[str, Any]]


class ContentPart(_Body):
    type: str = "text"
    text: str = ""


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallBody(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallBody] | None = None
    tool_call_id: str | None = None


class FunctionDef(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class _Sampling(_Body):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None
    ignore_eos: bool = False           # vLLM's extension: generate to max_tokens (benchmarks)

    def params(self, index: int = 0) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > 4:
            raise RequestError("stop takes at most 4 sequences")
        if self.logprobs:
            raise RequestError("logprobs are not supported by this server")
        seed = None if self.seed is None else self.seed + index  # n choices: distinct streams
        return SamplingParams(temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p, seed=seed,
                              stop=tuple(stop), ignore_eos=self.ignore_eos)


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[ToolDef] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    prediction: Prediction | None = None
    session: Session | None = None

    def chat_request(self, index: int = 0) -> ChatRequest:
        return ChatRequest(
            messages=tuple(m.model_dump(exclude_none=True) for m in self.messages),
            tools=tuple(t.model_dump(exclude_none=True) for t in self.tools or ()),
            tool_choice=tool_choice_of(self.tool_choice, bool(self.tools)), parallel_tool_calls=self.parallel_tool_calls,
            output_schema=output_schema_of(
                None if self.response_format is None else self.response_format.model_dump()), params=self.params(index),
            max_tokens=self.max_completion_tokens or self.max_tokens,
            prediction=self._prediction(), pin=self.session is not None and index == 0)

    def _prediction(self) -> str | None:
        if self.prediction is None:
            return None
        content = self.prediction.content
        if isinstance(content, str):
            return content
        return "".join(p.get("text", "") for p in content)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    prediction: Prediction | None = None

    def prompts(self, encode: Any) -> list[list[int]]:
        """The request's prompts as token ids."""
        p = self.prompt
        if isinstance(p, str):
            prompts = [encode(p)]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]  # type: ignore[arg-type]
        elif p and all(isinstance(x, str) for x in p):
            prompts = [encode(x) for x in p]  # type: ignore[arg-type]
        elif p and all(isinstance(x, list) for x in p):
            prompts = [list(x) for x in p]  # type: ignore[arg-type]
        else:
            raise RequestError("prompt must be a string, a list of strings, a list of token "
                               "ids or a list of such lists, and not empty")
        if not all(prompts):
            raise RequestError("a prompt is empty")
        if len(prompts) * self.n > MAX_N:
            raise RequestError(f"prompts x n is {len(prompts) * self.n}; at most {MAX_N}")
        return prompts


# ---- responses --------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage_body(usage: Usage, prompt: Usage | None = None) -> dict[str, Any]:
    """OpenAI's usage object, with agentflash's counters under "agentflash". `prompt`: where the
    prompt's numbers come from when they differ from `usage`'s (n > 1 shares one prefill)."""
    prompt = prompt or usage
    d = usage.completion_tokens_details
    return {
        "prompt_tokens": prompt.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": prompt.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": prompt.prompt_tokens_details.cached_tokens},
        "completion_tokens_details": {
            "accepted_prediction_tokens": d.accepted_prediction_tokens,
            "rejected_prediction_tokens": d.rejected_prediction_tokens,
            "reasoning_tokens": 0},
        "agentflash": {"speculative": usage.speculative.model_dump(),
                       "compute": usage.compute.model_dump(),
                       "timing": usage.timing.model_dump()},
    }


def tool_call_body(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"id": call.id, "type": "function", "function": {
        "name": call.name, "arguments": call.arguments_text()}}
    if index is not None:
        body["index"] = index
    return body


def error_body(message: str, type_: str, code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
