"""A chat turn as data: the request (`ChatRequest`) and what running it streams (`TextChunk`,
`CallChunk`, then a `ChatReply`).

Both runtimes take and give these: the local one (agentflash.conversation, on the engine) and a
remote OpenAI-compatible server (agentflash.remote). Everything above them (the Agent, the
server, the framework adapters) builds a `ChatRequest`, runs `conversation.chat()` and reads the
events, whichever runtime is underneath. The OpenAI request parsing that the server and the
adapters share (`tool_choice_of`, `output_schema_of`) lives here too.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, AsyncGenerator, Protocol

from agentflash.engine.kv.manager import Pin
from agentflash.engine.sampler import SamplingParams

from .errors import RequestError, ToolDefinitionError
from .step import ToolCall
from .structured import TOOL_CHOICES
from .tool import Tool
from .toolcall_parser import MalformedToolCall
from .usage import Usage

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class History:
    """The exact tokens a model saw through the first `messages` messages of a conversation
    (ending with its last reply): a local prompt continues from them instead of re-rendering.
    A caller that keeps its own history (the Agent) starts from the empty one, `History((), 0)`;
    requests without one are matched against the runtime's memory of replies."""

    tokens: tuple[int, ...]
    messages: int


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
    truncate: bool = False                      # max_tokens is a cap: stop at the context's end
    pin: bool = False                           # keep the conversation's KV pinned after
    speculative: bool = True
    constrained: bool = True                    # False: no grammar; calls parsed as they come
    reuse: bool = True                          # False: recompute the whole prompt
    history: History | None = None              # local: the tokens through the last reply
    session: str | None = None                  # remote: agentflash serve pins the KV under it
    affinity: str | None = None                 # remote: the routing key (a fork's = parent's)

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

    @property
    def calls_allowed(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


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
class CallStart:
    """The reply has begun writing its `index`-th tool call (its `CallArguments` follow, then
    the whole `CallChunk`; a call that starts but does not parse ends with no CallChunk)."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    """The next piece of the `index`-th call's arguments, as JSON text: together they are the
    call's `arguments_text()`."""

    index: int
    text: str


@dataclass(frozen=True)
class CallChunk:
    """A complete tool call, the `index`-th of the reply. `streamed`: its `CallStart` and
    `CallArguments` came before it (a front end that forwarded those has sent it already)."""

    index: int
    call: ToolCall
    streamed: bool = False


@dataclass
class ChatReply:
    text: str | None                     # None when the reply is only tool calls
    tool_calls: list[ToolCall]
    finish_reason: str                   # "stop" | "length" | "tool_calls"
    usage: Usage
    message: dict[str, Any]              # the assistant message, as a client resends it
    pin: Pin | None = None               # local: the conversation's KV, when the request pinned it
    output_ids: list[int] = field(default_factory=list)   # local: the reply's tokens
    history: History | None = None       # local: the tokens through this reply
    malformed: list[MalformedToolCall] = field(default_factory=list)  # calls left in the text:
    #                               not parsed, cut off, or one too many (agentflash.reply_parser)


ChatEvent = TextChunk | CallStart | CallArguments | CallChunk | ChatReply


def reply_message(text: str, calls: list[ToolCall]) -> dict[str, Any]:
    """The assistant message of a reply, as an OpenAI client resends it."""
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": c.arguments_text()}}
            for c in calls]
    return message


class Turn(Protocol):
    """A checked chat request, ready to run on its runtime."""

    request: ChatRequest

    def events(self) -> AsyncGenerator[ChatEvent, None]:
        """Text and tool-call chunks as they are produced, then the `ChatReply`."""
        ...
