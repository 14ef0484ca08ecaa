"""`agentflash serve`: the runtime behind an OpenAI-compatible HTTP API (FastAPI + uvicorn,
the `server` extra). `create_app(runtime)` gives the ASGI app (agentflash.server.app), imported
on first use so that the rest of the package loads without the extra."""

from __future__ import annotations

from typing import Any

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from .app import create_app
        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
