"""Build the agent-conversation corpus the embedded model and its drafter train on, offline.

    python tools/build_corpus.py --bfcl bfcl_eval-2026.3.23-py3-none-any.whl --out corpus/

Sources (all available without a model hub):
- BFCL non-live single-turn categories: the question, the task's tools, and an assistant turn
  calling the ground-truth functions (irrelevance: an assistant turn that declines to call).
- BFCL multi-turn base and long-context tasks: each turn's ground-truth calls are executed for real
  against BFCL's backends (file system, trading bot, ...), and their genuine results come back as
  tool messages before a short assistant summary. The tool list is the functions the task uses plus
  distractors from the same backends, up to --max-tools, so prompts fit the model's context.
- Python's standard library: functions with docstrings become code-writing turns (the docstring's
  summary asks, the source answers) and explanation turns (the qualified name asks, the docstring
  answers).

Splits are fixed by task id (a multi-turn task's base and long-context versions share one id) via a
hash: 90% train, 5% validation, 5% test. The test split is never used for training.
Writes {train,validation,test}.jsonl, one conversation per line:
    {"id", "source", "tools": [OpenAI-shape tools], "messages": [chat messages]}
where assistant tool calls are `{"type": "function", "function": {"name", "arguments": {...}}}`.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import inspect
import json
import random
import sysconfig
import textwrap
from pathlib import Path
from typing import Iterator

from bfcl import (MULTI_TURN, SINGLE_TURN, Bfcl, MultiTurnRun, MultiTurnTask, multi_turn,
                  single_turn, tool_schema)

SPLITS = ("train", "validation", "test")
SYSTEM = "You are a helpful assistant."
DECLINE = ("None of the available functions can answer this, so I will not call any of them. "
           "{question}")
SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo", "__pycache__",
             "ensurepip", "tkinter", "pydoc_data"}


def split_of(key: str) -> str:
    bucket = int(hashlib.sha256(key.encode()).hexdigest(), 16) % 100
    return "train" if bucket < 90 else "validation" if bucket < 95 else "test"


def conversation(id: str, source: str, messages: list[dict], tools: list[dict] | None = None):
    return {"id": id, "source": source, "tools": tools or [], "messages": messages}


def tool_calls(calls: list[dict]) -> list[dict]:
    return [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls]


def single_turn_conversations(bfcl: Bfcl) -> Iterator[tuple[str, dict]]:
    for category in SINGLE_TURN:
        for task in single_turn(bfcl, category):
            messages = [dict(m) for m in task.question]
            if task.calls:
                messages.append({"role": "assistant", "content": "",
                                 "tool_calls": tool_calls(task.calls)})
            else:
                question = messages[-1]["content"]
                messages.append({"role": "assistant",
                                 "content": DECLINE.format(question=f"You asked: {question}")})
            yield task.id, conversation(task.id, category, messages, task.tools)


def summary(calls: list[tuple[str, dict]], results: list[str]) -> str:
    """The assistant's closing words for a turn: what it called and what came back last."""
    names = ", ".join(dict.fromkeys(name for name, _ in calls))
    last = results[-1] if results else ""
    if len(last) > 300:
        last = last[:300] + " ..."
    if last.startswith("Error during execution"):
        return f"I called {names}, but the last call failed: {last}"
    return f"I called {names}. The result was: {last}"


def multi_turn_conversation(bfcl: Bfcl, task: MultiTurnTask, max_tools: int,
                            rng: random.Random) -> dict:
    run = MultiTurnRun(bfcl, task)
    used = [p.split(".", 1)[1] for p in task.path if p.split(".", 1)[1] in run.docs]
    for turn in task.calls:
        used += [run.arguments(c)[0] for c in turn]
    used = list(dict.fromkeys(used))
    others = [n for n in run.docs if n not in used]
    rng.shuffle(others)
    names = used + others[:max(0, max_tools - len(used))]
    names = [n for n in run.docs if n in names]  # the backend's own order
    tools = [tool_schema(run.docs[n]) for n in names]
    messages: list[dict] = []
    for user_turn, calls in zip(task.turns, task.calls):
        messages += [dict(m) for m in user_turn]
        if not calls:
            messages.append({"role": "assistant",
                             "content": "I cannot do that with the functions I have."})
            continue
        parsed = [run.arguments(c) for c in calls]
        messages.append({"role": "assistant", "content": "", "tool_calls": tool_calls(
            [{"name": n, "arguments": a} for n, a in parsed])})
        results = [run.execute(n, a) for n, a in parsed]
        messages += [{"role": "tool", "name": n, "content": r} for (n, _), r in zip(parsed, results)]
        messages.append({"role": "assistant", "content": summary(parsed, results)})
    return conversation(task.id, task.category, messages, tools)


def multi_turn_conversations(bfcl: Bfcl, max_tools: int, seed: int):
    for category in MULTI_TURN:
        for task in multi_turn(bfcl, category):
            rng = random.Random(f"{seed}:{task.id}")
            yield f"multi_turn_{task.number}", multi_turn_conversation(bfcl, task, max_tools, rng)


def stdlib_functions(max_lines: int) -> Iterator[tuple[str, str, str, str]]:
    """(qualified name, signature, docstring, source) of documented stdlib functions."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if SKIP_DIRS & set(path.relative_to(root).parts):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError):
            continue
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            body = ast.get_source_segment(source, node)
            if not doc or not body or node.name.startswith("_") or len(doc) < 20:
                continue
            if not 3 <= body.count("\n") + 1 <= max_lines:
                continue
            signature = f"{node.name}({ast.unparse(node.args)})"
            yield f"{module}.{node.name}", signature, inspect.cleandoc(doc), textwrap.dedent(body)


def stdlib_conversations(max_lines: int) -> Iterator[tuple[str, dict]]:
    seen = set()
    for name, signature, doc, body in stdlib_functions(max_lines):
        if name in seen:
            continue
        seen.add(name)
        first = doc.split("\n\n")[0].replace("\n", " ")
        code = [{"role": "user", "content": f"Write a Python function `{signature}`. {first}"},
                {"role": "assistant", "content": f"```python\n{body}\n```"}]
        prose = [{"role": "user", "content": f"What does `{name}` do?"},
                 {"role": "assistant", "content": doc[:1500]}]
        yield name, conversation(f"code:{name}", "stdlib_code", [{"role": "system",
                                 "content": SYSTEM}] + code)
        yield name, conversation(f"doc:{name}", "stdlib_doc", [{"role": "system",
                                 "content": SYSTEM}] + prose)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--bfcl", required=True, help="bfcl-eval wheel or unpacked wheel directory")
    p.add_argument("--out", required=True)
    p.add_argument("--max-tools", type=int, default=8, help="tools per multi-turn task at most")
    p.add_argument("--max-lines", type=int, default=40, help="longest stdlib function, in lines")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    bfcl = Bfcl(args.bfcl)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = {s: (out / f"{s}.jsonl").open("w") for s in SPLITS}
    counts: dict[str, dict[str, int]] = {}
    sources = [single_turn_conversations(bfcl), multi_turn_conversations(bfcl, args.max_tools,
               args.seed), stdlib_conversations(args.max_lines)]
    for source in sources:
        for key, conv in source:
            split = split_of(key)
            files[split].write(json.dumps(conv, ensure_ascii=False) + "\n")
            by_split = counts.setdefault(conv["source"], dict.fromkeys(SPLITS, 0))
            by_split[split] += 1
    for f in files.values():
        f.close()
    (out / "stats.json").write_text(json.dumps(counts, indent=1) + "\n")
    for source, by_split in counts.items():
        print(f"{source:26s} " + "  ".join(f"{s} {n:5d}" for s, n in by_split.items()))


if __name__ == "__main__":
    main()
