"""Telemetry of agent runs: a JSONL run log and OpenTelemetry GenAI spans.

The run log has one JSON object per line: a "step" record per model step (its `Usage`, the
tools it called) and a "tool" record per tool call, each with run / agent / session ids, so
`agentflash report` can draw a dashboard from it. Several agents (threads, tasks) may share one
log; lines are written whole under a lock.

When the `otel` extra (opentelemetry-api) is installed, each step also becomes spans on the
global tracer provider, following the GenAI semantic conventions: `invoke_agent {name}` around a
run, `chat {model}` per model step with `gen_ai.usage.*` attributes (input, output and
cache-read input tokens; the rest under `gen_ai.usage.details.*`), and `execute_tool {name}` per
tool call. Without a configured SDK the API's tracer is a no-op.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .step import Step

try:
    from opentelemetry import trace as otel_trace
except ImportError:  # the optional extra is not installed
    otel_trace = None


class RunLog:
    """Appends records to a JSONL file (thread-safe, line-buffered)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, ensure_ascii=False)
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def step_records(ids: dict[str, Any], step: Step, turn: int, index: int,
                 model: str) -> list[dict[str, Any]]:
    """The log records of one step: the step, then one per tool result."""
    now = time.time()
    records = [{"type": "step", "ts": now, **ids, "turn": turn, "step": index, "model": model,
                "finish_reason": step.finish_reason,
                "tool_calls": [c.name for c in step.tool_calls],
                "usage": step.usage.model_dump(mode="json")}]
    for r in step.tool_results:
        records.append({"type": "tool", "ts": now, **ids, "step": index, "call_id": r.call_id,
                        "name": r.name, "error": r.error, "elapsed_s": r.elapsed_s})
    return records


class Tracer:
    """GenAI spans for one agent; every method is a no-op without opentelemetry."""

    def __init__(self, agent_name: str, model: str) -> None:
        self.agent_name, self.model = agent_name, model
        self._tracer = otel_trace.get_tracer("agentflash") if otel_trace is not None else None

    def start_run(self, session_id: str) -> Any:
        """The `invoke_agent` span of a run (not made current: a run is an async generator,
        so its children name it as parent explicitly); None without opentelemetry."""
        if self._tracer is None:
            return None
        return self._tracer.start_span(
            f"invoke_agent {self.agent_name}", kind=otel_trace.SpanKind.INTERNAL,
            attributes={"gen_ai.operation.name": "invoke_agent",
                        "gen_ai.agent.name": self.agent_name,
                        "gen_ai.conversation.id": session_id,
                        "gen_ai.request.model": self.model})

    def end_run(self, span: Any, error: BaseException | None = None) -> None:
        if span is None:
            return
        if error is not None:
            span.set_attribute("error.type", type(error).__name__)
            span.set_status(otel_trace.Status(otel_trace.StatusCode.ERROR, str(error)))
        span.end()

    def step(self, step: Step, start_ns: int, session_id: str, run_span: Any = None) -> None:
        """A finished step as a `chat` span and its tools as `execute_tool` spans (children of
        `run_span` when given)."""
        if self._tracer is None:
            return
        context = otel_trace.set_span_in_context(run_span) if run_span is not None else None
        u = step.usage
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.request.model": self.model,
            "gen_ai.conversation.id": session_id,
            "gen_ai.response.finish_reasons": [step.finish_reason],
            "gen_ai.usage.input_tokens": u.prompt_tokens,
            "gen_ai.usage.output_tokens": u.completion_tokens,
            "gen_ai.usage.cache_read.input_tokens": u.prompt_tokens_details.cached_tokens,
        }
        predicted, spec, compute, cost = (u.completion_tokens_details, u.speculative, u.compute,
                                          u.cost)
        details = {  # what a remote server does not report stays out (None)
            "accepted_prediction_tokens": predicted and predicted.accepted_prediction_tokens,
            "rejected_prediction_tokens": predicted and predicted.rejected_prediction_tokens,
            "drafts": spec and spec.drafts,
            "mean_acceptance_length": spec and spec.mean_acceptance_length,
            "prefill_tokens_computed": compute and compute.prefill_tokens_computed,
            "target_forwards": compute and compute.target_forwards,
            "ttft_s": u.timing.ttft_s,
            "cost_usd": cost and cost.usd,
            "saved_by_cache_usd": cost and cost.saved_by_cache_usd,
            "saved_by_speculation_usd": cost and cost.saved_by_speculation_usd,
        }
        attributes = {k: v for k, v in attributes.items() if v is not None}
        details = {k: v for k, v in details.items() if v is not None}
        attributes |= {f"gen_ai.usage.details.{k}": v for k, v in details.items()}
        model_end = start_ns + int(1e9 * (u.timing.total_s - u.timing.tool_s))
        span = self._tracer.start_span(f"chat {self.model}", context=context,
                                       kind=otel_trace.SpanKind.CLIENT, start_time=start_ns,
                                       attributes=attributes)
        span.end(end_time=model_end)
        for r in step.tool_results:
            tool_span = self._tracer.start_span(
                f"execute_tool {r.name}", context=context, kind=otel_trace.SpanKind.INTERNAL,
                start_time=model_end,
                attributes={"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": r.name,
                            "gen_ai.tool.call.id": r.call_id,
                            **({"error.type": r.error} if r.error else {})})
            if r.error:
                tool_span.set_status(otel_trace.Status(otel_trace.StatusCode.ERROR, r.content))
            tool_span.end(end_time=model_end + int(1e9 * r.elapsed_s))
