"""The agent SDK on the embedded model: sessions that keep KV across turns, tools (typed,
schema-only, failing, slow), constrained tool calls and structured output inside the speculative
loop, streaming, fork, concurrency, cancellation, and a KV pool left clean afterwards."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import anyio
import jsonschema
import pydantic
import pytest

from agentflash import Agent, Runtime, StepEvent, TextEvent, ToolCallEvent, tool
from agentflash.errors import (AgentClosedError, ContextLengthError, MissingToolResultError,
                               ToolDefinitionError, ToolSchemaError)
from conftest import EngineGate

SAMPLE = Path(__file__).parent / "data" / "bfcl_sample.jsonl"


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def explode(reason: str) -> str:
    """Always fails."""
    raise ValueError(f"boom: {reason}")


@tool(timeout=0.2)
async def slow(seconds: int) -> str:
    """Never finishes: it waits on an event nobody sets."""
    await anyio.Event().wait()
    return "done"


LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Look a word up in the caller's dictionary.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}},
                   "required": ["word"]}}}


def assert_clean(rt: Runtime) -> None:
    stats = rt.stats()
    assert stats["pages_pinned"] == 0 and stats["pages_referenced"] == 0, stats
    assert stats["running"] == 0 and stats["waiting"] == 0
    rt._call(rt.engine.kv.check_integrity)


def assert_usage_invariants(step) -> None:
    u = step.usage
    assert u.prompt_tokens == u.prompt_tokens_details.cached_tokens + \
        u.compute.prefill_tokens_computed
    d = u.completion_tokens_details
    # Predicted Outputs only (OpenAI's meaning): agents send no prediction; DFlash counts apart
    assert d.accepted_prediction_tokens == d.rejected_prediction_tokens == 0
    assert u.timing.ttft_s <= u.timing.total_s and u.timing.tool_s <= u.timing.total_s


@pytest.mark.anyio
async def test_turn_n_prefills_only_its_new_tokens(rt):
    async with Agent(rt, "You are a helpful assistant.", tools=[add], max_tokens=48) as agent:
        first = await agent.step("What is 2 plus 3? Use the add tool.")
        assert [c.name for c in first.tool_calls] == ["add"]
        call = first.tool_calls[0]
        assert first.tool_results[0].content == str(call.arguments["a"] + call.arguments["b"])
        second = await agent.step()            # answers from the tool result
        third = await agent.step("Thanks. Now add 7 and 8.")
        for prev, step in ((first, second), (second, third)):
            # everything the model saw or wrote before is cached except the last token of its
            # reply (sampled, never fed back)
            assert step.usage.prompt_tokens_details.cached_tokens == \
                prev.usage.prompt_tokens + prev.usage.completion_tokens - 1
            assert step.usage.compute.prefill_tokens_computed < 40
        for step in (first, second, third):
            assert_usage_invariants(step)
        assert rt.stats()["pages_pinned"] > 0
    assert_clean(rt)


@pytest.mark.anyio
async def test_agents_keep_their_own_tokens_not_the_reply_memory(rt):
    """An agent passes its exact History with each step, so its turns add nothing to the
    runtime's memory of replies (that serves clients that resend whole histories)."""
    before = len(rt.replies)
    async with Agent(rt, "You are a helpful assistant.", max_tokens=8) as agent:
        await agent.step("Say hello.")
        second = await agent.step("Thanks.")
    assert len(rt.replies) == before
    assert second.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.anyio
async def test_a_reply_ended_by_another_eos_closes_its_turn(rt, tmp_path):
    """A reply that stops at an eos other than the end-of-turn token (generation_config.json's
    <|endoftext|>, here a token the reply is known to hold) ends its turn in the session with the
    end-of-turn token, as the chat template renders it, and the next turn reuses its KV."""
    import json
    import shutil

    from agentflash.embedded import embedded_model_dir

    async with Agent(rt, "You are a helpful assistant.", max_tokens=24) as agent:
        step = await agent.step("Say hello.")
        reply = list(agent._history.tokens)[step.usage.prompt_tokens:]
    # a token first written after the reply's start, and not an eos already
    cut = next(k for k, t in enumerate(reply)
               if k >= 2 and t not in reply[:k] and t not in rt.eos_ids)
    model_dir = tmp_path / "model"
    shutil.copytree(embedded_model_dir(), model_dir)
    gen = json.loads((model_dir / "generation_config.json").read_text())
    gen["eos_token_id"] = [*gen["eos_token_id"], reply[cut]]
    (model_dir / "generation_config.json").write_text(json.dumps(gen))
    runtime = Runtime.load(model_dir)
    try:
        async with Agent(runtime, "You are a helpful assistant.", max_tokens=24) as agent:
            first = await agent.step("Say hello.")
            assert first.usage.completion_tokens == cut + 1
            tokens = list(agent._history.tokens)
            assert tokens[-cut - 1:] == reply[:cut] + [runtime.chat.eos_token_id]
            second = await agent.step("Thanks.")
            assert second.usage.prompt_tokens_details.cached_tokens == \
                first.usage.prompt_tokens + cut
        assert_clean(runtime)
    finally:
        runtime.close()


@pytest.mark.anyio
async def test_constrained_calls_validate_and_speculation_changes_nothing(rt):
    """A sample of BFCL function schemas (tools/eval_constrained.py runs all of them)."""
    cases = [json.loads(line) for line in SAMPLE.read_text().splitlines()]
    outputs: dict[tuple[int, bool], list] = {}

    async def one(i: int, speculative: bool) -> None:
        case = cases[i]
        async with Agent(rt, tools=case["tools"], tool_choice=case["function"], max_tokens=160,
                         speculative=speculative) as agent:
            step = await agent.step(case["question"])
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in case["tools"]}
        if step.finish_reason == "length":   # the model may ramble inside an argument
            assert not step.tool_calls
        else:
            assert [c.name for c in step.tool_calls][:1] == [case["function"]]
            assert not step.malformed_calls
            for c in step.tool_calls:
                jsonschema.validate(c.arguments, schemas[c.name])
        outputs[i, speculative] = [step.finish_reason, [(c.name, c.arguments)
                                                        for c in step.tool_calls]]

    async with anyio.create_task_group() as tg:   # all 20 agents batched together
        for i in range(len(cases)):
            for speculative in (True, False):
                tg.start_soon(one, i, speculative)
    for i in range(len(cases)):
        assert outputs[i, True] == outputs[i, False], cases[i]["id"]
    completed = sum(outputs[i, True][0] == "stop" for i in range(len(cases)))
    assert completed >= len(cases) // 2
    assert_clean(rt)


@pytest.mark.anyio
async def test_structured_output(rt):
    class City(pydantic.BaseModel):
        name: str
        population: int

    async with Agent(rt, "Answer in JSON.", output_type=City, max_tokens=64) as agent:
        step = await agent.step("Give the largest city of France as JSON.")
    assert step.is_final and isinstance(step.output, City)
    assert City.model_validate_json(step.message) == step.output


@pytest.mark.anyio
async def test_a_step_may_set_its_own_tool_choice(rt):
    """After a forced call, tool_choice="none" for one step answers from the tool result, in
    the output type (the embedded model would call tools for as long as it may)."""
    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=32)
        country: str = pydantic.Field(max_length=32)

    async with Agent(rt, "Answer in JSON.", tools=[add], output_type=City, tool_choice="add",
                     max_tokens=256) as agent:
        first = await agent.step("Give the largest city of France as JSON.")
        assert first.tool_calls[0].name == "add" and not first.is_final
        final = await agent.step(tool_choice="none")
        assert final.is_final and not final.tool_calls and isinstance(final.output, City)
        with pytest.raises(ToolDefinitionError):
            await agent.step("Again.", tool_choice="subtract")
        assert agent.messages[-1]["role"] == "assistant"   # the bad step changed nothing


@pytest.mark.anyio
async def test_stream_yields_text_calls_and_steps(rt):
    async with Agent(rt, tools=[add], max_tokens=48) as agent:
        events = [e async for e in agent.stream("Add 4 and 5 with the add tool.", max_steps=2)]
    steps = [e.step for e in events if isinstance(e, StepEvent)]
    assert steps[-1].is_final and all(s.tool_calls for s in steps[:-1])
    calls = [e.call for e in events if isinstance(e, ToolCallEvent)]
    assert calls == [c for s in steps for c in s.tool_calls]
    # text arrives in chunks of several tokens at once (speculation) and still matches
    final_index = events.index(next(e for e in events if isinstance(e, StepEvent)))
    text = "".join(e.text for e in events[:final_index] if isinstance(e, TextEvent))
    assert text.strip() == steps[0].message


@pytest.mark.anyio
async def test_failing_slow_and_unknown_tools_become_tool_messages(rt):
    async with Agent(rt, tools=[explode, slow], tool_choice="explode", max_tokens=48) as agent:
        step = await agent.step("Explode.")
        assert step.tool_results[0].error == "exception"
        assert "ValueError: boom" in agent.messages[-1]["content"]
    async with Agent(rt, tools=[explode, slow], tool_choice="slow", max_tokens=48) as agent:
        with anyio.fail_after(10):
            step = await agent.step("Sleep for 2 seconds.")
        assert step.tool_results[0].error == "timeout"
        assert "timed out" in agent.messages[-1]["content"]
    # unconstrained, the small model calls tools it was never given
    async with Agent(rt, tools=[add], constrained=False, max_tokens=64) as agent:
        step = await agent.step("List the files in the current directory.")
        unknown = [r for r in step.tool_results if r.name not in agent.tools]
        assert unknown and all(r.error == "unknown_tool" for r in unknown)
    assert_clean(rt)


@pytest.mark.anyio
async def test_schema_only_tools_wait_for_the_callers_results(rt):
    async with Agent(rt, tools=[LOOKUP], tool_choice="lookup", max_tokens=48) as agent:
        step = await agent.step("Look up the word 'agent'.")
        assert [c.name for c in step.tool_calls] == ["lookup"] and not step.tool_results
        assert agent.pending_tool_calls == step.tool_calls
        before = list(agent.messages)
        with pytest.raises(MissingToolResultError):
            await agent.step("And another one?")
        assert agent.messages == before
        agent.add_tool_result(step.tool_calls[0].id, "someone who acts")
        with pytest.raises(MissingToolResultError):
            agent.add_tool_result("no-such-call", "x")
        nxt = await agent.step()
        assert nxt.usage.prompt_tokens_details.cached_tokens > 0
    assert_clean(rt)


@pytest.mark.anyio
async def test_fork_shares_the_prefix_and_diverges(rt):
    parent = Agent(rt, "You are a helpful assistant.", tools=[add], max_tokens=32)
    first = await parent.step("Add 1 and 2.")
    child = parent.fork()
    session = first.usage.prompt_tokens + first.usage.completion_tokens
    await parent.close()  # the child's pin keeps the shared prefix alive on its own
    assert rt.stats()["pages_pinned"] > 0
    a = await child.step("Now add 3 and 4.")
    assert a.usage.prompt_tokens_details.cached_tokens >= session - 1
    sibling = child.fork()
    b = await sibling.step("Instead, say hello.")
    assert b.usage.prompt_tokens_details.cached_tokens >= a.usage.prompt_tokens - 1
    assert sibling.messages[-len(b.tool_results) - 2]["content"] == "Instead, say hello."
    assert child.messages[-len(a.tool_results) - 2]["content"] == "Now add 3 and 4."
    await child.close()
    await sibling.close()
    with pytest.raises(AgentClosedError):
        await child.step("hi")
    assert_clean(rt)


@pytest.mark.anyio
async def test_cancelled_step_releases_everything_and_loses_nothing(rt, monkeypatch):
    agent = Agent(rt, tools=[add], max_tokens=400, constrained=False)
    await agent.step("Add 1 and 2.")
    before = list(agent.messages)
    gate = EngineGate(rt, monkeypatch)
    async with anyio.create_task_group() as tg:
        tg.start_soon(agent.step, "Write a very long story about the sea.")
        await gate.wait_async()  # the step is generating, and cannot finish now
        tg.cancel_scope.cancel()
    gate.release()
    assert gate.running == 1  # cancelled in flight
    assert agent.messages == before
    assert rt.stats()["pages_referenced"] == 0
    step = await agent.step("Add 5 and 6.")   # the session still works and is still cached
    assert step.usage.prompt_tokens_details.cached_tokens > 0
    await agent.close()
    assert_clean(rt)


@pytest.mark.anyio
async def test_bad_input_raises_typed_errors_and_leaks_nothing(rt):
    class NoSchema:
        pass

    with pytest.raises(ToolSchemaError):
        Agent(rt, output_type=NoSchema)
    with pytest.raises(ToolSchemaError):
        Agent(rt, tools=[{"name": "bad", "parameters": {"type": "array"}}])
    with pytest.raises(ToolDefinitionError):
        Agent(rt, tools=[add], tool_choice="subtract")
    agent = Agent(rt, tools=[add], max_tokens=16)
    with pytest.raises(ContextLengthError):
        await agent.step("word " * 5000)
    assert agent.messages == []
    await agent.step("Add 1 and 1.")   # still usable
    del agent                          # garbage collection unpins the session
    gc.collect()
    assert_clean(rt)


@pytest.mark.anyio
async def test_32_concurrent_agents_complete_multi_turn_runs(rt):
    async def session(i: int) -> None:
        async with Agent(rt, "You are a helpful assistant.", tools=[add], max_tokens=40) as a:
            first = await a.step(f"Add {i} and {i + 1} with the add tool.")
            assert [c.name for c in first.tool_calls] == ["add"]
            second = await a.step(f"Now add {2 * i} and 3.")
            assert second.usage.prompt_tokens_details.cached_tokens == \
                first.usage.prompt_tokens + first.usage.completion_tokens - 1
            for s in (first, second):
                assert_usage_invariants(s)
                for r in s.tool_results:
                    assert r.error is None

    async with anyio.create_task_group() as tg:
        for i in range(32):
            tg.start_soon(session, i)
    assert_clean(rt)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_runs_under_trio(rt, anyio_backend):
    async with Agent(rt, tools=[add], max_tokens=32) as agent:
        result = await agent.run("Add 2 and 2.", max_steps=2)
    assert result.steps and result.usage.prompt_tokens == sum(
        s.usage.prompt_tokens for s in result.steps)
    assert_clean(rt)


def test_load_computes_off_the_calling_thread(monkeypatch, tmp_path):
    """Loading (and the step-cost measurements) must not run torch on the caller's thread: a
    second libgomp team makes every engine step wait on wake-ups (runtime._off_this_thread).
    Errors still reach the caller, typed."""
    import threading

    from agentflash import runtime as runtime_module
    from agentflash.errors import CheckpointError

    seen = []
    real = runtime_module.load_model

    def spy(*args, **kwargs):
        seen.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(runtime_module, "load_model", spy)
    rt = Runtime.load()
    try:
        assert len(seen) == 1 and seen[0] is not threading.current_thread()
        assert not seen[0].is_alive()  # the loading thread is gone, and its workers with it
        assert rt.engine.policy.auto  # step costs measured there too
    finally:
        rt.close()
    with pytest.raises(CheckpointError):
        Runtime.load(tmp_path)


@pytest.mark.anyio
async def test_closed_runtime_refuses_new_steps():
    runtime = Runtime.load(draft=False)
    agent = Agent(runtime, max_tokens=8)
    runtime.close()
    with pytest.raises(AgentClosedError):
        await agent.step("hello")


@pytest.mark.anyio
async def test_session_ttl_unpins_idle_sessions(monkeypatch):
    now = [1000.0]  # a fake clock: the test decides when the TTL has passed
    runtime = Runtime.load(draft=False, session_ttl=30)
    monkeypatch.setattr(runtime, "clock", lambda: now[0])
    try:
        agent = Agent(runtime, tools=[add], max_tokens=16)
        await agent.step("Add 1 and 2.")
        now[0] += 29
        assert runtime.stats()["pages_pinned"] > 0    # idle for less than its TTL
        now[0] += 2
        assert runtime.stats()["pages_pinned"] == 0   # evictable now, still cached
        step = await agent.step("Add 3 and 4.")       # and still reused while it lasts
        assert step.usage.prompt_tokens_details.cached_tokens > 0
        await agent.close()
        assert_clean(runtime)
    finally:
        runtime.close()


LLAMA_TEMPLATE = (  # the Llama 3.1 custom-tool shape: calls are bare JSON objects
    "{%- for message in messages %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n"
    "{%- if message.role == 'system' and tools %}Tools: {{ tools | tojson }}\n{% endif %}"
    "{%- if message.tool_calls %}{%- for call in message.tool_calls %}"
    '{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}'
    "{%- endfor %}{%- else %}{{ message.content }}{%- endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{%- endif %}")


@pytest.mark.anyio
async def test_llama_json_tool_calls_are_constrained_and_parsed():
    import copy

    from agentflash.embedded import embedded_model_dir, model_drafter_dir
    from agentflash.engine.engine import Engine
    from agentflash.tokenizer import load_tokenizer

    model_dir = embedded_model_dir()
    tokenizer = copy.deepcopy(load_tokenizer(model_dir))
    tokenizer.chat_template = LLAMA_TEMPLATE
    engine = Engine.from_dir(model_dir, draft=model_drafter_dir(model_dir),
                             detokenize=tokenizer.decode)
    runtime = Runtime(engine, tokenizer, model_dir)
    try:
        assert runtime.chat.call_format == "llama3_json"
        async with Agent(runtime, "Use tools.", tools=[add], tool_choice="add",
                         max_tokens=48) as agent:
            step = await agent.step("Add 2 and 3.")
            assert [c.name for c in step.tool_calls] == ["add"]
            assert step.tool_results[0].error is None
            assert agent._history is not None
            reply = tokenizer.decode(list(agent._history.tokens)[-step.usage.completion_tokens:])
            assert reply.startswith('{"name": "add", "parameters": {')
            nxt = await agent.step("Thanks.")
            assert nxt.usage.prompt_tokens_details.cached_tokens > step.usage.prompt_tokens
        assert_clean(runtime)
    finally:
        runtime.close()


def test_streamed_text_never_splits_characters_whatever_the_chunking(rt):
    import random

    from agentflash.detokenizer import Detokenizer

    tok = rt.tokenizer
    text = 'Héllo wörld, 日本語 ✓ <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    ids = tok(text, add_special_tokens=False)["input_ids"]
    rng = random.Random(0)
    for _ in range(100):
        detok, deltas, i = Detokenizer(tok.decode, rt.eos_ids), [], 0
        while i < len(ids):
            n = rng.randint(1, 6)
            deltas.append(detok.add(ids[i:i + n]))
            i += n
        deltas.append(detok.flush())
        assert "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas)
