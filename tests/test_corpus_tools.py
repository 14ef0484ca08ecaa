"""The corpus tools (tools/bfcl.py, tools/corpus.py): BFCL schemas as JSON Schema, ground-truth
call parsing, and assistant-token loss masks from the shipped chat template."""

from __future__ import annotations

import sys
from pathlib import Path

import jsonschema
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from bfcl import json_schema, parse_call, tool_schema  # noqa: E402
from corpus import Tokenized  # noqa: E402


def test_bfcl_types_become_json_schema():
    fn = {"name": "math.hypot", "description": "This tool belongs to the Math API, which does "
          "math. Tool description: Euclidean norm.", "parameters": {
              "type": "dict", "required": ["x", "y", "gone"], "properties": {
                  "x": {"type": "integer"}, "y": {"type": "float"},
                  "point": {"type": "tuple", "items": {"type": "float"}},
                  "opts": {"type": "dict", "properties": {"deep": {"type": "boolean"}}},
                  "anything": {"type": "any", "description": "free"}}}}
    tool = tool_schema(fn)
    params = tool["function"]["parameters"]
    assert tool["function"]["description"] == "Euclidean norm."
    jsonschema.Draft202012Validator.check_schema(params)
    assert params["required"] == ["x", "y"]  # a required name without a property is dropped
    assert params["properties"]["point"] == {"type": "array", "items": {"type": "number"}}
    assert "type" not in params["properties"]["anything"]
    jsonschema.validate({"x": 3, "y": 4.5, "point": [1.0], "opts": {"deep": True},
                         "anything": [1]}, params)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"x": 3.5, "y": 4}, params)


def test_java_arguments_are_source_strings():
    params = json_schema({"type": "dict", "properties": {
        "n": {"type": "long"}, "xs": {"type": "ArrayList", "items": {"type": "String"}}}},
        all_strings=True)
    assert params["properties"] == {"n": {"type": "string"}, "xs": {"type": "string"}}


def test_parse_call_reads_literals():
    assert parse_call("mv(source='a.txt', destination=\"b\")") == (
        "mv", [], {"source": "a.txt", "destination": "b"})
    assert parse_call("sort('f.pdf')") == ("sort", ["f.pdf"], {})
    assert parse_call("add(a=1.5, b=[1, 2], c={'k': None})") == (
        "add", [], {"a": 1.5, "b": [1, 2], "c": {"k": None}})
    with pytest.raises(ValueError):
        parse_call("x + 1")


def test_loss_mask_covers_exactly_the_assistant_turns():
    from agentflash.embedded import embedded_model_dir
    from agentflash.tokenizer import load_tokenizer

    tok = load_tokenizer(embedded_model_dir())
    enc = Tokenized(tok)
    conv = {"tools": [tool_schema({"name": "ls", "description": "List files.",
                                   "parameters": {"type": "dict", "properties": {}}})],
            "messages": [
                {"role": "user", "content": "list"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "ls", "arguments": {}}}]},
                {"role": "tool", "name": "ls", "content": "[\"a\"]"},
                {"role": "assistant", "content": "There is one file, a."}]}
    ex = enc.encode(conv)
    masked = tok.decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if m])
    assert masked == ('<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call><|im_end|>'
                      "There is one file, a.<|im_end|>")
    prompts = list(enc.prompts(conv))
    assert len(prompts) == 2
    assert tok.decode(prompts[1].reply) == "There is one file, a.<|im_end|>"
    assert tok.decode(prompts[1].ids).endswith("</tool_response><|im_end|>\n"
                                               "<|im_start|>assistant\n")


def test_drafter_data_adds_a_second_set_without_repeating_the_first(tmp_path: Path):
    from agentflash.embedded import embedded_model_dir
    from agentflash.training.data import read_jsonl
    from agentflash.training.regenerate import prompts_of
    from drafter_data import main

    corpus = str(Path(__file__).parent / "data" / "heldout.jsonl")
    tokenizer = str(embedded_model_dir())
    first, second, every = (tmp_path / f"{n}.jsonl" for n in ("first", "second", "every"))
    common = ["--corpus", corpus, "--tokenizer", tokenizer, "--per-conversation", "99"]
    main([*common, "--out", str(every)])
    main([*common, "--out", str(first), "--limit", "3"])
    main([*common, "--out", str(second), "--seed", "1", "--exclude", str(first)])
    a, b, n = (set(map(tuple, prompts_of(read_jsonl(f)))) for f in (first, second, every))
    assert len(a) == 3 and len(b) == len(n) - 3 > 0 and a | b == n
    # a long-prompt set: only the prompts of --min-prompt tokens or more
    cut = sorted(map(len, n))[len(n) // 2]
    long = tmp_path / "long.jsonl"
    main([*common, "--out", str(long), "--min-prompt", str(cut)])
    assert set(map(tuple, prompts_of(read_jsonl(long)))) == {p for p in n if len(p) >= cut}


def test_package_functions_drop_private_undocumented_and_stdlib_copies(tmp_path: Path):
    from build_corpus import code_conversations, package_functions

    vendored = 'def copied(x):\n    """A copy of a stdlib function\'s body."""\n    return x\n'
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text(vendored)
    (tmp_path / "pkg" / "sub" / "mod.py").write_text(
        'def kept(a, b=2):\n    """Add two numbers, the second one defaulting to two."""\n'
        '    return a + b\n\n'
        'def _private(a):\n    """Private helpers are not turns of their own."""\n    return a\n\n'
        'def bare(a):\n    b = a\n    return b\n')
    (tmp_path / "other.py").write_text('def outside(a):\n    """Not in a named package."""\n'
                                       '    return a\n')
    found = list(package_functions(tmp_path, ["pkg"], 40, exclude={vendored.rstrip()}))
    assert [(name, signature) for name, signature, _, _ in found] == [
        ("pkg.sub.mod.kept", "kept(a, b=2)")]
    turns = [conv for _, conv in code_conversations(iter(found), "package")]
    assert [c["source"] for c in turns] == ["package_code", "package_doc"]
    assert turns[0]["messages"][-1]["content"].startswith("```python\ndef kept(a, b=2):")
    assert turns[1]["messages"][-1]["content"] == ("Add two numbers, the second one defaulting "
                                                   "to two.")
