"""Typed errors of the agent SDK. Engine errors (bad checkpoints, context overflow, an exhausted
KV pool) come from `agentflash.engine.errors` and are re-exported here, so users catch one family:
every class below derives from `AgentflashError` or from the engine's `EngineError`."""

from __future__ import annotations

from agentflash.engine.errors import (
    CheckpointError,
    ContextLengthError,
    DrafterMismatchError,
    EngineError,
    KVPoolExhaustedError,
    RequestError,
    UnsupportedModelError,
)

__all__ = [
    "AgentClosedError", "AgentflashError", "CheckpointError", "ContextLengthError",
    "DrafterMismatchError", "EngineError", "KVPoolExhaustedError", "MissingToolResultError",
    "OutputValidationError", "RemoteAuthError", "RemoteError", "RemoteRequestError",
    "RequestError", "ServerUnavailableError", "ToolArgumentsError", "ToolDefinitionError",
    "ToolSchemaError", "ToolTimeoutError", "UnsupportedModelError",
]


class AgentflashError(Exception):
    """Base class of the SDK's own errors."""


class ToolDefinitionError(AgentflashError, TypeError):
    """A Python function cannot become a tool (e.g. *args, unsupported annotations)."""


class ToolSchemaError(AgentflashError, ValueError):
    """A tool's or an output type's JSON schema is malformed or unsupported."""


class ToolArgumentsError(AgentflashError, ValueError):
    """Arguments for a tool call do not validate against the tool's schema."""


class ToolTimeoutError(AgentflashError, TimeoutError):
    """A tool ran past its timeout."""


class MissingToolResultError(AgentflashError):
    """A step was started while calls to schema-only tools still wait for their results."""


class OutputValidationError(AgentflashError, ValueError):
    """The model's final output does not parse or validate against `output_type`."""


class AgentClosedError(AgentflashError):
    """The agent (or its runtime) was closed; its KV is released."""


class RemoteError(AgentflashError):
    """A remote server (agentflash.remote) failed the request; `status` is its HTTP status
    (None when no response came)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ServerUnavailableError(RemoteError, ConnectionError):
    """The server could not be reached, timed out, or stayed overloaded (429/503) through
    every retry."""


class RemoteAuthError(RemoteError, PermissionError):
    """The server refused the API key (401/403)."""


class RemoteRequestError(RemoteError, RequestError):
    """The server rejected the request as malformed (400/404/422: e.g. an unknown model)."""
