"""The OpenAI-compatible HTTP server: a FastAPI app over one `Runtime`.

Endpoints: GET /v1/models, POST /v1/chat/completions and /v1/completions (plain, and SSE with
`stream_options.include_usage`), DELETE /v1/sessions/{id}, GET /health, GET /metrics, and the
OpenAPI document (/openapi.json, /docs). Each generation endpoint is a thin layer over
agentflash.conversation (the same code the framework adapters use): this module only maps the
wire format (agentflash.server.protocol) and HTTP concerns: auth, a bounded number of requests
in flight (429 with Retry-After past it), a body size limit (413), OpenAI's error shape for
every failure, and a client that disconnects mid-stream aborting its generation.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncGenerator, AsyncIterator, Callable

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from agentflash.conversation import TextReply, chat, complete
from agentflash.request import CallArguments, CallChunk, CallStart, ChatReply, TextChunk, Turn
from agentflash.engine.errors import ContextLengthError, EngineError, KVPoolExhaustedError
from agentflash.engine.sampler import SamplingParams
from agentflash.errors import AgentflashError, AgentClosedError
from agentflash.runtime import Runtime
from agentflash.usage import Usage

from .body_limit import BodyLimit
from .metrics import CONTENT_TYPE, Metrics
from .protocol import (ChatCompletionRequest, CompletionRequest, error_body, new_id, now,
                       tool_call_body, usage_body)
from .sessions import Sessions

MAX_BODY_BYTES = 8 << 20
"""Largest request body accepted (413 past it)."""


class ServerError(Exception):
    """An HTTP error in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.code, self.headers = status, type_, code, headers


def _as_server_error(e: BaseException) -> ServerError:
    """The HTTP error of a runtime exception (every typed error is the client's: 4xx)."""
    while isinstance(getattr(e, "exceptions", None), tuple) and e.exceptions:  # type: ignore
        e = e.exceptions[0]  # an exception group: one of several choices failed
    if isinstance(e, ServerError):
        return e
    if isinstance(e, ContextLengthError):
        return ServerError(400, str(e), code="context_length_exceeded")
    if isinstance(e, KVPoolExhaustedError):
        return ServerError(400, str(e), code="kv_pool_exhausted")
    if isinstance(e, AgentClosedError):
        return ServerError(503, "the server is shutting down", "server_error")
    if isinstance(e, (AgentflashError, EngineError, ValueError, TypeError)):
        return ServerError(400, str(e))
    return ServerError(500, f"internal error: {type(e).__name__}", "server_error")


class Server:
    """What the endpoints share: the runtime, the served name, sessions, metrics, limits."""

    def __init__(self, runtime: Runtime, served_model_name: str | None, api_key: str | None,
                 max_in_flight: int) -> None:
        self.runtime = runtime
        self.model = served_model_name or runtime.model_name
        self.api_key = api_key
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        self.sessions = Sessions(runtime)
        self.metrics = Metrics()

    def admit(self, body: Any) -> None:
        """Checks every generation request passes before it takes a slot."""
        if body.model != self.model:
            raise ServerError(404, f"the model {body.model!r} does not exist; this server "
                              f"serves {self.model!r}", code="model_not_found")
        if self.in_flight >= self.max_in_flight:
            raise ServerError(429, f"{self.in_flight} requests in flight, the server's limit; "
                              "retry shortly", "rate_limit_exceeded", "queue_full",
                              headers={"Retry-After": "1"})


def create_app(runtime: Runtime, served_model_name: str | None = None,
               api_key: str | None = None, max_in_flight: int = 256) -> FastAPI:
    """The server's ASGI app over `runtime` (which the caller owns and closes)."""
    app = FastAPI(title="agentflash", version="0.1.0",
                  description="OpenAI-compatible API over an agentflash runtime: KV kept "
                              "across turns, DFlash speculative decoding, constrained tool "
                              "calls.")
    server = app.state.server = Server(runtime, served_model_name, api_key, max_in_flight)

    @app.exception_handler(ServerError)
    async def _server_error(request: Request, e: ServerError) -> JSONResponse:
        server.metrics.requests.labels(request.url.path, str(e.status)).inc()
        return JSONResponse(error_body(str(e), e.type, e.code), e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else \
            first.get("msg", "invalid request")
        server.metrics.requests.labels(request.url.path, "400").inc()
        return JSONResponse(error_body(message, "invalid_request_error", param=where or None),
                            400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(e.detail), "invalid_request_error"), e.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        err = _as_server_error(e)
        return JSONResponse(error_body(str(err), err.type, err.code), err.status)

    def authorized(request: Request) -> None:
        if server.api_key is not None and \
                request.headers.get("authorization") != f"Bearer {server.api_key}":
            raise ServerError(401, "invalid or missing API key (Authorization: Bearer ...)",
                              code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorized)])

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        stats = await anyio.to_thread.run_sync(runtime.stats)
        body = server.metrics.render(stats, server.in_flight, len(server.sessions))
        return Response(body, media_type=CONTENT_TYPE)

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": server.model, "object": "model", "created": 0, "owned_by": "agentflash",
            "max_model_len": runtime.engine.max_model_len}]}

    @v1.delete("/sessions/{session_id}")
    async def delete_session(session_id: str) -> dict[str, Any]:
        if not server.sessions.release(session_id):
            raise ServerError(404, f"no session {session_id!r} (never pinned, deleted or "
                              "expired)", code="session_not_found")
        return {"id": session_id, "object": "session", "deleted": True}

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        server.admit(body)
        try:
            turns = [chat(runtime, body.chat_request(i)) for i in range(body.n)]
        except Exception as e:
            raise _as_server_error(e) from None
        if body.stream:
            return await _stream(server, request, _chat_chunks(server, body, turns))
        return await _respond(server, request, _chat_response(server, body, turns))

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        server.admit(body)
        try:
            prompts = body.prompts(runtime.chat.encode)
            params = [body.params(i) for i in range(body.n)]
        except Exception as e:
            raise _as_server_error(e) from None
        if body.stream:
            return await _stream(server, request, _text_chunks(server, body, prompts, params))
        return await _respond(server, request, _text_response(server, body, prompts, params))

    app.include_router(v1)
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)
    return app


# ---- running choices ----------------------------------------------------------------------

async def _merge(sources: list[Callable[[], AsyncGenerator[Any, None]]]) -> AsyncIterator[
        tuple[int, Any]]:
    """(index, event) from several async iterators, as they come; one iterator is passed
    through. An error in any ends all (the others are cancelled, freeing their KV). The sources
    run as tasks of their own, not in a task group held across this generator's yields: a
    streamed response takes its first event in the endpoint's task and the rest in the body's,
    and a cancel scope must be left in the task that entered it."""
    if len(sources) == 1:
        async for event in sources[0]():
            yield 0, event
        return
    queue: asyncio.Queue[tuple[int, Any] | Exception | None] = asyncio.Queue()

    async def pump(index: int, source: Callable[[], AsyncGenerator[Any, None]]) -> None:
        events = source()
        try:
            async for event in events:
                queue.put_nowait((index, event))
        except Exception as error:
            queue.put_nowait(error)
        else:
            queue.put_nowait(None)  # this source is done
        finally:
            await events.aclose()

    tasks = [asyncio.create_task(pump(i, source)) for i, source in enumerate(sources)]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _shared_prefill(runtime: Runtime, prompt: list[int]) -> Any:
    """For n > 1 choices: compute the prompt once and pin it, so every choice starts from its
    KV (each computes only the prompt's last token). Returns (pin, usage of that prefill)."""
    gen = runtime.generate(prompt, SamplingParams(max_new_tokens=1), pin=True)
    try:
        async for _ in gen:
            pass
    finally:
        gen.cancel()
    done = gen.completion
    assert done is not None
    if done.error is not None:
        raise done.error
    usage = Usage.from_counters(done.counters, len(prompt), 0, runtime.target_params,
                                runtime.draft_params, runtime.engine.block_size,
                                str(runtime.engine.device), 0.0, 0.0)
    return done.pin, usage


async def _chat_events(server: Server, body: ChatCompletionRequest,
                       turns: list[Turn]) -> AsyncIterator[tuple[int, Any]]:
    """Every choice's events, then the whole request's usage as (-1, (usage, prompt usage))."""
    runtime = server.runtime
    pin, prompt_usage = None, None
    if len(turns) > 1:
        pin, prompt_usage = await _shared_prefill(runtime, turns[0].prompt)
    replies: list[ChatReply] = []
    try:
        async for index, event in _merge([t.events for t in turns]):
            if isinstance(event, ChatReply):
                replies.append(event)
                server.metrics.count(event.usage)
                if index == 0 and body.session is not None:
                    server.sessions.hold(body.session.id, event.pin, body.session.ttl_s)
                elif event.pin is not None:
                    runtime.unpin(event.pin)
            yield index, event
    finally:
        runtime.unpin(pin)
    yield -1, (Usage.sum([r.usage for r in replies]), prompt_usage)


async def _whole(server: Server, events: AsyncIterator[tuple[int, Any]], final: type,
                 choice: Callable[[int, Any], dict[str, Any]], prefix: str,
                 kind: str) -> dict[str, Any]:
    """A non-streamed response: each choice from its final event, the usage from the last."""
    choices: dict[int, dict[str, Any]] = {}
    usage: dict[str, Any] = {}
    async for index, event in events:
        if index == -1:
            usage = usage_body(*event)
        elif isinstance(event, final):
            choices[index] = choice(index, event)
    return {"id": new_id(prefix), "object": kind, "created": now(), "model": server.model,
            "choices": [choices[i] for i in sorted(choices)], "usage": usage}


async def _chat_response(server: Server, body: ChatCompletionRequest,
                         turns: list[Turn]) -> dict[str, Any]:
    def choice(index: int, reply: ChatReply) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": reply.text}
        if reply.tool_calls:
            message["tool_calls"] = [tool_call_body(c) for c in reply.tool_calls]
        return {"index": index, "message": message, "logprobs": None,
                "finish_reason": reply.finish_reason}

    return await _whole(server, _chat_events(server, body, turns), ChatReply, choice,
                        "chatcmpl", "chat.completion")


async def _chat_chunks(server: Server, body: ChatCompletionRequest,
                       turns: list[Turn]) -> AsyncIterator[dict[str, Any]]:
    rid, created = new_id("chatcmpl"), now()
    include_usage = body.stream_options is not None and body.stream_options.include_usage

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        out = {"id": rid, "object": "chat.completion.chunk", "created": created,
               "model": server.model, "choices": choices, **extra}
        if include_usage:
            out.setdefault("usage", None)
        return out

    started: set[int] = set()
    async for index, event in _chat_events(server, body, turns):
        if index == -1:
            if include_usage:
                yield chunk([], usage=usage_body(*event))
            continue
        if index not in started:
            started.add(index)
            yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}])
        if isinstance(event, TextChunk):
            if not event.text:
                continue
            delta: dict[str, Any] = {"content": event.text}
        elif isinstance(event, CallStart):  # OpenAI's shape: id and name, then arguments
            delta = {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                     "function": {"name": event.name, "arguments": ""}}]}
        elif isinstance(event, CallArguments):
            delta = {"tool_calls": [{"index": event.index,
                                     "function": {"arguments": event.text}}]}
        elif isinstance(event, CallChunk):
            if event.streamed:
                continue  # already sent piece by piece
            delta = {"tool_calls": [tool_call_body(event.call, event.index)]}
        else:
            assert isinstance(event, ChatReply)
            yield chunk([{"index": index, "delta": {}, "logprobs": None,
                          "finish_reason": event.finish_reason}])
            continue
        yield chunk([{"index": index, "delta": delta, "logprobs": None,
                      "finish_reason": None}])


async def _text_events(server: Server, body: CompletionRequest, prompts: list[list[int]],
                       params: list[SamplingParams]) -> AsyncIterator[tuple[int, Any]]:
    """Every (prompt, choice) pair's events (index = prompt * n + choice), then the usage."""
    runtime = server.runtime
    max_tokens = body.max_tokens
    sources = [(lambda p=p, sp=sp: complete(runtime, p, sp, max_tokens,
                                            body.prediction and body.prediction.content))
               for p in prompts for sp in params]
    usages: list[Usage] = []
    async for index, event in _merge(sources):
        if isinstance(event, TextReply):
            usages.append(event.usage)
            server.metrics.count(event.usage)
        yield index, event
    yield -1, (Usage.sum(usages), None)


async def _text_response(server: Server, body: CompletionRequest, prompts: list[list[int]],
                         params: list[SamplingParams]) -> dict[str, Any]:
    def choice(index: int, reply: TextReply) -> dict[str, Any]:
        text = reply.text
        if body.echo:
            text = server.runtime.chat.decode(prompts[index // body.n]) + text
        return {"index": index, "text": text, "logprobs": None,
                "finish_reason": reply.finish_reason}

    return await _whole(server, _text_events(server, body, prompts, params), TextReply, choice,
                        "cmpl", "text_completion")


async def _text_chunks(server: Server, body: CompletionRequest, prompts: list[list[int]],
                       params: list[SamplingParams]) -> AsyncIterator[dict[str, Any]]:
    rid, created = new_id("cmpl"), now()
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    async for index, event in _text_events(server, body, prompts, params):
        out: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created,
                               "model": server.model}
        if index == -1:
            if not include_usage:
                continue
            out |= {"choices": [], "usage": usage_body(*event)}
        elif isinstance(event, TextChunk):
            out["choices"] = [{"index": index, "text": event.text, "logprobs": None,
                               "finish_reason": None}]
        else:
            out["choices"] = [{"index": index, "text": "", "logprobs": None,
                               "finish_reason": event.finish_reason}]
        yield out


# ---- HTTP responses -----------------------------------------------------------------------

DISCONNECT_POLL_S = 0.25
"""How often a non-streamed request checks that its client is still there."""


async def _respond(server: Server, request: Request, work: Any) -> Response:
    """A JSON response from `work`; a client that goes away first cancels it (aborting its
    generations and freeing their KV)."""
    server.in_flight += 1
    body: Any = None
    try:
        async with anyio.create_task_group() as tg:
            async def run() -> None:
                nonlocal body
                body = await work
                tg.cancel_scope.cancel()

            async def watch() -> None:
                while not await request.is_disconnected():
                    await anyio.sleep(DISCONNECT_POLL_S)
                tg.cancel_scope.cancel()

            tg.start_soon(run)
            tg.start_soon(watch)
    except Exception as e:
        raise _as_server_error(e) from None
    finally:
        server.in_flight -= 1
    status = 200 if body is not None else 499  # 499: the client left, nobody reads this
    server.metrics.requests.labels(request.url.path, str(status)).inc()
    return JSONResponse(body) if body is not None else Response(status_code=499)


async def _stream(server: Server, request: Request,
                  chunks: AsyncIterator[dict[str, Any]]) -> Response:
    """An SSE response. The first chunk is awaited here, so errors before any output (a
    request that can never fit, a failed submit) still get their HTTP status; later errors
    end the stream with an error event. A disconnect cancels the body's task, which aborts
    the generations."""
    server.in_flight += 1
    try:
        first = await chunks.__anext__()
    except StopAsyncIteration:
        first = None
    except BaseException as e:
        server.in_flight -= 1
        await chunks.aclose()
        raise _as_server_error(e) from None

    server.metrics.requests.labels(request.url.path, "200").inc()

    async def body() -> AsyncIterator[bytes]:
        try:
            if first is not None:
                yield _sse(first)
                async for chunk in chunks:
                    yield _sse(chunk)
            yield b"data: [DONE]\n\n"
        except Exception as e:
            err = _as_server_error(e)
            yield _sse(error_body(str(err), err.type, err.code))
        finally:
            server.in_flight -= 1
            with anyio.CancelScope(shield=True):  # a disconnect: close the generations too
                await chunks.aclose()

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def _sse(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()
