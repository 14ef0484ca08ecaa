"""Counted savings against a measured A/B: `agentflash demo`'s task, run three ways (main,
without speculation, without KV reuse), several rounds on a quiet machine and then with a
CPU-bound process beside it, on one runtime whose step costs were measured at load while the
machine was quiet. Prints, per round and as medians, the savings the main run's Usage counted
(cost.saved_by_cache_usd, cost.saved_by_speculation_usd) next to the measured differences in
cost (the median cost of the runs without reuse or without speculation, minus the main runs').

    python tools/bench_savings.py                 # 3 rounds quiet, 3 with a busy neighbour
    python tools/bench_savings.py --out savings.json
    python tools/bench_savings.py --rounds 5 --neighbours 2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import statistics
from typing import Any

import anyio

from agentflash import Runtime
from agentflash.demo import MAIN, MODES, NO_REUSE, NO_SPECULATION, run_task
from agentflash.usage import Pricing, Usage


def _spin() -> None:
    while True:
        pass


async def one_round(rt: Runtime, index: int, max_tokens: int,
                    max_steps: int) -> dict[str, float]:
    """The demo's three runs (their order rotated by round, so that a load that drifts falls
    on each alike): each one's cost and the main run's counted savings, in micro-dollars."""
    names = list(MODES)
    names = names[index % 3:] + names[:index % 3]
    costs = {}
    for name in names:
        speculative, reuse = MODES[name]
        rt.clear_cache()
        rows, _ = await run_task(rt, name.replace(" ", ""), speculative, reuse, max_tokens,
                                 max_steps)
        costs[name] = Usage.sum([r.step.usage for r in rows]).cost
    main = costs[MAIN]
    return {"main": 1e6 * main.usd, "no_speculation": 1e6 * costs[NO_SPECULATION].usd,
            "no_reuse": 1e6 * costs[NO_REUSE].usd,
            "cache_counted": 1e6 * main.saved_by_cache_usd,
            "spec_counted": 1e6 * main.saved_by_speculation_usd}


def summary(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Medians over the rounds: each run's cost, and the counted savings; measured: the
    difference of the median costs."""
    m = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    m["cache_measured"] = m["no_reuse"] - m["main"]
    m["spec_measured"] = m["no_speculation"] - m["main"]
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--neighbours", type=int, default=1, help="CPU-bound processes beside it")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--max-steps", type=int, default=3)
    ap.add_argument("--out", help="write every round's numbers here (JSON)")
    args = ap.parse_args()
    rt = Runtime.load(pricing=Pricing(usd_per_hour=0.10))
    results: dict[str, Any] = {"machine": platform.processor() or platform.machine()}
    try:
        for load in ("quiet", "busy"):
            spinners = []
            if load == "busy":
                spinners = [multiprocessing.Process(target=_spin, daemon=True)
                            for _ in range(args.neighbours)]
                for p in spinners:
                    p.start()
            try:
                rounds = []
                for i in range(args.rounds):
                    rounds.append(anyio.run(one_round, rt, i, args.max_tokens, args.max_steps))
                    print(load, i, json.dumps({k: round(v, 1) for k, v in rounds[-1].items()}),
                          flush=True)
            finally:
                for p in spinners:
                    p.kill()
            results[load] = {"rounds": rounds, "median": summary(rounds)}
    finally:
        rt.close()
    print("\n| machine | saving | counted u$ (median) | measured u$ (median) | counted/measured |")
    print("|---|---|---|---|---|")
    for load in ("quiet", "busy"):
        m = results[load]["median"]
        for what in ("cache", "spec"):
            counted, measured = m[f"{what}_counted"], m[f"{what}_measured"]
            ratio = counted / measured if measured else float("nan")
            print(f"| {load} | {what} | {counted:.1f} | {measured:.1f} | {ratio:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
