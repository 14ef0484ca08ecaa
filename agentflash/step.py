"""What one agent step produced: the model's reply, its tool calls and their results, usage.

Plain data, importing nothing of the agent loop, so that the loop (agent.py) and its observers
(telemetry.py) both depend on it and not on each other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .toolcall_parser import MalformedToolCall
from .usage import Usage


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]
    arguments_json: str | None = field(default=None, compare=False, repr=False)
    """The arguments as the model wrote them (JSON text), where known."""

    def arguments_text(self) -> str:
        """The arguments as JSON text (OpenAI's `function.arguments`): as written, else
        encoded."""
        if self.arguments_json is not None:
            return self.arguments_json
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass(frozen=True)
class ToolResult:
    call_id: str
    name: str
    content: str                     # what the model sees
    error: str | None = None         # None | "invalid_arguments" | "exception" | "timeout" |
    elapsed_s: float = 0.0           # "unknown_tool"


@dataclass
class Step:
    """One model turn and the tools it ran."""

    message: str                                 # the reply's text, tool calls removed
    tool_calls: list[ToolCall]
    tool_results: list[ToolResult]               # none for schema-only tools (caller supplies)
    output: Any                                  # final step: output_type instance (or text)
    is_final: bool
    usage: Usage
    finish_reason: str                           # "stop" | "length"
    malformed_calls: list[MalformedToolCall] = field(default_factory=list)  # calls that stayed
    #                          in `message` as text: not parsed, cut off, or one too many
