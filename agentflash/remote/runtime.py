"""RemoteRuntime: the Agent-facing surface of `Runtime`, over an OpenAI-compatible server.

`Runtime.connect(base_url)` (or `RemoteRuntime.connect`) asks the server for its models once,
tells vLLM, SGLang and `agentflash serve` apart by the models' `owned_by`, and from then on runs
each chat turn (agentflash.remote.turn) as one streamed chat completion with the official
`openai` async client, under asyncio or trio. An `Agent` takes it in place of a local runtime.

Faults (agentflash.remote.faults): a refused connection, a 429 or a 502/503/504 is retried
`retries` times with exponential backoff, and only before any of the reply has arrived (a retry
never repeats streamed text); the rest raise the SDK's typed errors.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import httpx2 as httpx  # the openai client's HTTP library
import openai
import xgrammar as xgr

from ..errors import AgentClosedError, AgentflashError, RemoteRequestError, ToolSchemaError
from ..request import ChatRequest
from ..structured import OutputSpec, structural_tag
from ..telemetry import RunLog
from ..usage import Pricing
from .wire import GRAMMAR_SERVERS, SERVER_KINDS, body
from .faults import raise_mapped, retry_delay, retryable
from .turn import RemoteTurn

CALL_FORMATS = ("hermes", "llama3_json")


class RemoteRuntime:
    """A model on an OpenAI-compatible server. Use `RemoteRuntime.connect(...)`."""

    def __init__(self, base_url: str, model: str, kind: str, api_key: str | None,
                 max_model_len: int | None, *, call_format: str = "hermes",
                 timeout_s: float = 600.0, connect_timeout_s: float = 10.0, retries: int = 3,
                 backoff_s: float = 0.5, session_ttl: float | None = None,
                 pricing: Pricing | None = None, log: str | Path | None = None) -> None:
        if kind not in SERVER_KINDS:
            raise ValueError(f"server must be one of {SERVER_KINDS}, got {kind!r}")
        if call_format not in CALL_FORMATS:
            raise ValueError(f"call_format must be one of {CALL_FORMATS}, got {call_format!r}")
        self.base_url = base_url
        self.model_name = model
        self.kind = kind
        self.max_model_len = max_model_len
        self.call_format = call_format
        self.retries = retries
        self.backoff_s = backoff_s
        self.session_ttl = session_ttl
        self.pricing = pricing
        self.log = RunLog(log) if log is not None else None
        self._api_key = api_key or "none"
        self._timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self._grammars: dict[str, str] = {}
        self._client: tuple[object, openai.AsyncOpenAI] | None = None  # (event loop, client)
        self._closed = False

    @classmethod
    def connect(cls, base_url: str, model: str | None = None, api_key: str | None = None, *,
                server: str = "auto", call_format: str = "hermes", timeout_s: float = 600.0,
                connect_timeout_s: float = 10.0, retries: int = 3, backoff_s: float = 0.5,
                session_ttl: float | None = None, pricing: Pricing | None = None,
                log: str | Path | None = None) -> RemoteRuntime:
        """Connect to the server at `base_url` (e.g. "http://127.0.0.1:8000", with or without
        /v1) and check that it serves `model` (None: its first model).

        server: "auto" (from the models' owned_by), "vllm", "sglang", "agentflash" or
        "openai" (decides how constraints travel: agentflash.remote.wire). call_format: the
        model's tool-call syntax ("hermes" for Qwen models, "llama3_json"), for the grammar
        sent to vLLM and SGLang. session_ttl: how long `agentflash serve` keeps an agent's KV pinned
        between steps (None: the server's default). Raises ServerUnavailableError when the
        server cannot be reached, RemoteRequestError when it does not serve `model`."""
        base_url = base_url.rstrip("/")
        if not base_url.endswith("/v1"):
            base_url += "/v1"
        listing = _models(base_url, api_key or "none",
                          httpx.Timeout(timeout_s, connect=connect_timeout_s), retries)
        ids = [m.get("id") for m in listing]
        if model is None:
            if not ids:
                raise RemoteRequestError(f"{base_url} serves no models")
            model = ids[0]
        elif model not in ids:
            raise RemoteRequestError(f"{base_url} does not serve {model!r} (it serves "
                                     f"{', '.join(map(str, ids)) or 'nothing'})", 404)
        entry = listing[ids.index(model)]
        if server == "auto":
            owner = str(entry.get("owned_by", "")).lower()
            server = owner if owner in SERVER_KINDS else "openai"
        max_len = entry.get("max_model_len")
        return cls(base_url, model, server, api_key, max_len if isinstance(max_len, int) else None,
                   call_format=call_format, timeout_s=timeout_s,
                   connect_timeout_s=connect_timeout_s, retries=retries, backoff_s=backoff_s,
                   session_ttl=session_ttl, pricing=pricing, log=log)

    # ---- the surface an Agent uses -----------------------------------------------------------

    def turn(self, request: ChatRequest) -> RemoteTurn:
        """A checked request, ready to run on the server."""
        if self._closed:
            raise AgentClosedError("the remote runtime is closed")
        grammar = None
        if self.kind in GRAMMAR_SERVERS and request.constrained:
            grammar = self.grammar(OutputSpec(request.tools, request.tool_choice,
                                              request.output_schema, self.call_format))
        kwargs = body(request, self.model_name, self.kind, grammar, self.session_ttl)
        return RemoteTurn(request, lambda: self.create(kwargs), self.call_format,
                          self.base_url, self.pricing)

    def grammar(self, spec: OutputSpec) -> str | None:
        """The constraint agentflash applies locally for `spec`, as xgrammar EBNF (None:
        unconstrained). Raises ToolSchemaError for a schema it cannot compile."""
        if spec.unconstrained:
            return None
        key = spec.key()
        if key not in self._grammars:
            try:
                self._grammars[key] = str(xgr.Grammar.from_structural_tag(structural_tag(spec)))
            except (RuntimeError, ValueError, TypeError) as e:
                raise ToolSchemaError(f"cannot compile the output constraint: {e}") from None
        return self._grammars[key]

    async def end_session(self, session: str) -> None:
        """Release what the server keeps for `session` (agentflash serve's pinned KV; other
        servers keep nothing per session). Best effort: a server that cannot be reached
        releases it at its TTL."""
        if self.kind != "agentflash" or self._closed:
            return
        try:
            await self.client().delete(f"/sessions/{session}", cast_to=object)
        except openai.APIError:
            pass  # unknown (never pinned, expired) or unreachable: the TTL releases it

    @staticmethod
    def check_agent(speculative: bool, reuse_kv: bool) -> None:
        """Refuse the Agent options a server does not let a request choose."""
        if not speculative or not reuse_kv:
            raise AgentflashError(
                "speculative=False and reuse_kv=False need a local runtime: a server decides "
                "speculation and prefix caching for itself")

    def close(self) -> None:
        self._closed = True
        self._client = None
        if self.log is not None:
            self.log.close()

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client[1].close()
        self.close()

    async def __aenter__(self) -> RemoteRuntime:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ---- requests --------------------------------------------------------------------------

    def client(self) -> openai.AsyncOpenAI:
        """The async client of the running event loop (its connections belong to that loop)."""
        loop = anyio.lowlevel.current_token().native_token
        if self._client is None or self._client[0] is not loop:
            # our own HTTP client: the openai client's default one closes itself when garbage
            # collected, on whatever loop runs then, which fails for connections of a loop gone
            self._client = (loop, openai.AsyncOpenAI(
                base_url=self.base_url, api_key=self._api_key, timeout=self._timeout,
                max_retries=0, http_client=httpx.AsyncClient(timeout=self._timeout)))
        return self._client[1]

    async def create(self, kwargs: dict[str, Any]) -> Any:
        """Start a streamed chat completion, retrying what is worth retrying."""
        client = self.client()
        for attempt in range(self.retries + 1):
            try:
                return await client.chat.completions.create(**kwargs)
            except openai.APIError as e:
                if attempt == self.retries or not retryable(e):
                    raise_mapped(e, self.base_url)
                await anyio.sleep(retry_delay(self.backoff_s, attempt, e))
        raise AssertionError("unreachable")


def _models(base_url: str, api_key: str, timeout: httpx.Timeout,
            retries: int) -> list[dict[str, Any]]:
    """GET /v1/models, with the same retry and error rules as a request."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=0)
    try:
        for attempt in range(retries + 1):
            try:
                page = client.models.list()
                return [m.model_dump() for m in page.data]
            except openai.APIError as e:
                if attempt == retries or not retryable(e):
                    raise_mapped(e, base_url)
                time.sleep(retry_delay(0.5, attempt, e))
    finally:
        client.close()
    raise AssertionError("unreachable")
