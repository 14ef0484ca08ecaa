"""`agentflash serve` driven by the official openai client (sync and async) against a real
uvicorn server on 127.0.0.1: tool calls (forced, named, one at a time), streaming equal to
non-streaming, a resent conversation served from the prefix cache, structured output, Predicted
Outputs, sessions (pin, TTL, delete), n > 1, raw completions, metrics, every error status, a
client that disconnects mid-stream, and a KV pool left clean after each test."""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import httpx2 as httpx  # the openai client's HTTP library
import jsonschema
import openai
import pytest
import starlette.testclient

from agentflash import Runtime
from agentflash.engine.config import CacheConfig
from agentflash.server import create_app
from conftest import EngineGate, assert_clean, running

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import bench_server  # noqa: E402  (the agent workload of the server benchmark)
from bench_peers import free_port, http_server  # noqa: E402

MODEL = "agentflash-11m"
KEY = "test-key"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                   "unit": {"enum": ["c", "f"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a timezone.",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                   "required": ["tz"], "additionalProperties": False}}}
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
ASK = [SYSTEM, {"role": "user", "content": "What is the weather in Paris right now?"}]
CITY = {"type": "object", "properties": {"name": {"type": "string"},
                                         "population": {"type": "integer"}},
        "required": ["name", "population"], "additionalProperties": False}


@pytest.fixture(scope="module")
def base_url(rt):
    with running(create_app(rt, api_key=KEY)) as url:
        yield url


@pytest.fixture
def client(base_url, rt):
    with openai.OpenAI(base_url=base_url + "/v1", api_key=KEY, max_retries=0) as c:
        yield c
    assert_clean(rt)


@pytest.fixture
def aclient(base_url, rt):
    return openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=KEY, max_retries=0)


def arguments(call: Any) -> dict[str, Any]:
    return json.loads(call.function.arguments)


def test_models_and_health(client, base_url):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(base_url + "/health").json() == {"status": "ok"}
    doc = httpx.get(base_url + "/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models",
            "/v1/sessions/{session_id}"} <= set(doc["paths"])


def test_forced_and_named_tool_calls_validate(client):
    forced = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        temperature=0, max_tokens=64)
    choice = forced.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        schema = {WEATHER["function"]["name"]: WEATHER, TIME["function"]["name"]: TIME}[
            call.function.name]["function"]["parameters"]
        jsonschema.validate(arguments(call), schema)
        assert call.id.startswith("call_")
    named = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=64,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = named.choices[0].message.tool_calls
    assert calls and {c.function.name for c in calls} == {"get_time"}
    for call in calls:
        jsonschema.validate(arguments(call), TIME["function"]["parameters"])
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                          tool_choice="none", temperature=0, max_tokens=24)
    assert none.choices[0].message.tool_calls is None
    assert "<tool_call>" not in (none.choices[0].message.content or "")


def test_parallel_tool_calls_false_gives_one_call(client):
    # the prompt asks for two calls; "required" with parallel_tool_calls=False stops after one
    messages = [SYSTEM, {"role": "user", "content": "Weather in Paris and in Rome, please."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                       tool_choice="required", parallel_tool_calls=False,
                                       temperature=0, max_tokens=96)
    assert len(r.choices[0].message.tool_calls) == 1
    assert r.choices[0].finish_reason == "tool_calls"


def _collect(stream: Any) -> tuple[str, dict[int, dict[str, Any]], str | None, Any]:
    """A stream's text, its calls as OpenAI clients assemble them (and how many deltas carried
    each call's arguments), finish reason and usage."""
    text, calls, finish, usage = "", {}, None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            text += delta.content or ""
            for tc in delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": "",
                                                    "pieces": 0})
                if not entry["id"]:  # a call's first delta names it
                    assert tc.id and tc.function.name and tc.type == "function"
                entry["id"] += tc.id or ""
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
                entry["pieces"] += bool(tc.function.arguments)
            finish = choice.finish_reason or finish
    return text, calls, finish, usage


def test_streaming_equals_non_streaming(client):
    for kwargs in (dict(messages=ASK, max_tokens=48),
                   dict(messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=64)):
        plain = client.chat.completions.create(model=MODEL, temperature=0, **kwargs)
        text, calls, finish, usage = _collect(client.chat.completions.create(
            model=MODEL, temperature=0, stream=True, stream_options={"include_usage": True},
            **kwargs))
        message = plain.choices[0].message
        assert text == (message.content or "")
        assert finish == plain.choices[0].finish_reason
        assert [(c["name"], c["arguments"]) for c in calls.values()] == \
            [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        # the arguments stream as they are written, not in one piece at the end
        assert all(c["pieces"] > 1 for c in calls.values())
        assert usage.completion_tokens == plain.usage.completion_tokens
        assert usage.prompt_tokens == plain.usage.prompt_tokens


def test_resent_conversation_with_tool_result_is_cached(client):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                           tool_choice="required", temperature=0,
                                           max_tokens=64)
    message = first.choices[0].message
    # resent as a client does: the assistant message re-serialized, then the tool's result
    history = ASK + [message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temp_c": 21})}
        for c in message.tool_calls]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER],
                                            temperature=0, max_tokens=32)
    u = second.usage
    assert u.prompt_tokens_details.cached_tokens >= 0.9 * u.prompt_tokens, u
    # the cache ran to the end of the first reply: at least prompt + reply of turn one
    assert u.prompt_tokens_details.cached_tokens >= \
        first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert u.model_extra["agentflash"]["compute"]["prefill_tokens_computed"] == \
        u.prompt_tokens - u.prompt_tokens_details.cached_tokens


def test_json_schema_output_validates(client):
    r = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=96,
        messages=[{"role": "system", "content": "Answer in JSON."},
                  {"role": "user", "content": "Give the largest city of France as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": CITY, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), CITY)
    obj = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=128, response_format={"type": "json_object"},
        messages=[SYSTEM, {"role": "user",
                           "content": "Reply in JSON: the city and its population."}])
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_prediction_right_is_accepted_and_wrong_changes_nothing(client, rt):
    kwargs = dict(model=MODEL, messages=ASK, temperature=0, max_tokens=40)
    plain = client.chat.completions.create(**kwargs)
    text = plain.choices[0].message.content
    right = client.chat.completions.create(
        **kwargs, prediction={"type": "content", "content": text})
    wrong = client.chat.completions.create(
        **kwargs, prediction={"type": "content", "content": "Completely unrelated words. " * 3})
    assert right.choices[0].message.content == text == wrong.choices[0].message.content
    d = right.usage.completion_tokens_details
    assert d.accepted_prediction_tokens >= right.usage.completion_tokens // 2, d
    assert d.accepted_prediction_tokens + d.rejected_prediction_tokens == len(rt.chat.encode(text))
    w = wrong.usage.completion_tokens_details
    assert w.rejected_prediction_tokens > 0 and w.accepted_prediction_tokens < 3
    p = plain.usage.completion_tokens_details
    assert p.accepted_prediction_tokens == p.rejected_prediction_tokens == 0


FUNCTIONS_AS_TEXT = ("You can use these functions: get_weather(city), add(a, b), "
                     "search(query). Reply to the user.")
PLAIN_PROMPTS = [
    [SYSTEM, {"role": "user", "content": text}] for text in (
        "List three colors.", "Say hello.", "What is 2 + 2?", "Name a fruit.",
        "Write one sentence about the sea.", "What is the weather in Paris right now?")
] + [
    [{"role": "system", "content": FUNCTIONS_AS_TEXT}, {"role": "user", "content": text}]
    for text in ("What is the weather in Oslo?", "Add 2 and 3.", "Search for cheap flights.",
                 "Hi!", "What can you do?", "Find the weather in Rome and add 1 and 1.")
]


def test_without_tools_the_models_text_is_the_content(client, rt):
    """No text vanishes where calls are not allowed: call markup the model writes is content,
    streamed exactly as returned; a right Predicted Output of it is accepted."""
    accepted = completion = 0
    for messages in PLAIN_PROMPTS:
        kwargs = dict(model=MODEL, messages=messages, temperature=0, max_tokens=64)
        r = client.chat.completions.create(**kwargs)
        message = r.choices[0].message
        assert message.tool_calls is None and message.content
        assert len(rt.chat.encode(message.content)) >= 0.8 * r.usage.completion_tokens, message
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
            message.content
        assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
        again = client.chat.completions.create(
            **kwargs, prediction={"type": "content", "content": message.content})
        assert again.choices[0].message.content == message.content
        accepted += again.usage.completion_tokens_details.accepted_prediction_tokens
        completion += again.usage.completion_tokens
    print(f"\nright predictions: {accepted} of {completion} completion tokens accepted")
    assert accepted >= 0.8 * completion


def test_session_pins_until_delete_and_ttl(client, rt, base_url):
    r = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=16,
                                       extra_body={"session": {"id": "s1", "ttl_s": 120}})
    assert rt.stats()["pages_pinned"] > 0
    resent = ASK + [r.choices[0].message.model_dump(exclude_none=True),
                    {"role": "user", "content": "And tomorrow?"}]
    r2 = client.chat.completions.create(model=MODEL, messages=resent, temperature=0,
                                        max_tokens=16,
                                        extra_body={"session": {"id": "s1", "ttl_s": 120}})
    assert r2.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens
    pinned = rt.stats()["pages_pinned"]
    assert pinned > 0
    headers = {"Authorization": f"Bearer {KEY}"}
    assert httpx.delete(base_url + "/v1/sessions/s1", headers=headers).json()["deleted"]
    gone = httpx.delete(base_url + "/v1/sessions/s1", headers=headers)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "session_not_found"
    assert_clean(rt)
    client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=8,
                                   extra_body={"session": {"id": "s2", "ttl_s": 0.3}})
    assert_clean(rt, timeout=10)  # released by its TTL


def test_sessions_give_way_under_pressure():
    """Pinned sessions are bounded by the pool: a request that needs their pages gets them,
    the longest idle session released first; a running request is never touched."""
    small = Runtime.load(draft=False, cache=CacheConfig(page_size=16, num_pages=48))
    try:
        with running(create_app(small)) as url:
            c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            story = " ".join(f"item{i}" for i in range(90))
            for sid in ("old", "new"):  # each pins ~20 of the 48 pages
                c.chat.completions.create(
                    model=MODEL, temperature=0, max_tokens=8, extra_body={
                        "session": {"id": sid, "ttl_s": 600}},
                    messages=[{"role": "user", "content": f"{sid}: {story}"}])
                time.sleep(0.05)
            pinned = small.stats()["pages_pinned"]
            assert pinned > 48 // 2
            # needs ~24 pages: more than the unpinned rest, fewer than after one release
            r = c.chat.completions.create(model=MODEL, temperature=0, max_tokens=200,
                                          messages=[{"role": "user", "content": story}])
            assert r.choices[0].message is not None
            assert httpx.delete(url + "/v1/sessions/old").status_code == 404  # released
            assert httpx.delete(url + "/v1/sessions/new").status_code == 200  # kept
        assert_clean(small)
    finally:
        small.close()


def test_n_choices_share_the_prompt(client):
    fresh = [SYSTEM, {"role": "user", "content": "Which city should I visit in n-choice spring?"}]
    r = client.chat.completions.create(model=MODEL, messages=fresh, temperature=1.0, seed=7,
                                       n=3, max_tokens=24)
    assert [c.index for c in r.choices] == [0, 1, 2]
    # one shared prefill of the prompt, then each choice computes only its last token
    assert r.usage.model_extra["agentflash"]["compute"]["prefill_tokens_computed"] == 3
    assert len({c.message.content for c in r.choices}) > 1  # seeds 7, 8, 9
    greedy = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, n=2,
                                            max_tokens=24)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
    assert greedy.usage.completion_tokens == 2 * client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=24).usage.completion_tokens


def test_n_choices_stream(client, rt):
    """Streamed n > 1: every choice's deltas, under its index, as the same request unstreamed
    gives them; through a real server and through the app in process (ASGI), where the choices'
    merge once failed as the response body began iterating it in another task."""
    whole = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, n=2,
                                           max_tokens=16)
    texts: dict[int, str] = {}
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, n=2,
                                                max_tokens=16, stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert texts == {c.index: c.message.content for c in whole.choices}
    with starlette.testclient.TestClient(create_app(rt)) as local:
        r = local.post("/v1/completions", json={"model": rt.model_name, "prompt": "The weather",
                                                "n": 3, "max_tokens": 4, "stream": True})
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        events = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
        assert {c["index"] for e in events for c in e["choices"]} == {0, 1, 2}


def test_stop_strings_are_cut(client):
    plain = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0,
                                           max_tokens=48).choices[0].message.content
    words = plain.split()
    assert len(words) > 3
    stop = " " + words[2]
    cut = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0,
                                         max_tokens=48, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == plain[:plain.index(stop)].strip()
    text, _, finish, _ = _collect(client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=48, stop=stop, stream=True))
    assert text.strip() == cut.choices[0].message.content and finish == "stop"


def test_raw_completions(client, rt):
    ids = rt.chat.encode("The weather today is")
    by_text = client.completions.create(model=MODEL, prompt="The weather today is",
                                        temperature=0, max_tokens=16)
    by_ids = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=16)
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.usage.prompt_tokens == len(ids)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=ids, temperature=0, max_tokens=16, stream=True) if c.choices)
    assert streamed == by_ids.choices[0].text
    two = client.completions.create(model=MODEL, prompt=["a", "b"], temperature=0, max_tokens=4)
    assert [c.index for c in two.choices] == [0, 1]


def test_metrics(client, base_url):
    client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=8)
    text = httpx.get(base_url + "/metrics").text
    for name in ("agentflash_prompt_tokens_total", "agentflash_cached_tokens_total",
                 "agentflash_completion_tokens_total", "agentflash_accepted_tokens_total",
                 'agentflash_kv_pages{state="free"}', "agentflash_http_requests_in_flight",
                 'agentflash_engine_requests{state="waiting"}', "agentflash_sessions"):
        assert name in text, name


def test_errors_in_openai_shape(client, base_url, rt):
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=base_url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="other", messages=ASK)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[])
    assert "messages" in e.value.message
    with pytest.raises(openai.BadRequestError, match="get_nothing"):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                       tool_choice={"type": "function",
                                                    "function": {"name": "get_nothing"}})
    with pytest.raises(openai.BadRequestError, match="parameters"):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[
            {"type": "function", "function": {"name": "bad", "parameters": {"type": "array"}}}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"a": {"type": "no-such-type"}}}}})
    long = [{"role": "user", "content": "word " * 5000}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=long, max_tokens=8)
    assert e.value.code == "context_length_exceeded"
    assert str(rt.engine.max_model_len) in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=10**6)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard",
                                                               "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=ASK, temperature=-1)
    headers = {"Authorization": f"Bearer {KEY}"}
    big = httpx.post(base_url + "/v1/chat/completions", headers=headers,
                     content=b'{"x": "' + b"a" * (9 << 20) + b'"}')
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    bad_json = httpx.post(base_url + "/v1/chat/completions", headers=headers,
                          content=b"{not json")
    assert bad_json.status_code == 400 and "error" in bad_json.json()
    route = httpx.get(base_url + "/v1/nothing-here", headers=headers)
    assert route.status_code == 404 and "error" in route.json()


def test_queue_full_gets_429(rt, monkeypatch):
    with running(create_app(rt, max_in_flight=1)) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        # the first request holds the only slot until its stream ends, which it cannot while
        # the engine is held
        gate = EngineGate(rt, monkeypatch)
        stream = c.chat.completions.create(model=MODEL, messages=ASK, temperature=0,
                                           max_tokens=1000, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        gate.wait()
        with pytest.raises(openai.RateLimitError) as e:
            c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4)
        assert e.value.response.headers["retry-after"] == "1"
        stream.close()
        gate.release()
    assert_clean(rt)


def test_disconnect_mid_stream_frees_kv(client, rt):
    for _ in range(3):
        stream = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0,
                                                max_tokens=400, stream=True)
        chunks = iter(stream)
        next(chunks), next(chunks)
        stream.close()  # the client goes away mid-generation
    assert_clean(rt)
    # the server is fine afterwards
    assert client.chat.completions.create(model=MODEL, messages=ASK, temperature=0,
                                          max_tokens=4).choices[0].message is not None


def test_disconnect_before_a_plain_response_frees_kv(rt, monkeypatch):
    """A non-streamed request whose client goes away is aborted, not run to its end: the
    engine is held from the request's first step until the server has answered 499 to
    nobody, so the generation cannot have finished."""
    app = create_app(rt, api_key=KEY)
    server = app.state.server
    body = {"model": MODEL, "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
            "messages": [SYSTEM, {"role": "user", "content": "Tell me a long story."}]}
    gate = EngineGate(rt, monkeypatch)

    async def leave(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}
                                     ) as c:
            async with anyio.create_task_group() as tg:
                tg.start_soon(functools.partial(c.post, "/v1/chat/completions", json=body))
                await gate.wait_async()   # generating, and it cannot finish now
                tg.cancel_scope.cancel()  # the client goes away

    with running(app) as url:
        anyio.run(leave, url)
        deadline = time.monotonic() + EngineGate.HANG_S
        while server.in_flight:  # the server notices (it polls) and gives the request up
            assert time.monotonic() < deadline, "the server never noticed the client leave"
            time.sleep(0.05)
        gate.release()
        assert_clean(rt)
        metrics = httpx.get(url + "/metrics").text
    assert gate.running == 1
    assert 'agentflash_requests_total{endpoint="/v1/chat/completions",status="499"} 1.0' \
        in metrics, [line for line in metrics.splitlines() if "requests_total" in line]


@pytest.mark.anyio
async def test_async_client_concurrent_turns(aclient, rt):
    async def agent(i: int) -> int:
        messages = [SYSTEM, {"role": "user", "content": f"Weather in city number {i}?"}]
        cached = 0
        for _ in range(2):
            r = await aclient.chat.completions.create(model=MODEL, messages=messages,
                                                      tools=[WEATHER], temperature=0,
                                                      max_tokens=32)
            cached = r.usage.prompt_tokens_details.cached_tokens
            messages += [r.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": "Thanks. Anything else?"}]
        return cached

    results: list[int] = []

    async def run(i: int) -> None:
        results.append(await agent(i))

    async with anyio.create_task_group() as tg:
        for i in range(6):
            tg.start_soon(run, i)
    assert len(results) == 6 and all(c > 0 for c in results)
    await aclient.close()
    await anyio.to_thread.run_sync(assert_clean, rt)


def test_load_64_streaming_agents_and_20_disconnects(base_url, rt):
    """64 concurrent streaming agents x 5 turns, each resending its growing history, all
    complete (tools/bench_server.py's workload); then 20 clients that go away mid-stream at
    once; nothing is left pinned or referenced."""
    result = anyio.run(functools.partial(bench_server.workload, base_url, MODEL, 64, 5, 12, KEY,
                                         warm_up=False))
    assert result["requests"] == 64 * 5
    print(f"\nload: 64 agents x 5 turns: TTFT p50 {result['ttft_p50_ms']:.0f} ms, "
          f"p99 {result['ttft_p99_ms']:.0f} ms, {result['completion_tok_s']:.0f} completion "
          f"tok/s, {result['cached_share']:.0%} of prompt tokens cached")
    assert result["cached_share"] > 0.5

    async def leave(client: openai.AsyncOpenAI, i: int) -> None:
        stream = await client.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=300, stream=True,
            messages=[SYSTEM, {"role": "user", "content": f"Tell me a long story, {i}."}])
        async for _ in stream:
            break
        await stream.close()

    async def disconnects() -> None:
        async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=KEY,
                                      max_retries=0) as client:
            async with anyio.create_task_group() as tg:
                for i in range(20):
                    tg.start_soon(leave, client, i)

    anyio.run(disconnects)
    assert_clean(rt)


def test_agentflash_serve_command(tmp_path):
    """The CLI: `agentflash serve` binds 127.0.0.1 by default and honours --api-key (and takes
    a step budget and a prefill-first bound of its own)."""
    port = free_port()
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "agentflash", "serve", "--port", str(port), "--no-draft",
           "--api-key", KEY, "--served-model-name", "served", "--max-batch-tokens", "64",
           "--prefill-first-steps", "0"]
    with http_server(cmd, port, log, start_s=300) as url:
        assert f"http://127.0.0.1:{port}" in log.read_text()
        c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        r = c.chat.completions.create(model="served", messages=ASK, temperature=0,
                                      max_tokens=4)
        assert r.usage.completion_tokens == 4
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
