"""Evaluate a target and its DFlash drafter on held-out agent prompts, side by side on one machine.

    python tools/eval_drafter.py --corpus corpus/test.jsonl --out report.json
    python tools/eval_drafter.py --model DIR --draft DIR --corpus ... --per-bucket 24

Prompts are the test split's assistant turns (tools/drafter_data.py's prompts), sampled with the
seed up to --per-bucket per prompt-length bucket (0-512, 512-1024, 1024-2048, 2048+ tokens).
Each prompt runs greedy at batch 1 on three engines over the same weights, in rotating order:
"spec" verifies every full block (its acceptance is the drafter's), "auto" is what
`Runtime.load()` serves (step costs measured here at start; each request verifies the number of
drafts that pays best, or none), "plain" decodes token by token. The script reports:
- acceptance: mean tau (tokens committed per verify), accepted share per block position, tau per
  context-length bucket, and the same for a freshly initialised drafter (--random-baseline);
- speed: decode tokens/s of each (time after the first token, so prefill is not counted) and
  the ratios to plain, summed over all prompts, per bucket and overall;
- equality: how many speculative outputs differ from plain ones (must be 0);
- tool calls: for turns whose reference reply calls a tool, the share of plain outputs whose
  `<tool_call>` blocks are well-formed JSON `{"name", "arguments"}`, name a tool of the prompt,
  and validate against that tool's JSON schema (no constrained decoding).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import time
from pathlib import Path

import jsonschema
import torch
from transformers import AutoTokenizer

from agentflash.embedded import model_drafter_dir, resolve_model
from agentflash.engine.config import CacheConfig, SpecConfig
from agentflash.engine.device import resolve_device, resolve_dtype
from agentflash.engine.engine import Engine
from agentflash.engine.models.dflash import load_drafter
from agentflash.engine.models.loader import load_model
from agentflash.engine.sampler import SamplingParams
from agentflash.training.drafter_checkpoint import init_drafter
from corpus import Prompt, Tokenized, read_conversations

BUCKETS = ((0, 512), (512, 1024), (1024, 2048), (2048, 1 << 30))
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def bucket_name(n: int) -> str:
    for lo, hi in BUCKETS:
        if lo <= n < hi:
            return f"{lo}-{hi}" if hi < 1 << 30 else f"{lo}+"
    raise ValueError(n)


def sample_prompts(path: str, enc: Tokenized, per_bucket: int, max_prompt: int,
                   seed: int) -> list[Prompt]:
    by_bucket: dict[str, list[Prompt]] = {}
    for conv in read_conversations(path):
        for p in enc.prompts(conv):
            if len(p.ids) <= max_prompt:
                by_bucket.setdefault(bucket_name(len(p.ids)), []).append(p)
    rng = random.Random(seed)
    chosen = []
    for name in sorted(by_bucket, key=lambda b: int(b.split("-")[0].rstrip("+"))):
        items = by_bucket[name]
        chosen += rng.sample(items, min(per_bucket, len(items)))
    return chosen


def tool_call_check(text: str, tools: list[dict]) -> dict[str, bool]:
    """Whether a reply's tool calls are well-formed, name known tools and match their schemas."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    blocks = TOOL_CALL.findall(text)
    ok = {"has_call": bool(blocks), "well_formed": bool(blocks), "known_name": bool(blocks),
          "schema_valid": bool(blocks)}
    for block in blocks:
        try:
            call = json.loads(block)
            well = (isinstance(call, dict) and isinstance(call.get("name"), str)
                    and isinstance(call.get("arguments"), dict))
        except json.JSONDecodeError:
            well = False
        known = well and call["name"] in schemas
        valid = known
        if known:
            try:
                jsonschema.validate(call["arguments"], schemas[call["name"]])
            except jsonschema.ValidationError:
                valid = False
        ok["well_formed"] &= well
        ok["known_name"] &= known
        ok["schema_valid"] &= valid
    return ok


def run_one(engine: Engine, prompt: list[int], params: SamplingParams) -> dict:
    """One request alone: output, time to first token, decode time after it, counters."""
    t0 = time.perf_counter()
    seq_id = engine.submit(prompt, params)
    first = None
    while True:
        updates = {u.seq_id: u for u in engine.step()}
        u = updates.get(seq_id)
        if u is not None and u.new_token_ids and first is None:
            first = time.perf_counter()
        if u is not None and u.finished:
            break
    end = time.perf_counter()
    done = engine.result(seq_id)
    if done.error is not None:
        raise done.error
    return {"output": done.output_ids, "ttft": first - t0, "decode_s": end - first,
            "counters": done.counters}


def summarize_acceptance(runs: list[dict], block_size: int) -> dict:
    taus = [t for r in runs for t in r["counters"].acceptance_lengths]
    per_pos = [0] * (block_size - 1)
    for r in runs:
        for k, n in enumerate(r["counters"].accepted_per_position[: block_size - 1]):
            per_pos[k] += n
    verifies = max(1, len(taus))
    return {"verifies": len(taus), "mean_tau": sum(taus) / verifies,
            "accepted_per_position": [round(n / verifies, 4) for n in per_pos]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="target directory (default: the embedded model)")
    p.add_argument("--draft", help="drafter directory (default: the model's drafter/)")
    p.add_argument("--corpus", required=True, help="held-out split (tools/build_corpus.py)")
    p.add_argument("--per-bucket", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--random-baseline", type=int, default=8, metavar="N",
                   help="prompts to score a freshly initialised drafter on (0: skip)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the report as JSON")
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)

    model_dir = resolve_model(args.model)
    draft_dir = Path(args.draft) if args.draft else model_drafter_dir(model_dir)
    if draft_dir is None:
        raise SystemExit(f"{model_dir} has no drafter/: pass --draft")
    device = resolve_device("cpu")
    dtype = resolve_dtype(args.dtype, device)
    target = load_model(model_dir, dtype=dtype, device=device)
    drafter = load_drafter(draft_dir, target)
    enc = Tokenized(AutoTokenizer.from_pretrained(str(model_dir)))
    max_len = target.config.max_position_embeddings
    prompts = sample_prompts(args.corpus, enc, args.per_bucket, max_len - args.max_new_tokens,
                             args.seed)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    pages = -(-max_len // 16) + 4
    spec = Engine(target, CacheConfig(16, pages), drafter=drafter, spec=SpecConfig(args.block_size),
                  speculation="always")
    # speculation="auto": step costs measured as Runtime.load measures them
    auto = Engine(target, CacheConfig(16, pages), drafter=drafter, spec=SpecConfig(args.block_size))
    plain = Engine(target, CacheConfig(16, pages))
    for engine in (spec, auto, plain):  # warm up
        run_one(engine, prompts[0].ids[-64:], SamplingParams(max_new_tokens=8))
    cost = auto.policy.spec.cost
    assert cost is not None
    print(f"{len(prompts)} prompts, {device} {dtype}, block size {args.block_size}; plain step "
          f"{1e3 * cost.plain_s:.1f} ms; verify + drafter of "
          + ", ".join(f"{k}: {cost.verify[k - 1]:.2f} + {cost.draft[k - 1]:.2f}"
                      for k in (2, 4, 8, 16) if k <= len(cost.verify))
          + " plain steps",
          flush=True)

    rows = []
    engines = [("spec", spec), ("auto", auto), ("plain", plain)]
    for i, prompt in enumerate(prompts):
        order = engines[i % 3:] + engines[: i % 3]
        res = {name: run_one(engine, prompt.ids, params) for name, engine in order}
        text = enc.tok.decode(res["plain"]["output"])
        reference = enc.tok.decode(prompt.reply)
        row = {"prompt_tokens": len(prompt.ids), "bucket": bucket_name(len(prompt.ids)), **res,
               "equal": res["spec"]["output"] == res["plain"]["output"]
               and res["auto"]["output"] == res["plain"]["output"]}
        if prompt.tools and "<tool_call>" in reference:
            row["tool_calls"] = tool_call_check(text, prompt.tools)
        rows.append(row)
        c = res["spec"]["counters"]
        tau = sum(c.acceptance_lengths) / max(1, len(c.acceptance_lengths))
        print(f"[{i + 1}/{len(prompts)}] {len(prompt.ids):5d} tokens  tau {tau:5.2f}  "
              f"spec {res['spec']['decode_s']:.2f}s auto {res['auto']['decode_s']:.2f}s "
              f"plain {res['plain']['decode_s']:.2f}s  equal {row['equal']}", flush=True)

    def speed(group: list[dict]) -> dict:
        out = {}
        for name in ("spec", "auto", "plain"):
            toks = sum(len(r[name]["output"]) - 1 for r in group)
            secs = sum(r[name]["decode_s"] for r in group)
            out[f"{name}_tokens_per_s"] = toks / secs
        out["speedup"] = out["spec_tokens_per_s"] / out["plain_tokens_per_s"]
        out["auto_speedup"] = out["auto_tokens_per_s"] / out["plain_tokens_per_s"]
        return out

    report: dict = {"model": str(model_dir), "drafter": str(draft_dir), "device": str(device),
                    "dtype": str(dtype), "prompts": len(rows), "block_size": args.block_size,
                    "plain_step_ms": 1e3 * cost.plain_s, "step_cost": dataclasses.asdict(cost),
                    "max_new_tokens": args.max_new_tokens,
                    "outputs_differing": sum(not r["equal"] for r in rows),
                    **summarize_acceptance([r["spec"] for r in rows], args.block_size),
                    **speed(rows), "buckets": {}}
    for name in dict.fromkeys(r["bucket"] for r in rows):
        group = [r for r in rows if r["bucket"] == name]
        acc = summarize_acceptance([r["spec"] for r in group], args.block_size)
        report["buckets"][name] = {"prompts": len(group), "mean_tau": acc["mean_tau"],
                                   **speed(group)}
    calls = [r["tool_calls"] for r in rows if "tool_calls" in r]
    report["tool_calls"] = {"replies": len(calls), **{
        k: sum(c[k] for c in calls) / max(1, len(calls))
        for k in ("has_call", "well_formed", "known_name", "schema_valid")}}
    if args.random_baseline:
        c = drafter.config
        fresh = init_drafter(target.config, args.block_size, c.num_hidden_layers,
                             list(c.target_layer_ids), c.mask_token_id, args.seed)
        fresh = fresh.to(dtype=dtype)
        rnd = Engine(target, CacheConfig(16, pages), drafter=fresh,
                     spec=SpecConfig(args.block_size), speculation="always")
        runs = [run_one(rnd, pr.ids, params) for pr in prompts[: args.random_baseline]]
        report["random_drafter"] = summarize_acceptance(runs, args.block_size)
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
