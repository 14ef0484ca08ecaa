"""pydantic-ai's own agent loop on the embedded model through AgentflashModel: structured output
(native and tool output, both constrained), a forced tool call, a second turn served from the
prefix cache, streaming, and cancelled runs leaving the KV pool clean."""

from __future__ import annotations

import anyio
import pydantic
import pytest
from pydantic_ai import Agent, NativeOutput
from pydantic_ai.exceptions import ModelContextWindowExceededError, ModelRequestRejectedError
from pydantic_ai.messages import ModelResponse, PartDeltaEvent, PartStartEvent, TextPart, \
    ToolCallPart
from pydantic_ai.settings import ModelSettings

from agentflash.errors import ContextLengthError
from agentflash.integrations.pydantic_ai import AgentflashModel
from conftest import EngineGate
from test_server import assert_clean

GREEDY = ModelSettings(temperature=0.0, max_tokens=64)


class City(pydantic.BaseModel):
    name: str
    population: int


def responses(messages: list) -> list[ModelResponse]:
    return [m for m in messages if isinstance(m, ModelResponse)]


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["native", "tool"])
async def test_structured_output_is_constrained_to_validate(rt, mode):
    output_type = NativeOutput(City) if mode == "native" else City
    agent = Agent(AgentflashModel(rt, settings=GREEDY), output_type=output_type,
                  instructions="Answer in JSON.")
    result = await agent.run("Give the largest city of France as JSON.")
    assert isinstance(result.output, City)
    (response,) = responses(result.all_messages())  # valid at the first try: no retry
    if mode == "native":
        (part,) = response.parts
        assert isinstance(part, TextPart)
        assert City.model_validate_json(part.content) == result.output
    else:
        (call,) = response.parts
        assert isinstance(call, ToolCallPart) and call.tool_name == "final_result"
        assert City.model_validate(call.args) == result.output
    usage = response.usage
    assert usage.input_tokens > 0 and usage.output_tokens > 0
    assert usage.details["drafts"] > 0 and 0 < usage.details["accepted_tokens"] <= \
        usage.details["draft_tokens"]


@pytest.mark.anyio
async def test_forced_tool_call_runs_with_valid_arguments(rt):
    ran: list[tuple[int, int]] = []

    def add(a: int, b: int) -> int:
        """Add two integers."""
        ran.append((a, b))
        return a + b

    agent = Agent(AgentflashModel(rt, settings=GREEDY), tools=[add],
                  instructions="Use the add tool.")
    # the first request must call add, the next answers in (a little) text
    result = await agent.run("What is 2 plus 3?", model_settings=lambda ctx: ModelSettings(
        tool_choice=["add"], max_tokens=64) if ctx.run_step == 1 else ModelSettings(
        tool_choice="none", max_tokens=16))
    first, last = responses(result.all_messages())
    (call,) = first.parts
    assert isinstance(call, ToolCallPart) and call.tool_name == "add"
    args = call.args_as_dict()
    assert set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values())
    assert ran == [(args["a"], args["b"])]
    assert first.finish_reason == "tool_call"
    assert not any(isinstance(p, ToolCallPart) for p in last.parts)


@pytest.mark.anyio
async def test_second_turn_is_served_from_the_prefix_cache(rt):
    # long instructions: the second turn's new tokens are a small part of its prompt
    agent = Agent(AgentflashModel(rt, settings=GREEDY), output_type=NativeOutput(City),
                  instructions=" ".join(["Answer in JSON."] + [
                      f"Rule {i}: give the city's name and its population as an integer."
                      for i in range(1, 9)]))
    first = await agent.run("Give the largest city of France as JSON.")
    second = await agent.run("Give the largest city of Spain as JSON.",
                             message_history=first.all_messages())
    (before,) = responses(first.new_messages())
    (after,) = responses(second.new_messages())
    assert isinstance(second.output, City)
    # the prefix cache reaches into the first reply: its exact tokens were reused
    assert after.usage.cache_read_tokens > before.usage.input_tokens
    assert after.usage.cache_read_tokens >= 0.8 * after.usage.input_tokens
    assert second.usage.cache_read_tokens == after.usage.cache_read_tokens


@pytest.mark.anyio
async def test_streamed_text_deltas_join_to_the_final_text(rt):
    agent = Agent(AgentflashModel(rt, settings=ModelSettings(temperature=0.0, max_tokens=24)),
                  instructions="You are a helpful assistant.")
    async with agent.run_stream("Say hello.") as stream:
        deltas = [d async for d in stream.stream_text(delta=True, debounce_by=None)]
        output = await stream.get_output()
        response = stream.response
    assert len(deltas) > 1 and all(deltas)
    assert "".join(deltas) == output
    (part,) = response.parts
    assert isinstance(part, TextPart) and part.content == output
    assert response.usage.output_tokens > 0 and response.finish_reason in ("stop", "length")


@pytest.mark.anyio
async def test_cancelled_runs_free_their_kv(rt, monkeypatch):
    agent = Agent(AgentflashModel(rt, settings=ModelSettings(temperature=0.0, max_tokens=400)),
                  instructions="You are a helpful assistant.")
    started = anyio.Event()

    async def stream() -> None:
        async with agent.run_stream_events("Write a long story about a dragon.") as events:
            async for event in events:
                if isinstance(event, (PartStartEvent, PartDeltaEvent)):
                    started.set()

    async def run() -> None:
        await agent.run("Write a long story about a knight.")

    for work in (stream, run):
        async with anyio.create_task_group() as tg:
            tg.start_soon(work)
            if work is stream:
                await started.wait()   # the first tokens have arrived
            gate = EngineGate(rt, monkeypatch)
            await gate.wait_async()    # still generating, and it cannot finish now
            assert gate.running == 1
            tg.cancel_scope.cancel()
        gate.release()
        monkeypatch.undo()
        assert_clean(rt)


@pytest.mark.anyio
async def test_agentflash_errors_become_model_errors(rt):
    agent = Agent(AgentflashModel(rt, settings=ModelSettings(max_tokens=10**6)))
    with pytest.raises(ModelContextWindowExceededError) as e:
        await agent.run("Hello.")
    assert isinstance(e.value.__cause__, ContextLengthError)
    agent = Agent(AgentflashModel(rt, settings=ModelSettings(temperature=-1.0)))
    with pytest.raises(ModelRequestRejectedError, match="temperature"):
        await agent.run("Hello.")
    assert_clean(rt)
