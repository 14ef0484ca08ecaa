"""The one rule for text and calls (agentflash.reply_parser): without calls allowed the text is
the content, markup included; with them, a call that does not parse, is cut off or is one too
many stays in the content as written; the streamed text is the returned content, however the
reply is cut into chunks."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from agentflash.reply_parser import ReplyParser
from agentflash.request import CallArguments, CallChunk, CallStart, TextChunk
from agentflash.toolcall_parser import ParsedToolCall, ToolCallParser

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def run(text: str, cuts: list[int] = (), **kw: Any) -> tuple[ReplyParser, list[Any]]:
    ids = iter(range(100))
    parser = ReplyParser("hermes", new_id=lambda: f"call_{next(ids)}", **kw)
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(text)), len(text)]
    events = [e for a, b in zip(bounds, bounds[1:]) for e in parser.feed(text[a:b])]
    return parser, events + parser.finish()


def streamed(events: list[Any]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextChunk))


def test_without_calls_allowed_the_markup_is_the_content():
    reply = f"Sure.\n{CALL}\nDone."
    parser, events = run(reply, calls_allowed=False)
    assert parser.text == reply and streamed(events) == reply
    assert parser.calls == [] and parser.malformed == []


def test_a_call_is_parsed_and_the_text_around_it_kept():
    parser, events = run(f"Let me add.\n{CALL}\n", calls_allowed=True)
    assert parser.text == streamed(events) == "Let me add."
    [call] = parser.calls
    assert (call.name, call.arguments, call.id) == ("add", {"a": 1, "b": 2}, "call_0")
    assert [type(e) for e in events if not isinstance(e, TextChunk)] == [CallChunk]


def test_a_call_that_does_not_parse_stays_in_the_content():
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>'
    parser, events = run(f"Hm. {bad} Then {CALL}", calls_allowed=True)
    assert parser.text == streamed(events) == f"Hm. {bad} Then"
    [malformed] = parser.malformed
    assert malformed.markup == bad and "invalid JSON" in malformed.reason
    assert [c.name for c in parser.calls] == ["add"]


def test_a_call_cut_off_by_max_tokens_stays_in_the_content():
    cut = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b'
    parser, events = run(f"Adding. {cut}", calls_allowed=True, stream_calls=True)
    assert parser.text == streamed(events) == f"Adding. {cut}"
    assert parser.calls == [] and "unterminated" in parser.malformed[0].reason
    # its name and arguments streamed while it was written (as OpenAI streams a cut call)
    assert [type(e) for e in events if not isinstance(e, TextChunk)] == [CallStart,
                                                                         CallArguments]


def test_a_second_call_without_parallel_calls_stays_in_the_content():
    second = CALL.replace('"a": 1', '"a": 5')
    parser, events = run(f"{CALL}{second}", calls_allowed=True, parallel=False)
    assert [c.arguments["a"] for c in parser.calls] == [1]
    assert parser.text == streamed(events) == second
    assert "parallel_tool_calls" in parser.malformed[0].reason


def test_calls_stream_as_written_where_asked():
    parser, events = run(CALL, [15, 33, 40], calls_allowed=True, stream_calls=True)
    kinds = [type(e) for e in events]
    assert kinds[0] is CallStart and kinds[-1] is CallChunk and CallArguments in kinds
    args = "".join(e.text for e in events if isinstance(e, CallArguments))
    assert json.loads(args) == {"a": 1, "b": 2}
    assert events[-1].streamed and parser.text == ""


def test_a_call_the_server_parsed_follows_the_same_rule():
    parser = ReplyParser("hermes", calls_allowed=True, parallel=False)
    assert [type(e) for e in parser.server_call("c1", "add", '{"a": 1}', "A")] == [CallChunk]
    assert parser.server_call("c2", "add", '{"a": 2}', "B") == [TextChunk("B")]
    assert parser.server_call("c3", "add", '{"a": ', "C") == [TextChunk("C")]
    assert [c.id for c in parser.calls] == ["c1"] and parser.text == "BC"
    assert len(parser.malformed) == 2


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["  ", "\n", "Hi", " there", CALL, "<tool", "_call>",
                                 '{"name": "x"}', "</tool_call>", "!", "\t"]), max_size=8),
       st.lists(st.integers(0, 400), max_size=6), st.booleans(), st.booleans())
def test_the_streamed_text_is_the_content_however_it_is_cut(parts, cuts, allowed, parallel):
    reply = "".join(parts)
    parser, events = run(reply, cuts, calls_allowed=allowed, parallel=parallel,
                         stream_calls=True)
    assert streamed(events) == parser.text
    if not allowed:
        assert parser.text == reply.strip()
    # nothing dropped: the content and the markup of the calls taken are the whole reply
    taken = ""
    if allowed:
        plain = ToolCallParser("hermes")
        found = [e for e in plain.feed(reply) + plain.finish() if isinstance(e, ParsedToolCall)]
        taken = "".join(e.markup for e in found[:len(parser.calls)])
    assert sorted("".join((parser.text + taken).split())) == sorted("".join(reply.split()))
