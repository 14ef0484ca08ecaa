"""agentflash: an in-process runtime that makes LLM agent loops fast."""

from .agent import (Agent, Event, MaxStepsError, RunResult, StepEvent, TextEvent, ToolCallEvent,
                    ToolResultEvent)
from .remote import RemoteRuntime
from .runtime import Runtime
from .step import Step, ToolCall, ToolResult
from .tool import Tool, tool
from .usage import Usage

__version__ = "0.1.0"
__all__ = ["Agent", "Event", "MaxStepsError", "RemoteRuntime", "RunResult", "Runtime", "Step",
           "StepEvent",
           "TextEvent", "Tool", "ToolCall", "ToolCallEvent", "ToolResult", "ToolResultEvent",
           "Usage", "tool"]
