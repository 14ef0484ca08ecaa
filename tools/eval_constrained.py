"""Constrained tool calls over every BFCL non-live function schema, with and without speculation.

For each function of each single-turn task (and each multi-turn backend function), an agent on
the model is offered the task's tools with `tool_choice=<that function>` and asked the task's
question (multi-turn backends: a short instruction naming the function). Checks: the reply
parses as tool calls, every call validates against its tool's JSON schema (jsonschema), and the
greedy output is identical with and without DFlash speculation. Agents run concurrently on one
runtime (batched by the engine).

    python tools/eval_constrained.py --bfcl /work/data/bfcl_eval-2026.3.23-py3-none-any.whl \
        [--limit N] [--concurrency 32] [--max-tokens 256] [--out results.jsonl]
    python tools/eval_constrained.py ... --sample 12 --write-sample tests/data/bfcl_sample.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import IO

import anyio
import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bfcl import BACKENDS, MULTI_TURN, SINGLE_TURN, Bfcl, single_turn, tool_schema  # noqa: E402

from agentflash import Agent, Runtime  # noqa: E402


def cases(bfcl: Bfcl) -> list[dict]:
    """One case per (task, function): {"id", "question", "tools", "function"}; schemas seen
    before (identical JSON) are skipped so each distinct schema is checked once."""
    seen: set[str] = set()
    out: list[dict] = []

    def add(case_id: str, question: str, tools: list[dict], name: str) -> None:
        fn = next(t for t in tools if t["function"]["name"] == name)
        key = json.dumps(fn, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append({"id": case_id, "question": question, "tools": tools, "function": name})

    for category in SINGLE_TURN:
        for task in single_turn(bfcl, category):
            question = next((m["content"] for m in task.question if m["role"] == "user"), "")
            for tool in task.tools:
                add(f"{task.id}:{tool['function']['name']}", question, task.tools,
                    tool["function"]["name"])
    assert MULTI_TURN  # the multi-turn categories draw their functions from these backends
    for class_name in BACKENDS:
        tools = [tool_schema(doc) for doc in bfcl.backend_docs(class_name)]
        for tool in tools:
            name = tool["function"]["name"]
            add(f"{class_name}:{name}", f"Use {name} for me, please.", tools, name)
    return out


async def run_case(rt: Runtime, case: dict, speculative: bool, max_tokens: int) -> dict:
    async with Agent(rt, tools=case["tools"], tool_choice=case["function"],
                     max_tokens=max_tokens, speculative=speculative) as agent:
        step = await agent.step(case["question"])
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in case["tools"]}
    errors = [f"malformed: {m.reason}" for m in step.malformed_calls]
    for call in step.tool_calls:
        try:
            jsonschema.validate(call.arguments, schemas[call.name])
        except jsonschema.ValidationError as e:
            errors.append(f"{call.name}: {e.message}")
    if not step.tool_calls:
        errors.append("no call")
    return {"calls": [[c.name, c.arguments] for c in step.tool_calls],
            "finish_reason": step.finish_reason, "errors": errors,
            "tau": step.usage.speculative.mean_acceptance_length,
            "tokens": step.usage.completion_tokens}


async def evaluate(rt: Runtime, todo: list[dict], concurrency: int, max_tokens: int,
                   progress: IO[str] | None = None) -> list[dict]:
    results: list[dict] = [{} for _ in todo]
    limiter = anyio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with limiter:
            spec = await run_case(rt, todo[i], True, max_tokens)
            plain = await run_case(rt, todo[i], False, max_tokens)
            results[i] = {"id": todo[i]["id"], "spec": spec, "plain": plain,
                          "equal": spec["calls"] == plain["calls"]}
            if progress is not None:  # one line per case as it completes
                progress.write(json.dumps(results[i]) + "\n")
                progress.flush()

    async with anyio.create_task_group() as tg:
        for i in range(len(todo)):
            tg.start_soon(one, i)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bfcl", required=True, help="bfcl-eval wheel or unpacked directory")
    ap.add_argument("--model", default=None, help="model directory (default: embedded)")
    ap.add_argument("--limit", type=int, default=None, help="first N cases only")
    ap.add_argument("--sample", type=int, default=None, help="N random cases (seed 0)")
    ap.add_argument("--write-sample", type=Path, help="write the chosen cases as JSONL and exit")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", type=Path, help="write per-case results as JSONL, as they finish")
    args = ap.parse_args()
    todo = cases(Bfcl(args.bfcl))
    if args.sample:
        todo = random.Random(0).sample(todo, args.sample)
    todo = todo[: args.limit]
    if args.write_sample:
        args.write_sample.write_text("".join(json.dumps(c) + "\n" for c in todo))
        print(f"wrote {len(todo)} cases to {args.write_sample}")
        return
    rt = Runtime.load(args.model)
    t0 = time.perf_counter()
    with open(args.out or os.devnull, "w") as progress:
        results = anyio.run(evaluate, rt, todo, args.concurrency, args.max_tokens, progress)
    elapsed = time.perf_counter() - t0
    rt.close()
    n = len(results)
    valid = sum(not r["spec"]["errors"] and not r["plain"]["errors"] for r in results)
    length = sum(r["spec"]["finish_reason"] == "length" for r in results)
    equal = sum(r["equal"] for r in results)
    taus = [r["spec"]["tau"] for r in results if r["spec"]["tau"]]
    print(f"cases (distinct function schemas): {n}")
    print(f"calls parse and validate, spec and plain: {valid}/{n} ({100 * valid / n:.1f}%)")
    print(f"replies cut by max_tokens ({args.max_tokens}): {length}")
    print(f"constrained greedy output with speculation == without: {equal}/{n}")
    print(f"mean tau (constrained): {sum(taus) / max(1, len(taus)):.2f}")
    print(f"time: {elapsed:.0f} s ({2 * n / elapsed:.1f} steps/s at concurrency "
          f"{args.concurrency})")
    for r in results:
        if r["spec"]["errors"] or r["plain"]["errors"] or not r["equal"]:
            print("  ", r["id"], r["spec"]["errors"], r["plain"]["errors"],
                  "" if r["equal"] else "DIFFERENT")


if __name__ == "__main__":
    main()
