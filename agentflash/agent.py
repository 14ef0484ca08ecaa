"""Agent: the loop user -> model -> tools -> model, over one KV-resident session.

Each step is one chat turn (agentflash.conversation.chat) on the agent's runtime: the local
`Runtime`, or a `RemoteRuntime` over an OpenAI-compatible server (agentflash.remote), with the
same code above it. Locally the agent keeps the token list the model really saw (a `History`),
so a step renders only the messages added since the last reply and the prefix cache serves the
rest; the session's KV stays pinned between steps and while tools run. Remotely the server keeps
its own cache, and every request carries the agent's session id for routers. Tool calls and
`output_type` output are constrained by xgrammar inside the speculative loop (locally) or by the
same grammar sent to the server (agentflash.structured), so calls parse and validate.

Failure never corrupts the conversation: a step that raises or is cancelled leaves the agent as it
was before the step (its input message included), and releases the KV its generation held.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import time
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Sequence

import anyio
import pydantic

from agentflash.engine.kv.manager import Pin
from agentflash.engine.sampler import SamplingParams

from .conversation import check_output, chat
from .errors import (AgentClosedError, AgentflashError, MissingToolResultError,
                     OutputValidationError, ToolDefinitionError, ToolSchemaError)
from .remote import RemoteRuntime
from .request import ChatReply, ChatRequest, History, TextChunk
from .runtime import Runtime
from .structured import TOOL_CHOICES
from .telemetry import RunLog, Tracer, step_records
from .tool import Tool, as_tool
from .step import Step, ToolCall, ToolResult
from .usage import Usage


@dataclass
class RunResult:
    output: Any
    steps: list[Step]
    pending_tool_calls: list[ToolCall] = field(default_factory=list)  # awaiting add_tool_result

    @property
    def usage(self) -> Usage:
        return Usage.sum([s.usage for s in self.steps])


# ---- stream events ------------------------------------------------------------------------

@dataclass(frozen=True)
class TextEvent:
    text: str


@dataclass(frozen=True)
class ToolCallEvent:
    call: ToolCall


@dataclass(frozen=True)
class ToolResultEvent:
    result: ToolResult


@dataclass(frozen=True)
class StepEvent:
    step: Step


Event = TextEvent | ToolCallEvent | ToolResultEvent | StepEvent


class MaxStepsError(AgentflashError):
    """A run reached max_steps without a final output; `.steps` holds what was done."""

    def __init__(self, message: str, steps: list[Step]) -> None:
        super().__init__(message)
        self.steps = steps


class Agent:
    """A conversation with tools on a `Runtime` (or a `RemoteRuntime`). Steps of one agent run
    one at a time; many agents on one runtime run concurrently and are batched together by the
    engine (or the server)."""

    _ids = itertools.count()

    def __init__(
        self,
        runtime: Runtime | RemoteRuntime,
        instructions: str | None = None,
        tools: Sequence[Tool | Callable[..., Any] | dict[str, Any]] = (),
        output_type: Any = None,
        tool_choice: str = "auto",
        temperature: float = 0.0,
        max_tokens: int = 512,
        *,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        speculative: bool = True,
        constrained: bool = True,
        reuse_kv: bool = True,
        name: str | None = None,
        log: str | Path | None = None,
    ) -> None:
        self.runtime = runtime
        self.id = next(Agent._ids)
        self.name = name or f"agent-{self.id}"
        self.session_id = uuid.uuid4().hex[:16]
        self.affinity = self.session_id   # sent to remote servers; a fork keeps its parent's
        self.tools = {t.name: t for t in map(as_tool, tools)}
        if len(self.tools) != len(tools):
            raise ToolDefinitionError("tool names must be unique")
        self._check_choice(tool_choice)
        self.tool_choice = tool_choice
        self.output_type = output_type
        self._output, self._output_schema = _output_adapter(output_type)
        self.params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                     max_new_tokens=max_tokens)
        self.speculative = speculative
        self.constrained = constrained   # False: raw model output, calls parsed as they come
        self.reuse_kv = reuse_kv         # False: every step recomputes its whole prompt
        self.messages: list[dict[str, Any]] = (
            [{"role": "system", "content": instructions}] if instructions else [])
        self._schemas = [t.openai_schema() for t in self.tools.values()]
        self._history: History | None = History((), 0)  # local: the tokens the model saw
        self._pending: dict[str, ToolCall] = {}   # schema-only calls awaiting results
        self._closed = False
        self._busy = False
        self._turns = 0                           # user messages answered
        self._steps = 0                           # model steps taken
        self._run: tuple[str, Any] | None = None  # (run id, invoke_agent span) of stream()
        self._own_log = RunLog(log) if log is not None else None
        self._tracer = Tracer(self.name, runtime.model_name)
        self._held: list[Pin | None] = [None]     # the session's pin (shared with the finalizer)
        self._finalizer = weakref.finalize(self, _unpin, runtime, self._held)
        if isinstance(runtime, RemoteRuntime):
            runtime.check_agent(speculative=speculative, reuse_kv=reuse_kv)
        for choice in ({"auto", tool_choice} if self.tools else {"none"}):
            check_output(runtime, self._schemas, choice, self._output_schema)  # bad schemas

    # ---- public ---------------------------------------------------------------------------

    async def step(self, message: str | None = None, *, tool_choice: str | None = None) -> Step:
        """One model turn on `message` (or on the tool results added since the last step),
        then the tools it called. Raises on bad input; the agent is then unchanged.

        tool_choice: this step's ("none" to answer from the tool results so far, "required",
        a tool's name); by default the agent's for a reply to a message, "auto" after tool
        results (a forced call on every step would never end)."""
        if tool_choice is not None:
            self._check_choice(tool_choice)
        step = None
        async for event in self._step(message, tool_choice):
            if isinstance(event, StepEvent):
                step = event.step
        assert step is not None
        return step

    async def run(self, message: str, max_steps: int = 8) -> RunResult:
        """Steps until a final output (no tool calls), or until calls need results from the
        caller (schema-only tools: see `pending_tool_calls`)."""
        steps: list[Step] = []
        async for event in self.stream(message, max_steps):
            if isinstance(event, StepEvent):
                steps.append(event.step)
        last = steps[-1]
        return RunResult(last.output, steps, list(self._pending.values()))

    async def stream(self, message: str, max_steps: int = 8) -> AsyncIterator[Event]:
        """Like `run`, yielding text deltas, tool calls, tool results and each finished step
        (with its usage) as they happen."""
        steps: list[Step] = []
        next_message: str | None = message
        span = self._tracer.start_run(self.session_id)
        self._run = (uuid.uuid4().hex[:16], span)
        error: BaseException | None = None
        try:
            while True:
                # aclosing: a caller that closes this stream closes the step at once (its
                # message rolled back, its request aborted), not when the event loop gets to
                # finalising an abandoned generator
                async with contextlib.aclosing(self._step(next_message)) as events:
                    async for event in events:
                        if isinstance(event, StepEvent):
                            steps.append(event.step)
                        yield event
                next_message = None
                if steps[-1].is_final or self._pending:
                    return
                if len(steps) >= max_steps:
                    raise MaxStepsError(f"no final output after {max_steps} steps", steps)
        except BaseException as e:
            error = e
            raise
        finally:
            self._run = None
            self._tracer.end_run(span, error)

    def add_tool_result(self, call_id: str, content: str) -> None:
        """Supply the result of a call to a schema-only tool (before the next step)."""
        call = self._pending.pop(call_id, None)
        if call is None:
            raise MissingToolResultError(f"no pending tool call with id {call_id!r}")
        self.messages.append(_tool_message(ToolResult(call.id, call.name, content)))

    @property
    def pending_tool_calls(self) -> list[ToolCall]:
        return list(self._pending.values())

    def fork(self) -> Agent:
        """A copy of this agent that shares the KV of the conversation so far (copy-on-write)
        and diverges independently from here."""
        self._check_open()
        child = copy.copy(self)
        child.id = next(Agent._ids)
        child.name = f"{self.name}.fork-{child.id}"
        child.session_id = uuid.uuid4().hex[:16]
        child._own_log = None   # the parent owns (and closes) its log file
        child._tracer = Tracer(child.name, self.runtime.model_name)
        child.messages = copy.deepcopy(self.messages)
        child._pending = dict(self._pending)
        child._held = [None]
        if self._held[0] is not None:
            child._held[0] = pin = self.runtime.share_pin(self._held[0])
            self.runtime.keep(pin)
        child._finalizer = weakref.finalize(child, _unpin, self.runtime, child._held)
        return child

    async def close(self) -> None:
        """Release the session's KV (on `agentflash serve` too). The agent cannot step
        afterwards."""
        self._closed = True
        self._finalizer()
        if isinstance(self.runtime, RemoteRuntime) and self._steps:
            await self.runtime.end_session(self.session_id)
        if self._own_log is not None:
            self._own_log.close()

    async def __aenter__(self) -> Agent:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- one step -------------------------------------------------------------------------

    def _request(self, tool_choice: str) -> ChatRequest:
        return ChatRequest(
            tuple(self.messages), tuple(self._schemas), tool_choice,
            output_schema=self._output_schema, params=self.params,
            max_tokens=self.params.max_new_tokens, truncate=True, pin=self.reuse_kv,
            speculative=self.speculative, constrained=self.constrained, reuse=self.reuse_kv,
            history=self._history, session=self.session_id, affinity=self.affinity)

    async def _step(self, message: str | None,
                    tool_choice: str | None = None) -> AsyncIterator[Event]:
        self._check_open()
        if self._busy:
            raise AgentflashError("a step of this agent is already running")
        if self._pending:
            raise MissingToolResultError(
                f"tool calls {sorted(self._pending)} wait for results: call add_tool_result "
                "for each before the next step")
        saved = (len(self.messages), self._history)
        self._busy = True
        t0 = time.perf_counter()
        start_ns = time.time_ns()
        committed = False
        try:
            if message is not None:
                self.messages.append({"role": "user", "content": message})
            if tool_choice is None:
                tool_choice = self.tool_choice if message is not None else "auto"
            turn = chat(self.runtime, self._request(tool_choice))
            reply: ChatReply | None = None
            async with contextlib.aclosing(turn.events()) as chunks:
                async for event in chunks:
                    if isinstance(event, TextChunk) and event.text:
                        yield TextEvent(event.text)
                    elif isinstance(event, ChatReply):
                        reply = event
            assert reply is not None
            # the reply is part of the conversation from here on
            committed = True
            self._swap_pin(reply.pin)
            self._history = reply.history
            calls = reply.tool_calls
            for call in calls:
                yield ToolCallEvent(call)
            text = reply.text or ""
            self.messages.append(_assistant_message(text, calls))
            t_tools = time.perf_counter()
            results = await self._run_tools(calls)
            usage = reply.usage
            usage.timing.tool_s = time.perf_counter() - t_tools
            usage.timing.total_s = time.perf_counter() - t0
            for result in results:
                self.messages.append(_tool_message(result))
                yield ToolResultEvent(result)
            is_final = not calls
            self._turns += message is not None
            self._steps += 1
            finish = "length" if reply.finish_reason == "length" else "stop"
            step = Step(text, calls, results, None, is_final, usage, finish, reply.malformed)
            self._record(step, start_ns)
            step.output = self._final_output(text, finish) if is_final else None
            yield StepEvent(step)
        except BaseException:
            if not committed:
                del self.messages[saved[0]:]
                self._history = saved[1]
            raise
        finally:
            self._busy = False

    def _check_choice(self, tool_choice: str) -> None:
        if tool_choice not in TOOL_CHOICES and tool_choice not in self.tools:
            raise ToolDefinitionError(
                f"tool_choice {tool_choice!r} is none of {TOOL_CHOICES} nor a tool's name")

    def _record(self, step: Step, start_ns: int) -> None:
        """Write the step to the run log and emit its spans."""
        run_id, span = self._run or (uuid.uuid4().hex[:16], None)
        log = self._own_log or self.runtime.log
        if log is not None:
            ids = {"run_id": run_id, "agent_id": self.name, "agent_name": self.name,
                   "session_id": self.session_id}
            for record in step_records(ids, step, self._turns, self._steps,
                                       self.runtime.model_name):
                log.write(record)
        self._tracer.step(step, start_ns, self.session_id, span)

    async def _run_tools(self, calls: list[ToolCall]) -> list[ToolResult]:
        """Run the calls' tools concurrently; results in call order. Calls to schema-only tools
        are left pending for the caller."""
        results: dict[str, ToolResult] = {}

        async def run(call: ToolCall, tool: Tool) -> None:
            outcome = await tool.execute(call.arguments)
            results[call.id] = ToolResult(call.id, call.name, outcome.content, outcome.error,
                                          outcome.elapsed_s)

        async with anyio.create_task_group() as tg:
            for call in calls:
                tool = self.tools.get(call.name)
                if tool is None:
                    results[call.id] = ToolResult(
                        call.id, call.name, f"Error: unknown tool {call.name!r}; available: "
                        f"{', '.join(self.tools) or 'none'}", "unknown_tool")
                elif tool.fn is None:
                    self._pending[call.id] = call
                else:
                    tg.start_soon(run, call, tool)
        return [results[c.id] for c in calls if c.id in results]

    def _final_output(self, text: str, finish_reason: str) -> Any:
        if self._output is None:
            return text
        try:
            return self._output.validate_json(text)
        except pydantic.ValidationError as e:
            hint = " (the reply hit max_tokens)" if finish_reason == "length" else ""
            raise OutputValidationError(
                f"the final output does not validate as {self.output_type!r}{hint}: {e}"
            ) from None

    def _swap_pin(self, pin: Pin | None) -> None:
        old, self._held[0] = self._held[0], pin
        if old is not None:
            self.runtime.unpin(old)
        if self._closed:
            self._finalizer()
        elif pin is not None:
            self.runtime.keep(pin)

    def _check_open(self) -> None:
        if self._closed:
            raise AgentClosedError(f"{self.name} is closed")


def _output_adapter(output_type: Any) -> tuple[pydantic.TypeAdapter | None, dict | None]:
    """The validator and JSON schema of an output type (None: free text)."""
    if output_type is None:
        return None, None
    try:
        adapter = pydantic.TypeAdapter(output_type)
        return adapter, adapter.json_schema()
    except (pydantic.PydanticUserError, TypeError) as e:
        raise ToolSchemaError(f"output_type {output_type!r} has no JSON schema: {e}") from None


def _assistant_message(text: str, calls: list[ToolCall]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    return message


def _tool_message(result: ToolResult) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": result.call_id, "name": result.name,
            "content": result.content}


def _unpin(runtime: Runtime | RemoteRuntime, held: list[Pin | None]) -> None:
    pin, held[0] = held[0], None
    if pin is None:
        return
    try:
        runtime.unpin(pin)  # type: ignore[union-attr]  # a pin comes from a local runtime
    except AgentClosedError:
        pass  # the runtime is gone, and its pool with it


__all__ = ["Agent", "Step", "RunResult", "ToolCall", "ToolResult", "TextEvent", "ToolCallEvent",
           "ToolResultEvent", "StepEvent", "Event", "MaxStepsError"]
