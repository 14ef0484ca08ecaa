"""ChatAgentflash (agentflash.integrations.langchain) on the embedded model: structured output
(with_structured_output, create_agent's response_format), forced tool calls and an agent run
that executes its tool, a resent history read from the prefix cache, streaming equal to
invoke, sync calls from plain code, and a cancelled ainvoke leaving the KV pool clean."""

from __future__ import annotations

import asyncio

import anyio
import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import wrap_model_call
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel
from conftest import EngineGate
from test_server import assert_clean

from agentflash.integrations.langchain import ChatAgentflash


@pytest.fixture
def model(rt):
    return ChatAgentflash(runtime=rt, temperature=0.0, max_tokens=48)


class City(BaseModel):
    name: str
    population: int


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


CITY_PROMPT = [SystemMessage("Answer in JSON."),
               HumanMessage("Give the largest city of France as JSON.")]
CITY_FORMAT = {"type": "json_schema",
               "json_schema": {"name": "City", "schema": City.model_json_schema()}}
ADD_PROMPT = "Add 4 and 5 with the add tool."


def cached_share(message: AIMessage) -> float:
    usage = message.usage_metadata
    assert usage is not None
    return usage["input_token_details"]["cache_read"] / usage["input_tokens"]


def test_with_structured_output(model):
    city = model.with_structured_output(City, method="json_schema").invoke(CITY_PROMPT)
    assert isinstance(city, City)
    raw = model.with_structured_output(City, method="json_schema", include_raw=True).invoke(
        CITY_PROMPT)
    assert raw["parsing_error"] is None and raw["parsed"] == city
    assert City.model_validate_json(raw["raw"].content) == city
    called = model.with_structured_output(City, method="function_calling").invoke(CITY_PROMPT)
    assert isinstance(called, City)


@pytest.mark.anyio
async def test_agent_structured_response(model):
    # the profile says structured_output: a bare schema becomes a ProviderStrategy, i.e. the
    # reply's text constrained to the schema (ToolStrategy would answer with a tool call)
    agent = create_agent(model, tools=[], system_prompt="Answer in JSON.", response_format=City)
    state = await agent.ainvoke({"messages": [CITY_PROMPT[1]]})
    assert isinstance(state["structured_response"], City)
    last = state["messages"][-1]
    assert isinstance(last, AIMessage) and not last.tool_calls
    assert City.model_validate_json(last.content) == state["structured_response"]


def test_forced_tool_call(model):
    reply = model.bind_tools([add], tool_choice="add").invoke(ADD_PROMPT)
    assert reply.response_metadata["finish_reason"] == "tool_calls"
    [call] = reply.tool_calls
    assert call["name"] == "add" and call["id"].startswith("call_")
    add.args_schema.model_validate(call["args"])
    assert set(call["args"]) == {"a", "b"}


@wrap_model_call
def add_then_answer(request, handler):
    """The first model call must call add; once a result is in, the model answers in text."""
    answered = any(isinstance(m, ToolMessage) for m in request.messages)
    return handler(request.override(tool_choice="none" if answered else "add"))


def test_agent_runs_the_tool(model):
    agent = create_agent(model, tools=[add], middleware=[add_then_answer])
    state = agent.invoke({"messages": [HumanMessage(ADD_PROMPT)]})
    human, called, result, answer = state["messages"]
    [call] = called.tool_calls
    assert call["name"] == "add"
    assert isinstance(result, ToolMessage) and result.tool_call_id == call["id"]
    assert result.content == str(call["args"]["a"] + call["args"]["b"])
    assert isinstance(answer, AIMessage) and not answer.tool_calls
    # LangChain resent the history: the prompt came from the cache through the first reply
    assert cached_share(answer) >= 0.8, answer.usage_metadata


def test_resent_history_is_cached(model):
    tools = model.bind_tools([add], tool_choice="add")
    history = [HumanMessage(ADD_PROMPT)]
    first = tools.invoke(history)
    [call] = first.tool_calls
    history += [first, ToolMessage(str(add.invoke(call["args"])), tool_call_id=call["id"])]
    second = model.bind_tools([add], tool_choice="none").invoke(history)
    assert cached_share(second) >= 0.8, second.usage_metadata
    usage, before = second.usage_metadata, first.usage_metadata
    assert usage["input_token_details"]["cache_read"] >= \
        before["input_tokens"] + before["output_tokens"] - 1
    third = tools.invoke(history + [second, HumanMessage("Now add 2 and 3.")])
    assert cached_share(third) >= 0.8, third.usage_metadata


def test_sync_invoke_and_stream(model):
    json_model = model.bind(response_format=CITY_FORMAT)
    reply = json_model.invoke(CITY_PROMPT)
    assert isinstance(reply, AIMessage) and reply.content
    assert reply.usage_metadata["output_tokens"] > 0
    assert reply.response_metadata["model_name"] == model.runtime.model_name
    chunks = list(json_model.stream(CITY_PROMPT))
    assert len(chunks) > 2
    assert "".join(c.content for c in chunks) == reply.content
    usage = chunks[-1].usage_metadata
    assert (usage["input_tokens"], usage["output_tokens"]) == \
        (reply.usage_metadata["input_tokens"], reply.usage_metadata["output_tokens"])


@pytest.mark.anyio
async def test_astream_equals_ainvoke(model):
    json_model = model.bind(response_format=CITY_FORMAT)
    reply = await json_model.ainvoke(CITY_PROMPT)
    chunks = [c async for c in json_model.astream(CITY_PROMPT)]
    assert len(chunks) > 2 and "".join(c.content for c in chunks) == reply.content
    # a sync call from a thread that runs an event loop works too
    assert json_model.invoke(CITY_PROMPT).content == reply.content
    tools = model.bind_tools([add], tool_choice="add")
    called = await tools.ainvoke(ADD_PROMPT)
    merged, pieces = None, 0
    async for chunk in tools.astream(ADD_PROMPT):
        merged = chunk if merged is None else merged + chunk
        pieces += bool(chunk.tool_call_chunks)
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == \
        [(c["name"], c["args"]) for c in called.tool_calls]
    assert pieces > 2  # the call streams as it is written: its name, then its arguments
    assert merged.usage_metadata["output_tokens"] == called.usage_metadata["output_tokens"]
    assert merged.response_metadata["finish_reason"] == "tool_calls"
    # the streamed message round-trips too: resent, it is read from the cache
    [call] = merged.tool_calls
    after = await model.bind_tools([add], tool_choice="none").ainvoke([
        HumanMessage(ADD_PROMPT), merged, ToolMessage("9", tool_call_id=call["id"])])
    assert cached_share(after) >= 0.8, after.usage_metadata


@pytest.mark.anyio
async def test_cancelled_ainvoke_frees_kv(rt, monkeypatch):
    model = ChatAgentflash(runtime=rt, max_tokens=1024)
    gate = EngineGate(rt, monkeypatch)
    task = asyncio.create_task(model.ainvoke("Write a short poem about the sea."))
    await gate.wait_async()  # generating, and it cannot finish now
    assert not task.done() and gate.running == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    gate.release()
    assert_clean(rt)
