"""ASGI middleware that refuses request bodies over a size limit with OpenAI's error shape (413),
whether the size is declared (Content-Length) or only seen while the body streams in."""

from __future__ import annotations

import json
from typing import Any, Callable

from .protocol import error_body


class BodyLimit:
    """ASGI middleware: 413 for a request body over `limit` bytes (declared or streamed)."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(send)
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise TooLarge
            return message

        try:
            await self.app(scope, counted, send)
        except TooLarge:
            await self._refuse(send)

    async def _refuse(self, send: Callable) -> None:
        body = json.dumps(error_body(f"request body over {self.limit} bytes",
                                     "invalid_request_error", "request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


class TooLarge(Exception):
    pass
