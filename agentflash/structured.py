"""Output constraints compiled with xgrammar, adapted to the engine's `TokenConstraint`.

An agent step may be constrained in three ways, combined as needed:
- tool calls: the model's own call syntax (Qwen3/Hermes `<tool_call>` or Llama 3.1 JSON), with
  each call's arguments matching its tool's JSON schema (xgrammar's built-in structural tags);
- `tool_choice`: "auto" (text and/or calls), "required" (at least one call), a tool name
  (exactly that tool), "none" (no call syntax at all);
- structured output: the reply is one JSON value matching `output_type`'s schema; with tools
  offered, the reply is either tool calls or that JSON.

Compiled grammars are cached per (tools, choice, schema); each request gets a fresh matcher.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import xgrammar as xgr
from xgrammar.structural_tag import AnyTextFormat, JSONSchemaFormat, OrFormat, StructuralTag

from .errors import ToolSchemaError

TOOL_CHOICES = ("auto", "required", "none")
"""tool_choice values besides a tool's name."""

# parser format (agentflash.toolcall_parser) -> xgrammar's structural-tag model key and the
# text that starts a call in that format
_FORMATS = {"hermes": ("qwen_3", "<tool_call>"), "llama3_json": ("llama", '{"name": ')}
# longest run of whitespace allowed between JSON tokens: room for indented JSON, none for the
# endless newlines a weak model can fall into
MAX_WHITESPACE = 16
# integers without bounds get at most 18 digits: a model cannot emit a number that runs on for
# ever (a small model will), every typed tool accepts the range (it fits int64), and a range of
# whole digit counts compiles to a short grammar (the held-out tool sets: 7.1 ms against 10.6
# with the exact int64 range, docs/performance.md)
INTEGER_BOUNDS = (-(10**18 - 1), 10**18 - 1)


@dataclass(frozen=True)
class OutputSpec:
    """What one generation must look like. `tools` are OpenAI-shaped function schemas."""

    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: str = "auto"            # "auto" | "required" | "none" | a tool name
    output_schema: dict[str, Any] | None = None
    call_format: str = "hermes"          # "hermes" | "llama3_json"

    @property
    def unconstrained(self) -> bool:
        return not self.tools and self.output_schema is None

    def key(self) -> str:
        return json.dumps([self.tools, self.tool_choice, self.output_schema, self.call_format],
                          sort_keys=True)


class GrammarConstraint:
    """A fresh xgrammar matcher for one generation (implements engine TokenConstraint)."""

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int):
        self._matcher = xgr.GrammarMatcher(compiled)
        self._words = -(-vocab_size // 32)

    def allowed(self) -> torch.Tensor:
        # packed as the engine takes it: xgrammar's bitmask (token i at bit i % 32 of word
        # i // 32), a fresh one each call (a verify block keeps one per row)
        mask = torch.empty(1, self._words, dtype=torch.int32)
        self._matcher.fill_next_token_bitmask(mask)
        return mask[0]

    def accept(self, token: int) -> bool:
        return self._matcher.accept_token(token)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


class GrammarCompiler:
    """Compiles `OutputSpec`s for one tokenizer/model pair and hands out matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]):
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
        # one thread: a compile runs on the server's event loop while the engine's threads use
        # every core; with xgrammar's default 8, the intake of 8 requests with new tool sets took
        # 136 ms instead of 73 on a 2-core EPYC, their last first token 27-60 ms later.
        # Dynamic compilation builds a state's token mask when a matcher first reaches it (in the
        # engine's thread, the only one that fills masks) rather than every state's up front: a
        # reply visits few of the states (the held-out tool sets: 10.6 ms against 21.2)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, enable_dynamic_compilation=True)
        self._vocab_size = vocab_size
        self._cache: dict[str, xgr.CompiledGrammar] = {}

    def constraint(self, spec: OutputSpec) -> GrammarConstraint | None:
        """A matcher at the start state for `spec`; None when nothing needs constraining.
        Raises ToolSchemaError for a schema xgrammar cannot compile."""
        if spec.unconstrained:
            return None
        key = spec.key()
        if key not in self._cache:
            try:
                self._cache[key] = self._compiler.compile_structural_tag(structural_tag(spec))
            except (RuntimeError, ValueError, TypeError) as e:
                raise ToolSchemaError(f"cannot compile the output constraint: {e}") from None
        return GrammarConstraint(self._cache[key], self._vocab_size)


def structural_tag(spec: OutputSpec) -> StructuralTag:
    """The xgrammar structural tag for a constrained spec (see the module docstring)."""
    model_key, trigger = _FORMATS[spec.call_format]
    output = (JSONSchemaFormat(json_schema=bounded(spec.output_schema),
                               max_whitespace_cnt=MAX_WHITESPACE)
              if spec.output_schema is not None else None)
    if not spec.tools or spec.tool_choice == "none":
        return StructuralTag(format=output or AnyTextFormat(excludes=[trigger]))
    choice: Any = spec.tool_choice
    if choice not in ("auto", "required"):
        choice = {"type": "function", "function": {"name": choice}}
    if choice == "auto" and output is not None:
        # a reply is tool calls or the final output, never free text
        calls = _calls(model_key, spec.tools, "required")
        return StructuralTag(format=OrFormat(elements=[calls, output]))
    return StructuralTag(format=_calls(model_key, spec.tools, choice))


def _calls(model_key: str, tools: Sequence[dict[str, Any]], choice: Any) -> Any:
    tools = [{**t, "function": {**t["function"], "parameters": bounded(
        t["function"].get("parameters", {"type": "object"}))}} for t in tools]
    return xgr.get_model_structural_tag(model_key, tools=tools, tool_choice=choice,
                                        reasoning=False, max_whitespace_cnt=MAX_WHITESPACE).format


def bounded(schema: Any) -> Any:
    """A copy of a JSON schema whose unbounded integers are limited to `INTEGER_BOUNDS`."""
    if isinstance(schema, list):
        return [bounded(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded(v) if k not in ("enum", "const", "default", "examples") else v
           for k, v in schema.items()}
    types = schema.get("type")
    if types == "integer" or (isinstance(types, list) and "integer" in types):
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = INTEGER_BOUNDS[0]
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = INTEGER_BOUNDS[1]
    return out
