"""`agentflash demo`: a multi-turn agent task with real tools, timed three ways.

The agent (embedded model by default) works through `DEMO_TASK` in a temporary workspace with
real tools (files, a calculator, SQLite; agentflash/examples/demo_tools.py). The same task then
runs without speculation and without KV reuse (every step recomputes its whole prompt). Each
step's row comes from its `Usage`, counted by the engine: the same record the run log holds.
Costs use the runtime's `Pricing` (the CLI's default is an assumed $0.10 per device-hour).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .agent import Agent, MaxStepsError
from .examples.demo_tools import DEMO_TASK, Workspace
from .runtime import Runtime
from .step import Step
from .usage import Usage

INSTRUCTIONS = "You are a helpful assistant. Use the tools to answer."
MAIN, NO_SPECULATION, NO_REUSE = "kv reuse + DFlash", "kv reuse, no speculation", \
    "no kv reuse, DFlash"
MODES = {MAIN: (True, True), NO_SPECULATION: (False, True), NO_REUSE: (True, False)}
"""name -> (speculative, reuse_kv); the first is the main run"""


@dataclass
class Row:
    turn: int
    step: Step


async def run_task(rt: Runtime, name: str, speculative: bool, reuse_kv: bool, max_tokens: int,
                   max_steps: int) -> tuple[list[Row], float]:
    """Run DEMO_TASK once in a fresh workspace; returns every step and the wall time."""
    rows: list[Row] = []
    t0 = time.perf_counter()
    with Workspace() as ws:
        async with Agent(rt, INSTRUCTIONS, tools=ws.tools(), max_tokens=max_tokens,
                         speculative=speculative and rt.speculative, reuse_kv=reuse_kv,
                         name=name) as agent:
            for turn, message in enumerate(DEMO_TASK, 1):
                try:
                    result = await agent.run(message, max_steps=max_steps)
                    steps = result.steps
                except MaxStepsError as e:  # a tiny model may keep calling tools
                    steps = e.steps
                rows.extend(Row(turn, s) for s in steps)
    return rows, time.perf_counter() - t0


def table(rows: list[Row]) -> str:
    head = (f"{'turn':>4} {'tools called':<24} {'prompt':>6} {'cached':>6} {'new':>5} "
            f"{'out':>4} {'tau':>5} {'ttft ms':>8} {'tools ms':>8} {'step ms':>8} "
            f"{'cost u$':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        u = r.step.usage
        cached = u.prompt_tokens_details.cached_tokens
        calls = ",".join(c.name for c in r.step.tool_calls) or "(reply)"
        tau = u.speculative.mean_acceptance_length
        lines.append(
            f"{r.turn:>4} {calls[:24]:<24} {u.prompt_tokens:>6} {cached:>6} "
            f"{u.prompt_tokens - cached:>5} {u.completion_tokens:>4} "
            f"{(f'{tau:.2f}' if tau else '-'):>5} {1000 * u.timing.ttft_s:>8.0f} "
            f"{1000 * u.timing.tool_s:>8.0f} {1000 * u.timing.total_s:>8.0f} "
            f"{1e6 * u.cost.usd:>8.2f}")
    return "\n".join(lines)


def summary(name: str, rows: list[Row], wall_s: float) -> str:
    prompt = sum(r.step.usage.prompt_tokens for r in rows)
    cached = sum(r.step.usage.prompt_tokens_details.cached_tokens for r in rows)
    out = sum(r.step.usage.completion_tokens for r in rows)
    ttft = sum(r.step.usage.timing.ttft_s for r in rows) / max(1, len(rows))
    cost = sum(r.step.usage.cost.usd for r in rows)
    return (f"{name:<26} {wall_s:7.1f} s  {len(rows):3d} steps  prompt {prompt:6d} "
            f"(cached {cached:6d})  out {out:5d}  mean ttft {1000 * ttft:6.0f} ms  "
            f"cost {1e6 * cost:7.1f} u$")


async def demo(rt: Runtime, max_tokens: int, max_steps: int, compare: bool) -> str:
    report = []
    walls = {}
    for name, (speculative, reuse_kv) in MODES.items():
        if name != next(iter(MODES)) and not compare:
            break
        rt.clear_cache()  # each mode starts cold
        rows, wall = await run_task(rt, name.replace(" ", ""), speculative, reuse_kv, max_tokens,
                                    max_steps)
        walls[name] = (rows, wall)
        if not report:
            report += [f"model: {rt.model_name}  drafter: {rt.drafter_dir or 'none'}  "
                       f"device: {rt.engine.device}", "", table(rows), ""]
    report += [summary(name, rows, wall) for name, (rows, wall) in walls.items()]
    if rt.pricing is not None:
        costs = {name: Usage.sum([r.step.usage for r in rows]).cost
                 for name, (rows, _) in walls.items()}
        main = costs[MAIN]
        assert main is not None
        report.append("main run savings (counted counterfactuals): cache "
                      f"{_micro(main.saved_by_cache_usd)}, speculation "
                      f"{_micro(main.saved_by_speculation_usd)}"
                      + (" (negative: it cost more)"
                         if (main.saved_by_speculation_usd or 0) < 0 else ""))
        if compare:
            report.append(f"measured (cost of the run without it - the main run's): cache "
                          f"{_micro(costs[NO_REUSE].usd - main.usd)}, speculation "
                          f"{_micro(costs[NO_SPECULATION].usd - main.usd)}")
    return "\n".join(report)


def _micro(usd: float | None) -> str:
    return "not known" if usd is None else f"{1e6 * usd:.1f} u$"
