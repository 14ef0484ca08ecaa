"""Throughput of many agents on one runtime: N agents run a two-turn tool task concurrently
(batched by the engine) vs the same N runs one after another, in one process, side by side.

    python tools/bench_agents.py [--agents 32] [--max-tokens 40] [--model DIR] [--no-draft]
"""

from __future__ import annotations

import argparse
import time

import anyio

from agentflash import Agent, Runtime, tool


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def session(rt: Runtime, i: int, max_tokens: int) -> int:
    """Two user turns with a tool; returns the tokens generated."""
    async with Agent(rt, "You are a helpful assistant.", tools=[add],
                     max_tokens=max_tokens) as agent:
        first = await agent.step(f"Add {i} and {i + 1} with the add tool.")
        second = await agent.step(f"Now add {2 * i} and 3.")
    return first.usage.completion_tokens + second.usage.completion_tokens


async def concurrent(rt: Runtime, n: int, max_tokens: int) -> int:
    tokens = [0] * n

    async def one(i: int) -> None:
        tokens[i] = await session(rt, i, max_tokens)

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)
    return sum(tokens)


async def sequential(rt: Runtime, n: int, max_tokens: int) -> int:
    return sum([await session(rt, i, max_tokens) for i in range(n)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--model", default=None)
    ap.add_argument("--no-draft", action="store_true")
    args = ap.parse_args()
    rt = Runtime.load(args.model, draft=False if args.no_draft else None)
    results = {}
    for name, fn in (("one by one", sequential), ("concurrent", concurrent)):
        rt.clear_cache()
        t0 = time.perf_counter()
        tokens = anyio.run(fn, rt, args.agents, args.max_tokens)
        results[name] = (tokens, time.perf_counter() - t0)
    rt.close()
    for name, (tokens, wall) in results.items():
        print(f"{name:<11} {args.agents} agents x 2 turns: {wall:6.1f} s, {tokens} tokens, "
              f"{tokens / wall:6.1f} tok/s")
    ratio = results["one by one"][1] / results["concurrent"][1]
    print(f"concurrent / one by one throughput: {ratio:.2f}x (drafter: "
          f"{'off' if args.no_draft else 'on'})")


if __name__ == "__main__":
    main()
