"""Tests for agentflash.toolcall_parser: examples per format, and chunking invariance by hypothesis."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentflash.toolcall_parser import (
    ArgumentsDelta,
    CallOpened,
    MalformedToolCall,
    ParsedToolCall,
    TextDelta,
    ToolCallParser,
    detect_format,
)

OPEN, CLOSE, PYTHON_TAG = "<tool_call>", "</tool_call>", "<|python_tag|>"


def run(fmt: str, chunks: list[str], stream: bool = False) -> tuple[list[Any], ToolCallParser]:
    parser = ToolCallParser(fmt, stream_calls=stream)
    events = [e for chunk in chunks for e in parser.feed(chunk)]
    return events + parser.finish(), parser


def merged(events: list[Any]) -> list[Any]:
    """Events with adjacent TextDeltas (and ArgumentsDeltas) joined: how text is split over
    deltas depends on the chunks."""
    out: list[Any] = []
    for e in events:
        if isinstance(e, (TextDelta, ArgumentsDelta)) and out and type(out[-1]) is type(e):
            out[-1] = type(e)(out[-1].text + e.text)
        else:
            out.append(e)
    return out


def call_json(name: str, arguments: Any, key: str = "arguments") -> str:
    return json.dumps({"name": name, key: arguments})


# ---------------------------------------------------------------- hermes examples


def test_hermes_single_call_with_split_tag():
    parser = ToolCallParser("hermes")
    assert parser.feed("Let me check.<tool_") == [TextDelta("Let me check.")]
    body = '{"name": "add", "arguments": {"a": 1}}'
    assert parser.feed(f"call>\n{body}\n</tool_call>") == [ParsedToolCall("add", {"a": 1}, body)]
    assert parser.finish() == []
    assert parser.text == "Let me check."
    assert parser.calls == [ParsedToolCall("add", {"a": 1}, body)]


def test_hermes_several_calls_with_text_around():
    a, b = call_json("get_weather", {"city": "Paris"}), call_json("add", {"a": 1, "b": 2})
    message = f"I'll do both.\n{OPEN}\n{a}\n{CLOSE}\n{OPEN}{b}{CLOSE}\nDone."
    events, parser = run("hermes", [message])
    assert merged(events) == [
        TextDelta("I'll do both.\n"),
        ParsedToolCall("get_weather", {"city": "Paris"}, a),
        TextDelta("\n"),
        ParsedToolCall("add", {"a": 1, "b": 2}, b),
        TextDelta("\nDone."),
    ]
    assert parser.text == "I'll do both.\n\n\nDone."
    assert [c.name for c in parser.calls] == ["get_weather", "add"]


def test_hermes_arguments_as_json_string_and_parameters_synonym():
    as_string = call_json("add", json.dumps({"a": 1}))
    as_parameters = call_json("add", {"a": 2}, key="parameters")
    no_arguments = json.dumps({"name": "now"})
    events, _ = run("hermes", [f"{OPEN}{s}{CLOSE}" for s in (as_string, as_parameters, no_arguments)])
    assert events == [
        ParsedToolCall("add", {"a": 1}, as_string),
        ParsedToolCall("add", {"a": 2}, as_parameters),
        ParsedToolCall("now", {}, no_arguments),
    ]


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "add", "arguments": {"a": 1}',  # malformed JSON
        "not json at all",
        "",
        '{"name": "a"} trailing',
        '{"arguments": {"a": 1}}',  # missing name
        '{"name": 7, "arguments": {}}',
        '{"name": "add", "arguments": [1, 2]}',
        '{"name": "add", "arguments": "not json"}',
        '{"name": "add", "arguments": "[1]"}',
        '["add", {}]',
    ],
)
def test_hermes_malformed_call_is_reported_and_parsing_continues(body):
    good = call_json("ok", {})
    events, parser = run("hermes", [f"a{OPEN}\n{body}\n{CLOSE}b{OPEN}{good}{CLOSE}"])
    assert merged(events)[0] == TextDelta("a")
    bad = merged(events)[1]
    assert isinstance(bad, MalformedToolCall) and bad.raw == body.strip() and bad.reason
    assert merged(events)[2:] == [TextDelta("b"), ParsedToolCall("ok", {}, good)]
    assert parser.text == "ab"
    assert parser.calls == [ParsedToolCall("ok", {}, good)]


def test_hermes_unterminated_valid_call_is_emitted_at_finish():
    body = call_json("add", {"a": 1})
    for tail in ("", "\n", "\n</tool_", "</tool_call"):
        parser = ToolCallParser("hermes")
        assert parser.feed(f"x{OPEN}\n{body}{tail}") == [TextDelta("x")]
        assert parser.finish() == [ParsedToolCall("add", {"a": 1}, body)]


def test_hermes_unterminated_invalid_call_is_malformed():
    events, _ = run("hermes", [f"x{OPEN}", '{"name": "add", "argum'])
    assert events[0] == TextDelta("x")
    assert isinstance(events[1], MalformedToolCall)
    assert events[1].raw == '{"name": "add", "argum'
    assert "unterminated" in events[1].reason


@pytest.mark.parametrize(
    "text",
    [
        "if a < b and c > d: return",
        "use the <tool> element",
        "<tool_call without a bracket",
        "the closing tag </tool_call> alone is just text",
        "<<tool_cal<tool_>",
        "ends with <tool_call",
        "ends with <",
    ],
)
def test_hermes_tag_lookalikes_are_text_unchanged(text):
    for chunks in ([text], list(text)):
        events, parser = run("hermes", chunks)
        assert merged(events) == [TextDelta(text)]
        assert parser.text == text and parser.calls == []


def test_hermes_streams_a_calls_name_then_its_arguments_as_written():
    """Name first and an object of arguments (what the grammar writes): the call opens once the
    name is known and its arguments' text streams as it is written; the call itself follows,
    with that text."""
    body = '{"name": "edit", "arguments": {"path": "a.py", "text": "x = \\"}\\"\\n", "n": [1, {}]}}'
    parser = ToolCallParser("hermes", stream_calls=True)
    assert parser.feed(f"ok {OPEN}\n" + body[:16]) == [TextDelta("ok ")]
    opened = parser.feed(body[16:33])
    assert opened == [CallOpened("edit"), ArgumentsDelta('{"p')]
    rest = parser.feed(body[33:]) + parser.feed(f"\n{CLOSE}")
    call = rest[-1]
    assert isinstance(call, ParsedToolCall) and call.arguments["text"] == 'x = "}"\n'
    assert '{"p' + "".join(e.text for e in rest[:-1]) == call.arguments_text == body[30:-1]
    # arguments before the name, or written as a string: the call comes whole
    for late in ('{"arguments": {"a": 1}, "name": "f"}', '{"name": "f", "arguments": "{}"}'):
        events, _ = run("hermes", [OPEN + late + CLOSE], stream=True)
        assert [type(e) for e in events] == [ParsedToolCall]
        assert json.loads(events[0].arguments_text) == events[0].arguments


def test_hermes_streams_text_that_cannot_start_a_tag():
    parser = ToolCallParser("hermes")
    assert parser.feed("1 <") == [TextDelta("1 ")]
    assert parser.feed(" 2 <tool_c") == [TextDelta("< 2 ")]
    assert parser.feed("at") == [TextDelta("<tool_cat")]
    assert parser.feed("<tool_call") == []
    assert parser.finish() == [TextDelta("<tool_call")]


# ---------------------------------------------------------------- llama3_json examples


def test_llama3_call_with_and_without_python_tag():
    body = call_json("get_weather", {"city": "Oslo"}, key="parameters")
    expected = [ParsedToolCall("get_weather", {"city": "Oslo"}, body)]
    for message in (f"{PYTHON_TAG}{body}", f"\n {body}\n", f"{PYTHON_TAG}\n{body}"):
        events, parser = run("llama3_json", [message])
        assert events == expected
        assert parser.text == "" and parser.calls == expected


def test_llama3_several_calls_separated_by_semicolons_or_newlines():
    a = call_json("a", {"x": "1; 2"}, key="parameters")
    b = call_json("b", {}, key="arguments")
    expected = [ParsedToolCall("a", {"x": "1; 2"}, a), ParsedToolCall("b", {}, b)]
    for sep in (";", "; ", "\n", ";\n"):
        assert run("llama3_json", [f"{PYTHON_TAG}{a}{sep}{b}"])[0] == expected
        assert run("llama3_json", [f"{a}{sep}{b};"])[0] == expected


def test_llama3_calls_are_buffered_until_finish():
    parser = ToolCallParser("llama3_json")
    assert parser.feed('  {"name": "a", ') == []
    assert parser.feed('"parameters": {}}') == []
    assert parser.finish() == [ParsedToolCall("a", {}, '{"name": "a", "parameters": {}}')]


@pytest.mark.parametrize(
    "text", ["Hello! How can I help?", "  \n Sure, here: {x}", "<b>bold</b>", "<|pyth", "   ", ""]
)
def test_llama3_plain_text(text):
    for chunks in ([text], list(text)):
        events, parser = run("llama3_json", chunks)
        assert merged(events) == ([TextDelta(text)] if text else [])
        assert parser.text == text and parser.calls == []


def test_llama3_plain_text_streams_once_decided():
    parser = ToolCallParser("llama3_json")
    assert parser.feed(" \n") == []
    assert parser.feed("<|p") == []
    assert parser.feed("x") == [TextDelta(" \n<|px")]
    assert parser.feed(" more") == [TextDelta(" more")]
    assert parser.finish() == []


@pytest.mark.parametrize(
    "message",
    [
        '{"name": "a", "parameters": {}',
        '{"name": "a", "parameters": {}} and some prose',
        f'{PYTHON_TAG}brave_search.call(query="x")',
        PYTHON_TAG,
        "{ not json",
    ],
)
def test_llama3_unparsable_calls_message_is_malformed(message):
    events, parser = run("llama3_json", [message])
    assert len(events) == 1 and isinstance(events[0], MalformedToolCall) and events[0].reason
    assert parser.text == "" and parser.calls == []


def test_llama3_object_that_is_not_a_call_is_malformed():
    events, _ = run("llama3_json", ['{"answer": 42}'])
    assert events == [MalformedToolCall('{"answer": 42}', 'missing string "name"')]


# ---------------------------------------------------------------- API


def test_detect_format():
    assert detect_format("{% for t in tools %}<tool_call>{{ t }}</tool_call>{% endfor %}") == "hermes"
    assert detect_format("<|start_header_id|>system<|end_header_id|>") == "llama3_json"
    assert detect_format("{{ '<|python_tag|>' }}") == "llama3_json"
    assert detect_format("<|im_start|>user") == "hermes"
    assert detect_format(None) == "hermes"


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_feed_after_finish_raises(fmt):
    parser = ToolCallParser(fmt)
    parser.feed("hi")
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("more")
    with pytest.raises(RuntimeError):
        parser.finish()


def test_unknown_format_raises():
    with pytest.raises(ValueError, match="unknown"):
        ToolCallParser("mistral")


# ---------------------------------------------------------------- chunking invariance

TEXT = st.lists(
    st.sampled_from(
        ["a", " ", "\n", "<", ">", "/", "_", "|", "{", "}", ";", "é", "🙂",
         "tool", "call", "<tool", "<tool_call", "tool_call>", CLOSE, "<|python", PYTHON_TAG]
    ),
    max_size=12,
).map("".join)
ARGUMENTS = st.dictionaries(
    st.text("ab<>/", max_size=3),
    st.one_of(st.integers(), st.booleans(), st.none(), st.text("x <>/{};\n\"", max_size=6)),
    max_size=3,
)
SPACE = st.sampled_from(["", " ", "\n", " \n "])
MALFORMED = st.sampled_from(
    ["", "{", "not json", '{"arguments": {}}', '{"name": 3}', '{"name": "x", "arguments": [1]}']
)


@st.composite
def valid_call(draw: st.DrawFn, keys: tuple[str, ...]) -> tuple[str, ParsedToolCall]:
    """A call's JSON text (with whitespace around) and the event it should parse to."""
    name = draw(st.sampled_from(["add", "get_weather", "x"]))
    arguments = draw(ARGUMENTS)
    written = draw(st.sampled_from([arguments, json.dumps(arguments)]))
    raw = call_json(name, written, key=draw(st.sampled_from(keys)))
    return draw(SPACE) + raw + draw(SPACE), ParsedToolCall(name, arguments, raw)


def streamed(call: ParsedToolCall) -> list[Any]:
    """A hermes call's events: opened and its arguments streamed when they are an object."""
    if isinstance(json.loads(call.raw).get("arguments", json.loads(call.raw).get("parameters")),
                  dict):
        return [CallOpened(call.name), ArgumentsDelta(call.arguments_text), call]
    return [call]


@st.composite
def hermes_message(draw: st.DrawFn, stream: bool) -> tuple[str, list[Any]]:
    """A message of text and tool-call spans, and the merged events it should parse to (with
    the calls' arguments streamed, if `stream`)."""
    text_piece = TEXT.filter(lambda t: OPEN not in t)
    message, expected = "", []
    for _ in range(draw(st.integers(0, 3))):
        text = draw(text_piece)
        if draw(st.booleans()):
            body, call = draw(valid_call(("arguments", "parameters")))
            events = streamed(call) if stream else [call]
        else:
            body = draw(SPACE) + draw(MALFORMED) + draw(SPACE)
            events = [MalformedToolCall(body.strip(), "")]
        message += text + OPEN + body + CLOSE
        expected += ([TextDelta(text)] if text else []) + events
    text = draw(text_piece)
    message += text
    expected += [TextDelta(text)] if text else []
    if draw(st.booleans()):  # cut off inside a final call
        body, call = draw(valid_call(("arguments",)))
        message += OPEN + body + draw(st.sampled_from(["", "<", "</tool_call"]))
        expected += streamed(call) if stream else [call]
    return message, expected


@st.composite
def llama3_message(draw: st.DrawFn) -> tuple[str, list[Any]]:
    if draw(st.booleans()):
        text = draw(TEXT.filter(lambda t: not t.lstrip().startswith(("{", PYTHON_TAG))))
        return text, [TextDelta(text)] if text else []
    calls = draw(st.lists(valid_call(("parameters", "arguments")), min_size=1, max_size=3))
    separator = draw(st.sampled_from([";", "; ", "\n", ";\n"]))
    tag = draw(st.sampled_from(["", PYTHON_TAG]))
    message = draw(SPACE) + tag + separator.join(body for body, _ in calls) + draw(SPACE)
    return message, [event for _, event in calls]


def cut(message: str, points: list[int]) -> list[str]:
    bounds = [0, *sorted(set(points)), len(message)]
    return [message[a:b] for a, b in zip(bounds, bounds[1:])]


def same_events(actual: list[Any], expected: list[Any]) -> bool:
    """Equal, except that a MalformedToolCall's reason is not compared."""
    def key(e: Any) -> Any:
        return ("malformed", e.raw) if isinstance(e, MalformedToolCall) else e

    return [key(e) for e in actual] == [key(e) for e in expected]


@pytest.mark.parametrize("fmt, messages, stream", [
    ("hermes", hermes_message(False), False), ("hermes", hermes_message(True), True),
    ("llama3_json", llama3_message(), False), ("llama3_json", llama3_message(), True)])
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_any_chunking_gives_the_same_events(fmt, messages, stream, data):
    message, expected = data.draw(messages)
    points = data.draw(st.lists(st.integers(0, len(message)), max_size=10))
    whole, whole_parser = run(fmt, [message], stream)
    for chunks in (cut(message, points), list(message)):
        events, parser = run(fmt, chunks, stream)
        assert merged(events) == merged(whole)
        assert parser.text == whole_parser.text and parser.calls == whole_parser.calls
    assert same_events(merged(whole), expected)
    visible = "".join(e.text for e in expected if isinstance(e, TextDelta))
    assert "".join(e.text for e in whole if isinstance(e, TextDelta)) == whole_parser.text == visible
    assert whole_parser.calls == [e for e in expected if isinstance(e, ParsedToolCall)]
    for i, e in enumerate(merged(whole)):  # a call's streamed arguments are its arguments
        if isinstance(e, ArgumentsDelta):
            assert json.loads(e.text) == merged(whole)[i + 1].arguments
