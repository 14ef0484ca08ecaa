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

--drafter-extra PACKAGE... builds the drafter's extra corpus instead, prompts the target never
trained on (tools/make_embedded.sh, drafter stage 5): BFCL multi_turn_miss_param (the base tasks
with a turn that lacks a parameter; that turn is declined) and the documented functions of those
installed packages, as stdlib_code/stdlib_doc turns ("package_code", "package_doc"), less any whose
source or docstring is also in the standard library.

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

from bfcl import (MULTI_TURN, MULTI_TURN_EXTRA, SINGLE_TURN, Bfcl, MultiTurnRun, MultiTurnTask,
                  multi_turn, single_turn, tool_schema)

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


def multi_turn_conversations(bfcl: Bfcl, categories: tuple[str, ...], max_tools: int, seed: int):
    for category in categories:
        for task in multi_turn(bfcl, category):
            rng = random.Random(f"{seed}:{task.id}")
            yield f"multi_turn_{task.number}", multi_turn_conversation(bfcl, task, max_tools, rng)


def python_functions(root: Path, under: str, max_lines: int) -> Iterator[tuple[str, str, str, str]]:
    """(qualified name, signature, docstring, source) of the documented public functions of 3 to
    max_lines lines in the .py files under root/under (modules named from root)."""
    for path in sorted((root / under).rglob("*.py")):
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


def stdlib_functions(max_lines: int) -> Iterator[tuple[str, str, str, str]]:
    return python_functions(Path(sysconfig.get_paths()["stdlib"]), "", max_lines)


def package_functions(root: Path, packages: list[str], max_lines: int,
                      exclude: set[str]) -> Iterator[tuple[str, str, str, str]]:
    """The functions of the packages under root, less any whose source or docstring is in
    exclude (the standard library's: vendored copies must not bring a stdlib test function in)."""
    for package in packages:
        for function in python_functions(root, package, max_lines):
            if function[2] not in exclude and function[3] not in exclude:
                yield function


def code_conversations(functions: Iterator[tuple[str, str, str, str]],
                       origin: str) -> Iterator[tuple[str, dict]]:
    """A code-writing turn (the docstring's summary asks, the source answers) and an explanation
    turn (the name asks, the docstring answers) per function; sources {origin}_code/_doc."""
    seen = set()
    for name, signature, doc, body in functions:
        if name in seen:
            continue
        seen.add(name)
        first = doc.split("\n\n")[0].replace("\n", " ")
        code = [{"role": "user", "content": f"Write a Python function `{signature}`. {first}"},
                {"role": "assistant", "content": f"```python\n{body}\n```"}]
        prose = [{"role": "user", "content": f"What does `{name}` do?"},
                 {"role": "assistant", "content": doc[:1500]}]
        yield name, conversation(f"code:{name}", f"{origin}_code", [{"role": "system",
                                 "content": SYSTEM}] + code)
        yield name, conversation(f"doc:{name}", f"{origin}_doc", [{"role": "system",
                                 "content": SYSTEM}] + prose)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--bfcl", required=True, help="bfcl-eval wheel or unpacked wheel directory")
    p.add_argument("--out", required=True)
    p.add_argument("--max-tools", type=int, default=8, help="tools per multi-turn task at most")
    p.add_argument("--max-lines", type=int, default=40, help="longest function, in lines")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drafter-extra", nargs="+", metavar="PACKAGE",
                   help="build the drafter's extra corpus instead: BFCL multi_turn_miss_param "
                        "and these installed packages' functions")
    p.add_argument("--package-root", help="where --drafter-extra's packages are (default: this "
                   "interpreter's site-packages)")
    args = p.parse_args(argv)
    bfcl = Bfcl(args.bfcl)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = {s: (out / f"{s}.jsonl").open("w") for s in SPLITS}
    counts: dict[str, dict[str, int]] = {}
    if args.drafter_extra:
        stdlib = {text for f in stdlib_functions(args.max_lines) for text in f[2:]}
        root = Path(args.package_root or sysconfig.get_paths()["purelib"])
        packages = package_functions(root, args.drafter_extra, args.max_lines, stdlib)
        sources = [multi_turn_conversations(bfcl, MULTI_TURN_EXTRA, args.max_tools, args.seed),
                   code_conversations(packages, "package")]
    else:
        sources = [single_turn_conversations(bfcl),
                   multi_turn_conversations(bfcl, MULTI_TURN, args.max_tools, args.seed),
                   code_conversations(stdlib_functions(args.max_lines), "stdlib")]
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
