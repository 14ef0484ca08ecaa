"""The OpenAI Agents SDK's own agent loop (Runner.run / Runner.run_streamed) on the embedded model
through AgentflashModel / AgentflashProvider: constrained structured output, a forced tool call
whose resent history hits the prefix cache, a second turn served from the cache, streaming, a
forced handoff, and cancelled runs leaving the KV pool clean."""

from __future__ import annotations

import asyncio
import json

import agents
import pydantic
import pytest
from agents import (Agent, HandoffCallItem, ModelSettings, RunConfig, Runner, ToolCallItem,
                    ToolCallOutputItem, function_tool, handoff)
from openai.types.responses import ResponseTextDeltaEvent

from agentflash import Runtime
from agentflash.integrations.openai_agents import AgentflashModel, AgentflashProvider
from conftest import EngineGate
from test_server import assert_clean

agents.set_tracing_disabled(True)  # no network: nothing to export traces to

GREEDY = ModelSettings(temperature=0)


class City(pydantic.BaseModel):
    name: str
    population: int


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def assert_cached_to_reply_end(first: agents.Usage, second: agents.Usage) -> None:
    """The second call's prompt was served from the cache through the first call's reply (all
    of it but its last token, which the first call never fed back), in the SDK's usage."""
    cached = second.input_tokens_details.cached_tokens
    assert second.input_tokens > first.total_tokens
    assert cached >= first.total_tokens - 1
    assert cached / second.input_tokens >= 0.8


@pytest.mark.anyio
async def test_structured_output(rt):
    agent = Agent(name="geo", instructions="Answer in JSON.", output_type=City,
                  model=AgentflashModel(rt), model_settings=GREEDY)
    result = await Runner.run(agent, "Give the largest city of France as JSON.")
    assert isinstance(result.final_output, City)
    [message] = result.raw_responses[-1].output
    assert City.model_validate_json(message.content[0].text) == result.final_output
    usage = result.context_wrapper.usage
    assert usage.requests == 1 and usage.input_tokens > 0 and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


@pytest.mark.anyio
async def test_forced_tool_call_and_its_history_from_the_cache(rt):
    agent = Agent(name="calc", instructions="Add numbers with the add tool.", tools=[add],
                  tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(temperature=0, tool_choice="required"))
    config = RunConfig(model_provider=AgentflashProvider(rt))
    result = await Runner.run(agent, "What is 2 plus 3?", run_config=config)
    [call] = [i.raw_item for i in result.new_items if isinstance(i, ToolCallItem)]
    [output] = [i for i in result.new_items if isinstance(i, ToolCallOutputItem)]
    assert call.name == "add"
    arguments = json.loads(call.arguments)
    assert set(arguments) == {"a", "b"} and all(type(v) is int for v in arguments.values())
    assert output.raw_item["call_id"] == call.call_id
    assert output.output == arguments["a"] + arguments["b"]
    assert result.final_output == str(output.output)  # stop_on_first_tool: the tool's output

    # the resent history (the call with its id and arguments, then its result) continues from
    # the exact tokens of the first reply (re-rendering the call would miss from the call on)
    history = result.to_input_list() + [{"role": "user", "content": "And 4 plus 5?"}]
    again = await Runner.run(agent, history, run_config=config)
    assert_cached_to_reply_end(result.raw_responses[0].usage, again.raw_responses[0].usage)


@pytest.mark.anyio
async def test_second_turn_reads_the_first_from_the_cache(rt):
    settings = ModelSettings(temperature=0, max_tokens=16)
    agent = Agent(name="chat", instructions="You are a helpful assistant. " * 20,
                  model=AgentflashModel(rt), model_settings=settings)
    first = await Runner.run(agent, "Hello!")
    assert first.final_output
    history = first.to_input_list() + [{"role": "user", "content": "Tell me more."}]
    second = await Runner.run(agent, history)
    assert_cached_to_reply_end(first.context_wrapper.usage, second.context_wrapper.usage)


@pytest.mark.anyio
async def test_streamed_text_is_the_final_output(rt):
    agent = Agent(name="chat", instructions="Be brief.", model=AgentflashModel(rt),
                  model_settings=ModelSettings(temperature=0, max_tokens=12))
    plain = await Runner.run(agent, "Say hello to the world.")
    result = Runner.run_streamed(agent, "Say hello to the world.")
    deltas = [e.data.delta async for e in result.stream_events()
              if e.type == "raw_response_event" and isinstance(e.data, ResponseTextDeltaEvent)]
    assert len(deltas) > 1
    assert "".join(deltas) == result.final_output
    assert result.final_output.strip() == plain.final_output  # the same greedy reply
    usage = result.context_wrapper.usage
    assert usage.requests == 1 and usage.output_tokens == plain.context_wrapper.usage.output_tokens
    assert usage.input_tokens == plain.context_wrapper.usage.input_tokens
    # the streamed usage carries the cache hit: the same prompt, all but its last token
    assert usage.input_tokens_details.cached_tokens == usage.input_tokens - 1


@pytest.mark.anyio
async def test_forced_handoff_streamed(rt):
    model = AgentflashModel(rt)
    support = Agent(name="Support", instructions="Answer the user's question briefly.",
                    model=model, model_settings=ModelSettings(temperature=0, max_tokens=12))
    transfer = handoff(support)
    triage = Agent(name="Triage", instructions="Hand every user over to support.",
                   handoffs=[transfer], model=model,
                   model_settings=ModelSettings(temperature=0, tool_choice=transfer.tool_name))
    result = Runner.run_streamed(triage, "My printer is broken.")
    events = [e async for e in result.stream_events()]
    assert result.last_agent is support
    assert [e.new_agent.name for e in events if e.type == "agent_updated_stream_event"] == [
        "Triage", "Support"]
    [call] = [i.raw_item for i in result.new_items if isinstance(i, HandoffCallItem)]
    assert call.name == transfer.tool_name and json.loads(call.arguments) == {}
    assert isinstance(result.final_output, str) and result.final_output
    assert result.context_wrapper.usage.requests == 2


def teller(rt: Runtime) -> Agent:
    """An agent whose reply runs to its token limit: long enough to be cancelled mid-way."""
    return Agent(name="teller", instructions="You are a helpful assistant.",
                 model=AgentflashModel(rt),
                 model_settings=ModelSettings(temperature=0, max_tokens=2000))


@pytest.mark.anyio
async def test_cancelled_run_frees_its_kv(rt, monkeypatch):
    gate = EngineGate(rt, monkeypatch)
    task = asyncio.create_task(Runner.run(teller(rt), "Tell me a very long story."))
    await gate.wait_async()  # generating, and it cannot finish now
    assert not task.done() and gate.running == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    gate.release()
    assert_clean(rt)


@pytest.mark.anyio
async def test_cancelled_stream_frees_its_kv(rt, monkeypatch):
    result = Runner.run_streamed(teller(rt), "Tell me a very long story.")
    texts = 0
    async for event in result.stream_events():
        if event.type == "raw_response_event" and isinstance(event.data, ResponseTextDeltaEvent):
            texts += 1
            if texts == 1:
                gate = EngineGate(rt, monkeypatch)
                await gate.wait_async()  # still generating, and it cannot finish now
                assert gate.running == 1
                result.cancel()
    gate.release()
    assert texts >= 1 and result.raw_responses == []  # cancelled before the reply ended
    assert_clean(rt)


@pytest.mark.anyio
async def test_what_cannot_run_is_refused_before_generating(rt):
    model = AgentflashModel(rt)
    with pytest.raises(agents.UserError, match="function tools only"):
        await Runner.run(Agent(name="web", tools=[agents.WebSearchTool()], model=model), "Hi")
    with pytest.raises(agents.UserError, match="no server-side conversation state"):
        await Runner.run(Agent(name="chat", model=model), "Hi", previous_response_id="resp_1")
    assert_clean(rt)
