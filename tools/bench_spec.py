"""DFlash vs plain decoding, side by side in one run on the same weights (greedy, batch 1).

For each block size: decode tokens/s, mean acceptance length (tokens committed per verify
step) and the cost split of a step (drafter forward, target forward, the rest). The outputs
of every speculative run are checked to equal the plain run's, token for token.

    python tools/bench_spec.py --model DIR --draft DIR [--blocks 4,8,16] [--prompts 8]

Prompts are random token sequences from a seed the drafter was not trained on, or --prompts-file
(JSONL with "input_ids", and optionally "loss_mask" as written by tools/train_drafter.py, in which
case the prompt is the part before the first response token).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from agentflash.engine.config import CacheConfig, SchedulerConfig, SpecConfig
from agentflash.engine.device import resolve_dtype
from agentflash.engine.engine import Engine
from agentflash.engine.models.dflash import load_drafter
from agentflash.engine.models.loader import load_model
from agentflash.engine.sampler import SamplingParams


def run(engine: Engine, prompts: list[list[int]], new: int) -> dict:
    """Generate for each prompt alone (batch 1); decode time excludes the prompt's prefill."""
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    outputs, decode_s, tokens = [], 0.0, 0
    c0 = dict(engine.counters.__dict__)
    for prompt in prompts:
        seq = engine.submit(prompt, params)
        t_first = None
        while engine.has_work():
            for u in engine.step():
                if u.new_token_ids and t_first is None:
                    t_first = time.perf_counter()
        done = engine.result(seq)
        decode_s += time.perf_counter() - t_first
        tokens += len(done.output_ids) - 1
        outputs.append(done.output_ids)
        engine.kv.evict(engine.kv.stats()["pages_total"])  # no reuse between prompts
    c = {k: v - c0[k] for k, v in engine.counters.__dict__.items() if isinstance(v, (int, float))}
    verify_steps = max(1, c["draft_forwards"])
    return {
        "outputs": outputs,
        "tok_s": tokens / decode_s,
        "mean_acceptance_length": (c["accepted_tokens"] + verify_steps) / verify_steps
        if c["draft_forwards"] else 1.0,
        "draft_ms": 1e3 * c["draft_s"] / max(1, c["steps"]),
        "target_ms": 1e3 * c["target_s"] / max(1, c["steps"]),
        "other_ms": 1e3 * (c["step_s"] - c["draft_s"] - c["target_s"]) / max(1, c["steps"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--blocks", default="4,8,16")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompts-file")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=12345)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json")
    args = ap.parse_args()
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    model = load_model(args.model, dtype=dtype)
    drafter = load_drafter(args.draft, model)
    if args.prompts_file:
        with open(args.prompts_file) as f:
            rows = [json.loads(line) for line in f][: args.prompts]
        # training-format rows (input_ids + loss_mask): the prompt is the part before the response
        prompts = [r["input_ids"][: r.get("loss_mask", [0] * len(r["input_ids"])).index(1)]
                   if 1 in r.get("loss_mask", []) else r["input_ids"] for r in rows]
    else:
        g = torch.Generator().manual_seed(args.seed)
        prompts = torch.randint(0, model.config.vocab_size - 1,
                                (args.prompts, args.prompt_len), generator=g).tolist()
    longest = max(map(len, prompts))  # a prompts file's can be far longer than --prompt-len
    cache = CacheConfig(16, 4 * (longest + args.new_tokens) // 16 + 64)
    sched = SchedulerConfig(max_running=1)
    results = {}
    with torch.inference_mode():
        run(Engine(model, cache, sched), prompts[:1], 8)  # warm-up
        results["plain"] = run(Engine(model, cache, sched), prompts, args.new_tokens)
        for b in map(int, args.blocks.split(",")):
            engine = Engine(model, cache, sched, drafter=drafter, spec=SpecConfig(b),
                            speculation="always")
            results[f"B={b}"] = r = run(engine, prompts, args.new_tokens)
            assert r["outputs"] == results["plain"]["outputs"], f"B={b} output differs"
    base = results["plain"]["tok_s"]
    print(f"{len(prompts)} prompts x {args.new_tokens} new tokens, {dtype}, batch 1, greedy; "
          "outputs identical to plain decoding")
    print(f"{'':8s} {'tok/s':>8s} {'speedup':>8s} {'tau':>6s} {'draft ms':>9s} {'target ms':>10s}"
          f" {'other ms':>9s}")
    for name, r in results.items():
        print(f"{name:8s} {r['tok_s']:8.1f} {r['tok_s'] / base:7.2f}x "
              f"{r['mean_acceptance_length']:6.2f} {r['draft_ms']:9.2f} {r['target_ms']:10.2f} "
              f"{r['other_ms']:9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: {kk: vv for kk, vv in v.items() if kk != "outputs"}
                       for k, v in results.items()}, f, indent=2)


if __name__ == "__main__":
    main()
