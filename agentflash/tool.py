"""Tools an agent can call: built from typed Python functions or from JSON-schema dicts.

A `Tool` carries what the model sees (name, description, JSON schema of its arguments, exposed
through `openai_schema()`) and, for function tools, the code to run. `execute()` validates the
model's arguments, runs the function (sync ones in a worker thread, so a slow tool cannot block
the event loop) under an optional timeout, and turns the result or the failure into a
`ToolOutcome` whose text goes back to the model. Schema-only tools (`fn is None`) have no code:
the agent hands their calls to its caller. Works under asyncio and trio (anyio).
"""

from __future__ import annotations

import functools
import inspect
import json
import re
import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, overload

import anyio
import anyio.to_thread
import jsonschema_rs
from jsonschema import Draft202012Validator, SchemaError
from pydantic import BaseModel, Field, TypeAdapter, ValidationError, create_model
from pydantic.errors import PydanticUserError

from agentflash.errors import ToolArgumentsError, ToolDefinitionError, ToolSchemaError

__all__ = ["Tool", "ToolOutcome", "as_tool", "tool"]

_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def _schema_error(parameters: dict[str, Any]) -> str | None:
    """Why `parameters` is not a valid JSON Schema (2020-12), or None. A server checks every new
    tool set before its request runs, so JSON-exact schemas (all that come over HTTP) are checked
    by jsonschema-rs (the held-out tool sets' 14 schemas: 0.07 ms against jsonschema's 8 ms on
    the AMX Xeon) and the verdicts cached by their canonical text (agents resend the same tools
    every turn); others (tuples and the like, which jsonschema-rs would take as arrays) by
    jsonschema, which rejects them."""
    try:
        text = json.dumps(parameters, sort_keys=True)
        exact = json.loads(text) == parameters
    except (TypeError, ValueError):
        exact = False
    return _checked(text) if exact else _check(parameters)


def _check(parameters: Any) -> str | None:
    try:
        Draft202012Validator.check_schema(parameters)
    except SchemaError as e:
        return e.message
    return None


@functools.lru_cache(maxsize=4096)
def _checked(text: str) -> str | None:
    try:
        _metaschema().validate(json.loads(text))
    except jsonschema_rs.ValidationError as e:
        return e.message
    return None


@functools.cache
def _metaschema() -> Any:
    """A jsonschema-rs validator of the 2020-12 metaschema, whatever `$schema` a tool names (as
    jsonschema's check_schema does; its own `meta.validate` would fetch an unknown `$schema`)."""
    return jsonschema_rs.Draft202012Validator(Draft202012Validator.META_SCHEMA)


@dataclass(frozen=True)
class ToolOutcome:
    """The result of one tool call, as the model will see it."""

    content: str
    """The result as text; on failure a short "Error: ..." message the model can read."""
    error: str | None
    """None on success, else the kind of failure: "invalid_arguments", "exception" or "timeout"."""
    elapsed_s: float


@dataclass(frozen=True)
class Tool:
    """A tool the model can call. Calling the `Tool` itself calls `fn` directly (for an async
    function that returns the coroutine), so decorating a function does not change its use."""

    name: str
    description: str
    parameters: dict[str, Any]
    """JSON Schema of the arguments object: {"type": "object", "properties": ..., ...}."""
    fn: Callable[..., Any] | None = None
    """None for schema-only tools, whose calls the agent returns to its caller."""
    timeout: float | None = None
    """Seconds `execute` lets `fn` run; None means no limit."""
    _model: type[BaseModel] | None = field(default=None, repr=False, compare=False)
    """Validates and coerces the arguments of tools built by `from_function`; tools without it
    are validated against `parameters` with jsonschema."""

    def __post_init__(self) -> None:
        if self.timeout is not None and not self.timeout > 0:
            raise ToolDefinitionError(f"timeout of tool {self.name!r} must be positive or None, "
                                      f"got {self.timeout!r}")

    @classmethod
    def from_function(cls, fn: Callable[..., Any], *, name: str | None = None,
                      description: str | None = None, timeout: float | None = None) -> Tool:
        """A tool whose schema comes from `fn`'s signature (via pydantic) and whose descriptions
        come from its docstring: the summary paragraph, and per parameter a Google-style `Args:`
        entry or a reST `:param x:` line. Raises ToolDefinitionError for *args, **kwargs,
        positional-only parameters, or an annotation pydantic cannot make a schema for."""
        name = name if name is not None else getattr(fn, "__name__", type(fn).__name__)
        if not _valid_name(name):
            raise ToolDefinitionError(f"tool name {name!r} must be non-empty and use only "
                                      "[A-Za-z0-9_.-]; pass name=...")
        try:
            signature = inspect.signature(fn, eval_str=True)
        except Exception as e:  # unresolvable string annotations, builtins without a signature
            raise ToolDefinitionError(f"cannot read the signature of tool {name}: {e}") from e
        model, schema = _arguments_model(name, signature)
        summary, param_docs = _parse_docstring(inspect.getdoc(fn))
        for prop, doc in param_docs.items():
            if prop in schema["properties"]:
                schema["properties"][prop].setdefault("description", doc)
        parameters = {"type": "object", **schema}
        if "$defs" in parameters:  # after the properties that refer to them, for readability
            parameters["$defs"] = parameters.pop("$defs")
        return cls(name=name, description=summary if description is None else description,
                   parameters=parameters, fn=fn, timeout=timeout, _model=model)

    @classmethod
    def from_schema(cls, spec: dict[str, Any]) -> Tool:
        """A schema-only tool from the OpenAI shape {"type": "function", "function": {"name",
        "description", "parameters"}} or the bare {"name", "description", "parameters"}.
        Raises ToolSchemaError when the spec is malformed."""
        if not isinstance(spec, dict):
            raise ToolSchemaError(f"a tool schema must be a dict, got {type(spec).__name__}")
        if spec.get("type", "function") != "function":
            raise ToolSchemaError(f"unsupported tool type {spec['type']!r}; expected 'function'")
        body = spec.get("function", spec)
        if not isinstance(body, dict):
            raise ToolSchemaError(f"'function' of a tool schema must be a dict, got "
                                  f"{type(body).__name__}")
        name = body.get("name")
        if not _valid_name(name):
            raise ToolSchemaError(f"tool name {name!r} must be a non-empty string of "
                                  "[A-Za-z0-9_.-]")
        description = body.get("description", "")
        if not isinstance(description, str):
            raise ToolSchemaError(f"description of tool {name} must be a string")
        parameters = body.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, dict) or parameters.get("type") != "object":
            raise ToolSchemaError(f'parameters of tool {name} must be a JSON schema dict with '
                                  f'"type": "object"')
        error = _schema_error(parameters)
        if error is not None:
            raise ToolSchemaError(f"invalid parameters schema for tool {name}: {error}")
        return cls(name=name, description=description, parameters=parameters)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._require_fn()(*args, **kwargs)

    def openai_schema(self) -> dict[str, Any]:
        """The tool in the OpenAI shape that HF chat templates and xgrammar consume."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": self.parameters}}

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Arguments ready for `fn(**...)`: coerced by the pydantic model for function tools,
        checked against `parameters` (and returned unchanged) otherwise. Raises
        ToolArgumentsError naming the tool and the offending fields."""
        if not isinstance(arguments, dict):
            raise ToolArgumentsError(f"invalid arguments for {self.name}: expected a JSON object, "
                                     f"got {type(arguments).__name__}")
        if self._model is None:
            errors = [(list(e.absolute_path), e.message)
                      for e in Draft202012Validator(self.parameters).iter_errors(arguments)]
            if errors:
                raise ToolArgumentsError(self._arguments_message(errors))
            return arguments
        try:
            values = self._model.model_validate(arguments)
        except ValidationError as e:
            raise ToolArgumentsError(
                self._arguments_message([(list(err["loc"]), err["msg"]) for err in e.errors()])
            ) from None
        return {f.alias: getattr(values, attr) for attr, f in type(values).model_fields.items()}

    async def execute(self, arguments: dict[str, Any]) -> ToolOutcome:
        """Validate, run `fn` under `timeout`, and report the result or the failure. Never raises
        for problems of the tool or its arguments (only for cancellation of the caller); raises
        ToolDefinitionError for a schema-only tool, which has nothing to execute."""
        fn = self._require_fn()
        start = time.perf_counter()

        def outcome(content: str, error: str | None = None) -> ToolOutcome:
            return ToolOutcome(content, error, time.perf_counter() - start)

        try:
            kwargs = self.validate(arguments)
        except ToolArgumentsError as e:
            return outcome(f"Error: {e}", "invalid_arguments")
        # move_on_after rather than fail_after: a TimeoutError raised by the tool itself is an
        # "exception", only our own deadline is a "timeout".
        with anyio.move_on_after(self.timeout):
            try:
                if _is_async(fn):
                    result = await fn(**kwargs)
                else:
                    # Abandoned on timeout: the thread runs on, but the caller moves on.
                    result = await anyio.to_thread.run_sync(
                        functools.partial(fn, **kwargs), abandon_on_cancel=True)
                return outcome(_to_content(result))
            except Exception as e:
                return outcome(f"Error: {type(e).__name__}: {e}", "exception")
        return outcome(f"Error: tool {self.name} timed out after {self.timeout:g} s", "timeout")

    def _require_fn(self) -> Callable[..., Any]:
        if self.fn is None:
            raise ToolDefinitionError(f"tool {self.name} is schema-only: it has no function to "
                                      "run; its calls go back to the caller")
        return self.fn

    def _arguments_message(self, errors: list[tuple[list[Any], str]]) -> str:
        parts = [f"{'.'.join(map(str, loc))}: {msg}" if loc else msg for loc, msg in errors]
        return f"invalid arguments for {self.name}: " + "; ".join(parts)


@overload
def tool(fn: Callable[..., Any], /) -> Tool: ...
@overload
def tool(*, name: str | None = None, description: str | None = None,
         timeout: float | None = None) -> Callable[[Callable[..., Any]], Tool]: ...
def tool(fn: Callable[..., Any] | None = None, /, *, name: str | None = None,
         description: str | None = None, timeout: float | None = None) -> Any:
    """Decorator making a function a `Tool`: bare (`@tool`) or with options
    (`@tool(name="x", description="...", timeout=5.0)`)."""
    make = functools.partial(Tool.from_function, name=name, description=description,
                             timeout=timeout)
    return make if fn is None else make(fn)


def as_tool(obj: Tool | Callable[..., Any] | dict[str, Any]) -> Tool:
    """A Tool as is, a callable via `Tool.from_function`, a dict via `Tool.from_schema`."""
    if isinstance(obj, Tool):
        return obj
    if isinstance(obj, dict):
        return Tool.from_schema(obj)
    if callable(obj):
        return Tool.from_function(obj)
    raise ToolDefinitionError(f"cannot make a tool from {type(obj).__name__}; pass a Tool, a "
                              "function or a JSON-schema dict")


def _valid_name(name: object) -> bool:
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None))


def _arguments_model(tool_name: str, signature: inspect.Signature,
                     ) -> tuple[type[BaseModel], dict[str, Any]]:
    """The pydantic model of a function's keyword arguments (unannotated ones are Any) and its
    JSON schema without titles."""
    fields: dict[str, Any] = {}
    for i, param in enumerate(signature.parameters.values()):
        if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            raise ToolDefinitionError(f"parameter {param.name!r} of tool {tool_name} is "
                                      f"{param.kind.description}; tools take named arguments only")
        annotation = Any if param.annotation is param.empty else param.annotation
        _check_annotation(tool_name, param.name, annotation)
        default = ... if param.default is param.empty else param.default
        # Fields get neutral names and the parameter name as alias, so parameters may be called
        # anything (`_x`, `json`, `model_config`) without clashing with BaseModel's namespace.
        fields[f"p{i}"] = (Annotated[annotation, Field(alias=param.name)], default)
    try:
        model = create_model("Arguments", **fields)
        schema = model.model_json_schema()
    except (PydanticUserError, TypeError) as e:  # e.g. a default Field() pydantic rejects
        raise ToolDefinitionError(f"cannot build a schema for tool {tool_name}: {e}") from e
    return model, _strip_titles(schema)


def _check_annotation(tool_name: str, param: str, annotation: Any) -> None:
    """Raise ToolDefinitionError naming `param` when pydantic cannot make a JSON schema of it."""
    try:
        TypeAdapter(annotation).json_schema()
    except PydanticUserError as e:
        reason = str(e).splitlines()[0]
        raise ToolDefinitionError(f"parameter {param!r} of tool {tool_name} has an annotation "
                                  f"with no JSON schema: {reason}") from e


_DATA_KEYS = frozenset({"default", "const", "enum", "examples"})
"""Schema keywords whose values are data: their contents are left alone."""
_NAME_MAP_KEYS = frozenset({"properties", "patternProperties", "$defs", "definitions"})
"""Schema keywords whose keys are names (a property may be called "title"), not keywords."""


def _strip_titles(schema: Any) -> Any:
    """`schema` without "title" keywords (pydantic adds them everywhere; they waste tokens)."""
    if isinstance(schema, list):
        return [_strip_titles(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "title":
            continue
        if key in _DATA_KEYS:
            out[key] = value
        elif key in _NAME_MAP_KEYS and isinstance(value, dict):
            out[key] = {name: _strip_titles(sub) for name, sub in value.items()}
        else:
            out[key] = _strip_titles(value)
    return out


_ARGS_HEADER = re.compile(r"(Args|Arguments|Parameters|Keyword Args|Keyword Arguments):")
_GOOGLE_ARG = re.compile(r"(?P<name>\w+)\s*(\([^)]*\))?\s*:\s*(?P<doc>.*)")
_REST_PARAM = re.compile(r":param\s+(?:[^:]*\s)?(?P<name>\w+)\s*:\s*(?P<doc>.*)")


def _parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(summary, {parameter: description}) from a Google-style or reST docstring. The summary is
    the first paragraph; a parameter's description may continue on more-indented lines."""
    lines = (doc or "").splitlines()
    summary: list[str] = []
    for line in lines:
        text = line.strip()
        if not text or _ARGS_HEADER.fullmatch(text) or text.startswith(":"):
            break
        summary.append(text)
    params: dict[str, list[str]] = {}
    current: list[str] | None = None  # the description that more-indented lines continue
    entry_indent = 0
    section_indent: int | None = None  # indent of the `Args:` header while inside that section
    for line in lines:
        text = line.strip()
        if not text:
            continue
        indent = len(line) - len(line.lstrip())
        if section_indent is not None and indent <= section_indent:
            section_indent = None  # a line back at the header's level ends the section
        if current is not None and indent > entry_indent:
            current.append(text)
            continue
        current = None
        if _ARGS_HEADER.fullmatch(text):
            section_indent = indent
        elif (m := _REST_PARAM.fullmatch(text)) or (
                section_indent is not None and (m := _GOOGLE_ARG.fullmatch(text))):
            current = params[m["name"]] = [m["doc"]] if m["doc"] else []
            entry_indent = indent
    return " ".join(summary), {name: " ".join(words) for name, words in params.items() if words}


def _json_default(value: Any) -> Any:
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else str(value)


def _to_content(result: Any) -> str:
    """A tool's return value as the text the model sees."""
    if isinstance(result, str):
        return result
    if isinstance(result, BaseModel):
        return result.model_dump_json()
    return json.dumps(result, default=_json_default, ensure_ascii=False)
