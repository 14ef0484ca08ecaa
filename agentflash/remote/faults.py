"""What a failed request to a remote server means: the SDK's typed error for it, and whether
and when to retry it.

Retried (before any of the reply has arrived): a refused or dropped connection, 429 and
502/503/504, after exponential backoff from `backoff_s` (Retry-After when the server sends it),
capped at `MAX_BACKOFF_S`. Raised: `ServerUnavailableError` for what stays failing and for a
timeout (never retried: the server may still be working on it), `RemoteAuthError` for 401/403,
`ContextLengthError` for a prompt over the model's context, `RemoteRequestError` for other 4xx,
`RemoteError` for an error the server sent inside the stream.
"""

from __future__ import annotations

import json
import re
from typing import NoReturn

import httpx2 as httpx  # the openai client's HTTP library
import openai

from ..errors import (ContextLengthError, RemoteAuthError, RemoteError, RemoteRequestError,
                      ServerUnavailableError)

MAX_BACKOFF_S = 8.0
RETRY_STATUS = (429, 502, 503, 504)
_CONTEXT = re.compile(r"context length|context holds|maximum context|max_model_len|too long",
                      re.IGNORECASE)


def retryable(error: openai.APIError) -> bool:
    if isinstance(error, openai.APITimeoutError):
        return False
    if isinstance(error, openai.APIConnectionError):
        return True
    return isinstance(error, openai.APIStatusError) and error.status_code in RETRY_STATUS


def retry_delay(backoff_s: float, attempt: int, error: Exception) -> float:
    """Seconds before retry `attempt + 1`: Retry-After when the server says, else exponential."""
    response = getattr(error, "response", None)
    after = response.headers.get("retry-after") if response is not None else None
    try:
        if after is not None:
            return min(MAX_BACKOFF_S, max(0.0, float(after)))
    except ValueError:
        pass
    return min(MAX_BACKOFF_S, backoff_s * 2 ** attempt)


def raise_mapped(error: Exception, url: str) -> NoReturn:
    """Raise the SDK's typed error for an openai/httpx error."""
    if isinstance(error, (openai.APITimeoutError, httpx.TimeoutException)):
        raise ServerUnavailableError(f"{url} timed out: {error}") from error
    if isinstance(error, (openai.APIConnectionError, httpx.HTTPError)):
        raise ServerUnavailableError(f"cannot reach {url}: {error}") from error
    if isinstance(error, openai.APIStatusError):
        status, message = error.status_code, _message(error)
        if status in (401, 403):
            raise RemoteAuthError(f"{url} refused the request ({status}): {message}",
                                  status) from error
        if status == 429 or status >= 500:
            raise ServerUnavailableError(f"{url} answered {status}: {message}",
                                         status) from error
        if _CONTEXT.search(message):
            raise ContextLengthError(f"{url}: {message}") from error
        raise RemoteRequestError(f"{url} rejected the request ({status}): {message}",
                                 status) from error
    if isinstance(error, openai.APIError):  # an error event inside the stream
        raise RemoteError(f"{url} failed the request: {error}") from error
    raise error


def _message(error: openai.APIStatusError) -> str:
    body = error.body
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
        if isinstance(body.get("detail"), (str, list)):
            return json.dumps(body["detail"]) if isinstance(body["detail"], list) \
                else body["detail"]
    return error.message


