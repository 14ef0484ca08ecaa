"""Engine benchmark, side by side in one run on the same weights (CPU by default).

1. Decode tokens/s, greedy: agentflash Engine vs transformers `generate`, batch 1 and batch 8.
2. Time to first token of turn N with prefix reuse (turn N-1 pinned in the radix cache) vs
   re-prefilling the whole history, at several history lengths.

    python tools/bench_engine.py                       # random-weight ~30M Qwen3, float32
    python tools/bench_engine.py --model DIR --dtype bfloat16

Prints a table and, with --json PATH, writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from agentflash.engine.config import CacheConfig, SchedulerConfig
from agentflash.engine.device import resolve_dtype
from agentflash.engine.engine import Engine
from agentflash.engine.models.loader import load_model
from agentflash.engine.sampler import SamplingParams
from make_random_model import make_random_checkpoint

def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_decode(engine: Engine, hf, batch: int, prompt_len: int, new: int, repeats: int):
    g = torch.Generator().manual_seed(batch)
    vocab = engine.config.vocab_size
    prompts = torch.randint(0, vocab, (batch, prompt_len), generator=g)
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)

    def ours_full():
        engine.generate(prompts.tolist(), params)

    def ours_prefill():
        engine.generate(prompts.tolist(), SamplingParams(max_new_tokens=1, ignore_eos=True))

    def hf_run(n):
        return lambda: hf.generate(prompts, attention_mask=torch.ones_like(prompts),
                                   max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                   pad_token_id=0)

    with torch.inference_mode():
        # decode time = full run - prefill-only run (both include one sampled token)
        ours = best_of(ours_full, repeats) - best_of(ours_prefill, repeats)
        theirs = best_of(hf_run(new), repeats) - best_of(hf_run(1), repeats)
    return batch * (new - 1) / ours, batch * (new - 1) / theirs


def bench_ttft(model, history: int, new: int, repeats: int, page_size: int):
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(history)
    turn1 = torch.randint(0, vocab, (history,), generator=g).tolist()
    extra = torch.randint(0, vocab, (new,), generator=g).tolist()
    pages = 2 * (history + new + 64) // page_size + 8
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)

    def reuse_time():
        engine = Engine(model, CacheConfig(page_size, pages),
                        SchedulerConfig(max_batch_tokens=2048))
        (c1,) = engine.generate([turn1], one, pin=True)
        turn2 = turn1 + c1.output_ids + extra
        t0 = time.perf_counter()
        (c2,) = engine.generate([turn2], one)
        dt = time.perf_counter() - t0
        assert c2.counters.cached_tokens == history
        return dt

    def fresh_time():
        engine = Engine(model, CacheConfig(page_size, pages),
                        SchedulerConfig(max_batch_tokens=2048))
        turn2 = turn1 + [0] + extra
        t0 = time.perf_counter()
        engine.generate([turn2], one)
        return time.perf_counter() - t0

    with torch.inference_mode():
        reuse = statistics.median(reuse_time() for _ in range(repeats))
        fresh = statistics.median(fresh_time() for _ in range(repeats))
    return reuse, fresh


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="HF model directory (default: a random ~30M Qwen3)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--histories", default="512,2048,8192")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or make_random_checkpoint(tmp)
        dtype = resolve_dtype(args.dtype, torch.device("cpu"))
        model = load_model(path, dtype=dtype)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.1f}M params, {dtype}, torch threads {torch.get_num_threads()}")
    results: dict = {"params": params, "dtype": str(dtype), "decode": {}, "ttft": {}}
    for batch in (1, 8):
        pages = batch * (args.prompt_len + args.new_tokens) // 16 + 2 * batch + 8
        engine = Engine(model, CacheConfig(16, pages), SchedulerConfig(max_batch_tokens=4096))
        ours, theirs = bench_decode(engine, hf, batch, args.prompt_len, args.new_tokens,
                                    args.repeats)
        results["decode"][batch] = {"agentflash_tok_s": ours, "transformers_tok_s": theirs}
        print(f"decode batch {batch}: agentflash {ours:8.1f} tok/s | transformers {theirs:8.1f} "
              f"tok/s | ratio {ours / theirs:.2f}x")
    for history in map(int, args.histories.split(",")):
        reuse, fresh = bench_ttft(model, history, 16, args.repeats, 16)
        results["ttft"][history] = {"reuse_s": reuse, "reprefill_s": fresh}
        print(f"turn-N TTFT, {history:5d} history: reuse {reuse * 1e3:8.1f} ms | re-prefill "
              f"{fresh * 1e3:8.1f} ms | {fresh / reuse:.1f}x faster")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
