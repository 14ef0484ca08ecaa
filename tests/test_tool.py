"""Tools from typed functions and JSON-schema dicts: schemas, validation, execution (asyncio and
trio), and the errors users see."""

from __future__ import annotations

import importlib
import json
import threading
from typing import Any, Callable, Literal, Optional

import anyio
import pytest
from pydantic import BaseModel, Field

from agentflash.errors import ToolArgumentsError, ToolDefinitionError, ToolSchemaError
from agentflash.tool import Tool, ToolOutcome, as_tool, tool


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


class Location(BaseModel):
    """Where to search."""

    city: str
    title: str = "home"  # a property called "title" must survive title stripping


@tool
def add(a: int, b: int = 2) -> int:
    """Add two integers.

    Args:
        a: first addend
        b: second addend
    """
    return a + b


@tool
def search(query: str, where: Location, mode: Literal["fast", "deep"] = "fast",
           limit: Optional[int] = None, tags: list[str] | None = None) -> list[str]:
    """Search the index for documents.

    Searches titles and bodies.

    Args:
        query (str): what to look for; may span
            several lines of description.
        where: the place
        mode: how hard to try
    Returns:
        matching ids
    """
    return [query, where.city, mode]


def rest_documented(x: int, y: dict[str, int]) -> None:
    """Do a reST thing.

    :param x: the x,
        continued
    :param dict y: the y
    :returns: nothing
    """


@tool
async def async_add(a: int, b: int) -> int:
    """Add, asynchronously."""
    await anyio.sleep(0)
    return a + b


FINISH = threading.Event()
"""What the waiting tools wait for; never set while a test waits on them (so each can only time
out), set after each test so that no worker thread stays blocked."""


@pytest.fixture(autouse=True)
def _finish_waiting_tools():
    FINISH.clear()
    yield
    FINISH.set()


@tool(timeout=0.2)
def waits_sync() -> str:
    FINISH.wait()
    return "late"


@tool(timeout=0.2)
async def waits_async() -> str:
    await anyio.Event().wait()  # never set
    return "late"


@tool
def boom() -> None:
    raise ValueError("boom")


@tool(timeout=5.0)
def own_timeout() -> None:
    raise TimeoutError("upstream took too long")


def keys_anywhere(schema: Any, parent: str | None = None) -> set[str]:
    """Every schema keyword in `schema` (property and $defs names are not keywords)."""
    if isinstance(schema, list):
        return set().union(*(keys_anywhere(s) for s in schema))
    if not isinstance(schema, dict):
        return set()
    found = set() if parent in ("properties", "$defs") else set(schema)
    return found.union(*(keys_anywhere(v, k) for k, v in schema.items()))


# -- schemas from functions ----------------------------------------------------------------------


def test_documented_function_schema() -> None:
    assert isinstance(add, Tool)
    assert add.name == "add" and add.description == "Add two integers."
    assert add.timeout is None
    assert add.parameters == {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "description": "first addend"},
            "b": {"type": "integer", "default": 2, "description": "second addend"},
        },
        "required": ["a"],
    }
    assert add.openai_schema() == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.", "parameters": add.parameters}}


def test_rich_annotations_schema() -> None:
    params = search.parameters
    props = params["properties"]
    assert search.description == "Search the index for documents."
    assert params["required"] == ["query", "where"]
    assert props["query"] == {
        "type": "string",
        "description": "what to look for; may span several lines of description.",
    }
    assert props["where"] == {"$ref": "#/$defs/Location", "description": "the place"}
    assert params["$defs"]["Location"] == {
        "type": "object",
        "description": "Where to search.",
        "properties": {"city": {"type": "string"},
                       "title": {"type": "string", "default": "home"}},
        "required": ["city"],
    }
    assert props["mode"]["enum"] == ["fast", "deep"] and props["mode"]["default"] == "fast"
    assert props["limit"] == {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None}
    assert props["tags"]["anyOf"][0] == {"type": "array", "items": {"type": "string"}}
    assert "title" not in keys_anywhere(params)
    assert "title" in params["$defs"]["Location"]["properties"]


def test_rest_docstring_and_unannotated_parameters() -> None:
    t = Tool.from_function(rest_documented)
    assert t.description == "Do a reST thing."
    assert t.parameters["properties"]["x"]["description"] == "the x, continued"
    assert t.parameters["properties"]["y"]["description"] == "the y"

    def untyped(value, flag=True):
        return value

    u = Tool.from_function(untyped)
    assert u.description == ""
    assert u.parameters == {"type": "object", "properties": {"value": {},
                            "flag": {"default": True}}, "required": ["value"]}
    assert u.validate({"value": [1, "x"]}) == {"value": [1, "x"], "flag": True}


def test_decorator_options_and_direct_calls() -> None:
    @tool(name="sum.v2", description="Sum it.", timeout=3.0)
    def summed(a: int) -> int:
        """Ignored summary."""
        return a

    assert (summed.name, summed.description, summed.timeout) == ("sum.v2", "Sum it.", 3.0)
    assert summed(4) == 4
    assert add(1, 2) == 3 and add(a=5) == 7
    coro = async_add(1, 2)
    assert anyio.run(lambda: coro) == 3
    assert tool()(add.fn).parameters == add.parameters


def test_parameter_names_that_clash_with_pydantic() -> None:
    def clash(json: int, model_config: str, _private: bool = False) -> None: ...

    t = Tool.from_function(clash)
    assert list(t.parameters["properties"]) == ["json", "model_config", "_private"]
    assert t.validate({"json": "1", "model_config": "x"}) == {
        "json": 1, "model_config": "x", "_private": False}


class Opaque:
    pass


def star_args(*items: int) -> None: ...
def star_kwargs(**options: int) -> None: ...
def positional_only(a: int, /) -> None: ...
def opaque(thing: Opaque) -> None: ...
def callback(fn: Callable[[int], int]) -> None: ...
def unresolved(x) -> None: ...
def rejected_field(x: int = Field(discriminator="kind")) -> None: ...


unresolved.__annotations__["x"] = "NoSuchType"  # as if its module forgot an import


@pytest.mark.parametrize("fn, match", [
    (star_args, "'items'.*named arguments"),
    (star_kwargs, "'options'.*named arguments"),
    (positional_only, "'a'.*positional-only"),
    (opaque, "parameter 'thing' of tool opaque"),
    (callback, "parameter 'fn' of tool callback"),
    (rejected_field, "cannot build a schema for tool rejected_field: .*discriminated union"),
    (lambda x: x, "tool name '<lambda>'"),
    (unresolved, "cannot read the signature of tool unresolved: name 'NoSuchType'"),
])
def test_functions_that_cannot_be_tools(fn: Callable[..., Any], match: str) -> None:
    with pytest.raises(ToolDefinitionError, match=match):
        Tool.from_function(fn)


def test_bad_timeout() -> None:
    with pytest.raises(ToolDefinitionError, match="timeout"):
        tool(timeout=0)(add.fn)
    with pytest.raises(ToolDefinitionError, match="timeout"):
        Tool.from_function(add.fn, timeout=-1.0)


# -- validation -----------------------------------------------------------------------------------


def test_validate_coerces_to_python_values() -> None:
    args = search.validate({"query": "q", "where": {"city": "Oslo"}, "limit": "3"})
    assert args == {"query": "q", "where": Location(city="Oslo"), "mode": "fast", "limit": 3,
                    "tags": None}
    assert isinstance(args["where"], Location)
    assert search.fn(**args) == ["q", "Oslo", "fast"]


@pytest.mark.parametrize("arguments, match", [
    ({"a": 1, "b": "two"}, r"^invalid arguments for add: b: Input should be a valid integer"),
    ({"b": 1}, r"^invalid arguments for add: a: Field required$"),
    ('{"a": 1}', r"^invalid arguments for add: expected a JSON object, got str$"),
])
def test_validate_errors(arguments: Any, match: str) -> None:
    with pytest.raises(ToolArgumentsError, match=match):
        add.validate(arguments)


def test_validate_nested_error_names_the_path() -> None:
    with pytest.raises(ToolArgumentsError) as info:
        search.validate({"query": "q", "where": {}, "mode": "slow"})
    message = str(info.value)
    assert message.startswith("invalid arguments for search: ")
    assert "where.city: Field required" in message and "mode: Input should be 'fast' or 'deep'" \
        in message


# -- schema-only tools ----------------------------------------------------------------------------

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"],
}


def test_from_schema_accepts_openai_and_bare_shapes() -> None:
    spec = {"type": "function", "function": {
        "name": "get_weather", "description": "Weather forecast.", "parameters": WEATHER_PARAMS}}
    openai = Tool.from_schema(spec)
    bare = Tool.from_schema(spec["function"])
    assert openai == bare
    assert (openai.name, openai.description, openai.parameters, openai.fn, openai.timeout) == (
        "get_weather", "Weather forecast.", WEATHER_PARAMS, None, None)
    assert openai.openai_schema() == spec
    minimal = Tool.from_schema({"name": "ping"})
    assert minimal.description == ""
    assert minimal.parameters == {"type": "object", "properties": {}}


@pytest.mark.parametrize("spec, match", [
    ([], "must be a dict"),
    ({"type": "retrieval", "function": {"name": "x"}}, "unsupported tool type 'retrieval'"),
    ({"type": "function", "function": "x"}, "'function' of a tool schema must be a dict"),
    ({"description": "no name"}, "tool name None"),
    ({"name": ""}, "tool name ''"),
    ({"name": "has space"}, "tool name 'has space'"),
    ({"name": "x", "description": 3}, "description of tool x must be a string"),
    ({"name": "x", "parameters": []}, '"type": "object"'),
    ({"name": "x", "parameters": {"type": "string"}}, '"type": "object"'),
    ({"name": "x", "parameters": {"type": "object", "properties": {"a": {"type": "int"}}}},
     "invalid parameters schema for tool x"),
    ({"name": "x", "parameters": {"type": "object", "required": "a"}},
     "invalid parameters schema for tool x"),
])
def test_from_schema_rejects_malformed_specs(spec: Any, match: str) -> None:
    for _ in range(2):  # the second time from the cache of checked schemas
        with pytest.raises(ToolSchemaError, match=match):
            Tool.from_schema(spec)


def test_a_resent_schema_is_checked_once_and_non_json_schemas_every_time() -> None:
    tool_module = importlib.import_module("agentflash.tool")  # (agentflash.tool: the decorator)
    spec = {"name": "lookup_cache_probe", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "enum": ["a", "b"]}}}}
    Tool.from_schema(spec)
    checks = tool_module._checked.cache_info()
    Tool.from_schema(json.loads(json.dumps(spec)))  # the same schema, another object
    after = tool_module._checked.cache_info()
    assert after.hits == checks.hits + 1 and after.misses == checks.misses
    # a tuple is no JSON array for the metaschema: checked as given, never from the cache
    bad = {"name": "x", "parameters": {"type": "object", "required": ("q",)}}
    for _ in range(2):
        with pytest.raises(ToolSchemaError, match="invalid parameters schema"):
            Tool.from_schema(bad)
    assert tool_module._checked.cache_info().misses == after.misses


def test_schema_tool_validation_and_no_code() -> None:
    weather = Tool.from_schema({"name": "get_weather", "parameters": WEATHER_PARAMS})
    arguments = {"city": "Oslo", "days": 2}
    assert weather.validate(arguments) is arguments
    with pytest.raises(ToolArgumentsError, match=r"^invalid arguments for get_weather: days: 0 is "
                                                 r"less than the minimum of 1$"):
        weather.validate({"city": "Oslo", "days": 0})
    with pytest.raises(ToolArgumentsError, match="'city' is a required property"):
        weather.validate({})
    with pytest.raises(ToolDefinitionError, match="schema-only"):
        weather()
    with pytest.raises(ToolDefinitionError, match="schema-only"):
        anyio.run(weather.execute, arguments)


def test_as_tool() -> None:
    assert as_tool(add) is add
    assert as_tool(rest_documented).name == "rest_documented"
    assert as_tool({"name": "ping"}).fn is None
    with pytest.raises(ToolDefinitionError, match="cannot make a tool from int"):
        as_tool(3)  # type: ignore[arg-type]


# -- execution ------------------------------------------------------------------------------------


class Reply(BaseModel):
    text: str


def returns(value: Any) -> Tool:
    return Tool.from_function(lambda: value, name="returns")


@pytest.mark.anyio
@pytest.mark.parametrize("value, content", [
    ("plain text", "plain text"),
    (None, "null"),
    ({"temp": 21.5, "city": "Zürich"}, '{"temp": 21.5, "city": "Zürich"}'),
    (Reply(text="hi"), '{"text":"hi"}'),
    ([Reply(text="a")], '[{"text": "a"}]'),
])
async def test_execute_result_becomes_text(value: Any, content: str) -> None:
    outcome = await returns(value).execute({})
    assert (outcome.content, outcome.error) == (content, None)


@pytest.mark.anyio
async def test_execute_sync_and_async_tools() -> None:
    outcome = await add.execute({"a": "40"})
    assert isinstance(outcome, ToolOutcome)
    assert (outcome.content, outcome.error) == ("42", None)
    assert outcome.elapsed_s >= 0
    outcome = await async_add.execute({"a": 1, "b": 2})
    assert (outcome.content, outcome.error) == ("3", None)


@pytest.mark.anyio
async def test_execute_failures_become_outcomes() -> None:
    invalid = await add.execute({"a": 1, "b": "two"})
    assert invalid.error == "invalid_arguments"
    assert invalid.content.startswith(
        "Error: invalid arguments for add: b: Input should be a valid integer")
    not_object = await add.execute([1])  # type: ignore[arg-type]
    assert (not_object.content, not_object.error) == (
        "Error: invalid arguments for add: expected a JSON object, got list", "invalid_arguments")
    failed = await boom.execute({})
    assert (failed.content, failed.error) == ("Error: ValueError: boom", "exception")
    # A TimeoutError raised by the tool itself is the tool's exception, not our timeout.
    own = await own_timeout.execute({})
    assert (own.content, own.error) == ("Error: TimeoutError: upstream took too long", "exception")


@pytest.mark.anyio
@pytest.mark.parametrize("waits", [waits_sync, waits_async], ids=["sync", "async"])
async def test_execute_timeout_abandons_the_tool(waits: Tool) -> None:
    """A tool that cannot finish is abandoned at its timeout (it returns at all only so)."""
    outcome = await waits.execute({})
    assert outcome.error == "timeout"
    assert outcome.content == f"Error: tool {waits.name} timed out after 0.2 s"
    assert outcome.elapsed_s >= 0.19  # not before its timeout (clocks round differently)


@pytest.mark.anyio
async def test_sync_tool_does_not_block_the_event_loop() -> None:
    """A sync tool runs on a worker thread: it can wait for the event loop itself."""
    ticked = threading.Event()

    @tool
    def waits_for_the_loop() -> str:
        """Returns once the event loop has run a task."""
        return "the loop ran" if ticked.wait(300) else "the loop was blocked"

    async def ticker() -> None:
        for _ in range(3):
            await anyio.sleep(0)
        ticked.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        outcome = await waits_for_the_loop.execute({})
    assert (outcome.content, outcome.error) == ("the loop ran", None)
