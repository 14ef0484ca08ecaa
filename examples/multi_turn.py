"""A multi-turn tool-using session on the embedded model: turn N prefills only its new tokens.

Each turn appends a user message or tool results in the model's chat template; the model replies
(greedy, DFlash speculative decoding with the embedded drafter) and its reply stays in the
conversation. The conversation's KV stays pinned in the paged pool between turns, so a turn
computes only the tokens added since the last one. The session then runs twice more for
comparison: re-prefilling the whole conversation every turn, and without speculation. Tool
results are scripted here; the agent SDK runs real tools.

    python examples/multi_turn.py [--model DIR] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import time

import torch

from agentflash.embedded import model_drafter_dir, resolve_model
from agentflash.engine.config import CacheConfig, SpecConfig
from agentflash.engine.engine import Engine
from agentflash.engine.models.dflash import load_drafter
from agentflash.engine.models.loader import load_model
from agentflash.engine.sampler import SamplingParams
from agentflash.tokenizer import load_tokenizer


def tool(name: str, description: str, **params: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": description,
            "parameters": {"type": "object", "required": list(params), "properties": {
                k: {"type": "string", "description": v} for k, v in params.items()}}}}


TOOLS = [
    tool("ls", "List the contents of the current directory."),
    tool("cd", "Change the current working directory to the specified folder.",
         folder="The folder to change to."),
    tool("cat", "Display the contents of a file.", file_name="The file to display."),
    tool("grep", "Search a file for lines containing a pattern.",
         file_name="The file to search.", pattern="The pattern to search for."),
]
SESSION = [  # (role, content): user turns and the tool results that follow the model's calls
    ("user", "List the files in the current directory, please."),
    ("tool", '{"current_directory_content": ["notes.txt", "report.txt", "data"]}'),
    ("user", "Show me what is in report.txt."),
    ("tool", '{"file_content": "Q3 revenue grew 12%. Budget analysis: costs flat."}'),
    ("user", "Find the lines mentioning 'budget' in report.txt."),
    ("tool", '{"matching_lines": ["Budget analysis: costs flat."]}'),
]


def run_session(new_engine, tokenizer, reuse: bool, max_tokens: int) -> list[dict]:
    """One session; without reuse every turn gets a fresh engine (an empty KV cache)."""
    engine = new_engine()
    messages: list[dict] = []
    params = SamplingParams(max_new_tokens=max_tokens)
    pin, rows = None, []
    for role, content in SESSION:
        messages.append({"role": role, "content": content, **({"name": "tool"} if role == "tool"
                                                              else {})})
        text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                             add_generation_prompt=True)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not reuse:
            engine = new_engine()
        t0 = time.perf_counter()
        seq = engine.submit(prompt, params, pin=reuse)
        ttft, finished = None, False
        while not finished:
            for u in engine.step():
                if u.seq_id == seq and u.new_token_ids and ttft is None:
                    ttft = time.perf_counter() - t0
                finished |= u.seq_id == seq and u.finished
        total = time.perf_counter() - t0
        done = engine.result(seq)
        if pin is not None:
            engine.unpin(pin)  # the new turn's pin covers the whole conversation now
        pin = done.pin
        reply = tokenizer.decode(done.output_ids, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
        c = done.counters
        rows.append(dict(prompt=len(prompt), cached=c.cached_tokens, computed=c.prefill_tokens,
                         reply=len(done.output_ids), ttft=ttft, total=total, text=reply,
                         tau=sum(c.acceptance_lengths) / max(1, len(c.acceptance_lengths))))
    if pin is not None:
        engine.unpin(pin)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory (default: the embedded model)")
    ap.add_argument("--max-tokens", type=int, default=96, help="reply length limit per turn")
    args = ap.parse_args()
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir)
    drafter_dir = model_drafter_dir(model_dir)
    drafter = load_drafter(drafter_dir, model) if drafter_dir is not None else None
    cache = CacheConfig(page_size=16, num_pages=1024)
    with torch.inference_mode():
        def spec() -> Engine:
            return Engine(model, cache, drafter=drafter, spec=SpecConfig())

        def plain() -> Engine:
            return Engine(model, cache)

        for engine in (spec(), plain()):  # warm-up
            engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))
        runs = {"reuse+spec": run_session(spec, tokenizer, True, args.max_tokens),
                "no reuse": run_session(spec, tokenizer, False, args.max_tokens),
                "no spec": run_session(plain, tokenizer, True, args.max_tokens)}
    main_run = runs["reuse+spec"]
    for i, r in enumerate(main_run, 1):
        print(f"--- turn {i}: {SESSION[i - 1][0]} -> assistant\n{r['text']}")
    print(f"\n{'turn':>4} {'prompt':>6} {'cached':>6} {'computed':>8} {'reply':>5} {'tau':>5} "
          f"{'TTFT ms':>8} {'total ms':>9} | {'no-reuse TTFT':>13} {'no-spec total':>13}")
    for i, r in enumerate(main_run):
        f, p = runs["no reuse"][i], runs["no spec"][i]
        print(f"{i + 1:>4} {r['prompt']:>6} {r['cached']:>6} {r['computed']:>8} {r['reply']:>5} "
              f"{r['tau']:>5.2f} {r['ttft'] * 1e3:>8.1f} {r['total'] * 1e3:>9.1f} | "
              f"{f['ttft'] * 1e3:>13.1f} {p['total'] * 1e3:>13.1f}")
    totals = {k: sum(r["total"] for r in rows) for k, rows in runs.items()}
    print(f"session: {totals['reuse+spec']:.2f} s with KV reuse and DFlash; "
          f"{totals['no reuse']:.2f} s re-prefilling every turn; "
          f"{totals['no spec']:.2f} s without speculation")


if __name__ == "__main__":
    main()
