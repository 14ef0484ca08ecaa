"""Two or more drafters for one target, side by side on held-out agent prompts, in one run.

    python tools/compare_drafters.py --corpus corpus/test.jsonl \\
        --draft agentflash/checkpoints/agentflash-11m/drafter DFLASH2_DIR --out report.json

Prompts are sampled as tools/eval_drafter.py samples them (the test split's assistant turns, up
to --per-bucket per prompt-length bucket). Each prompt runs greedy at batch 1 on a plain engine
and, for each drafter, one verifying every full block ("always": the drafter's own acceptance)
and one under speculation="auto" (what `Runtime.load()` serves), all in rotating order on the
same weights and dtype, so that the machine's noise falls on every column alike. Reported per
drafter: mean tau (tokens committed per full-block verify), accepted share per block position,
decode tokens/s of "always" and "auto" (time after the first token) and their ratio to plain,
and how many outputs differ from plain (must be 0).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoTokenizer

from agentflash.embedded import resolve_model
from agentflash.engine.config import CacheConfig, SpecConfig
from agentflash.engine.device import resolve_device, resolve_dtype
from agentflash.engine.engine import Engine
from agentflash.engine.models.dflash import load_drafter
from agentflash.engine.models.loader import load_model
from agentflash.engine.sampler import SamplingParams
from corpus import Tokenized
from eval_drafter import run_one, sample_prompts, summarize_acceptance


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="target directory (default: the embedded model)")
    p.add_argument("--draft", nargs="+", required=True, help="drafter directories")
    p.add_argument("--corpus", required=True, help="held-out split (tools/build_corpus.py)")
    p.add_argument("--per-bucket", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the report as JSON")
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    model_dir = resolve_model(args.model)
    device = resolve_device("cpu")
    dtype = resolve_dtype(args.dtype, device)
    target = load_model(model_dir, dtype=dtype, device=device)
    enc = Tokenized(AutoTokenizer.from_pretrained(str(model_dir)))
    max_len = target.config.max_position_embeddings
    prompts = sample_prompts(args.corpus, enc, args.per_bucket, max_len - args.max_new_tokens,
                             args.seed)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    cache = CacheConfig(16, -(-max_len // 16) + 4)
    engines: list[tuple[str, Engine]] = [("plain", Engine(target, cache))]
    for i, path in enumerate(args.draft):
        drafter = load_drafter(path, target)
        block = SpecConfig(drafter.config.block_size)
        engines += [(f"{i}:always", Engine(target, cache, drafter=drafter, spec=block,
                                           speculation="always")),
                    (f"{i}:auto", Engine(target, cache, drafter=drafter, spec=block))]
    for _, engine in engines:  # warm up
        run_one(engine, prompts[0].ids[-64:], SamplingParams(max_new_tokens=8))
    print(f"{len(prompts)} prompts, {device} {dtype}; fast paths: "
          f"{engines[-1][1].fast_paths}", flush=True)
    runs: dict[str, list[dict]] = {name: [] for name, _ in engines}
    for n, prompt in enumerate(prompts):
        k = n % len(engines)
        for name, engine in engines[k:] + engines[:k]:
            runs[name].append(run_one(engine, prompt.ids, params))
        print(f"[{n + 1}/{len(prompts)}] {len(prompt.ids):5d} tokens  " + "  ".join(
            f"{name} {runs[name][-1]['decode_s']:.2f}s" for name, _ in engines), flush=True)

    def tokens_per_s(name: str) -> float:
        return (sum(len(r["output"]) - 1 for r in runs[name])
                / sum(r["decode_s"] for r in runs[name]))

    plain = tokens_per_s("plain")
    report: dict = {"model": str(model_dir), "dtype": str(dtype), "prompts": len(prompts),
                    "max_new_tokens": args.max_new_tokens, "plain_tokens_per_s": plain,
                    "drafters": []}
    for i, path in enumerate(args.draft):
        block = load_drafter(path, target).config
        entry = {"drafter": str(path), "architecture": "DFlash2" if block.v2 else "DFlash",
                 "block_size": block.block_size,
                 **summarize_acceptance(runs[f"{i}:always"], block.block_size)}
        for mode in ("always", "auto"):
            rate = tokens_per_s(f"{i}:{mode}")
            entry[f"{mode}_tokens_per_s"] = rate
            entry[f"{mode}_speedup"] = rate / plain
            entry[f"{mode}_outputs_differing"] = sum(
                a["output"] != b["output"] for a, b in zip(runs[f"{i}:{mode}"], runs["plain"]))
        report["drafters"].append(entry)
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
