"""Which compute dtype is faster on this CPU? Engine decode and prefill, float32 vs bfloat16,
interleaved in one run on the same weights (medians of several repeats).

    python tools/bench_dtype.py [--model DIR]     # default: the random ~30M Qwen3 of bench_engine
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from agentflash.engine.config import CacheConfig, SchedulerConfig
from agentflash.engine.device import cpu_has_native_bf16
from agentflash.engine.engine import Engine
from agentflash.engine.models.loader import load_model
from agentflash.engine.sampler import SamplingParams


def timed(engine: Engine, prompt: list[int], new: int) -> float:
    t0 = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_new_tokens=new, ignore_eos=True))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            from make_random_model import make_random_checkpoint

            args.model = make_random_checkpoint(tmp)
        models = {dt: load_model(args.model, dtype=dt) for dt in (torch.float32, torch.bfloat16)}
    vocab = next(iter(models.values())).config.vocab_size
    g = torch.Generator().manual_seed(0)
    decode: dict = {dt: [] for dt in models}
    prefill: dict = {dt: [] for dt in models}
    with torch.inference_mode():
        for rep in range(args.repeats + 1):
            for dt, model in models.items():
                engine = Engine(model, CacheConfig(16, 256), SchedulerConfig(max_batch_tokens=4096))
                long = torch.randint(0, vocab, (args.prefill,), generator=g).tolist()
                short = torch.randint(0, vocab, (16,), generator=g).tolist()
                p = timed(engine, long, 1)
                d = (timed(engine, short, args.new_tokens + 1) - timed(engine, short[::-1], 1))
                if rep:  # the first round warms up
                    prefill[dt].append(args.prefill / p)
                    decode[dt].append(args.new_tokens / d)
    print(f"native bf16 instructions (AMX/AVX512-BF16): {cpu_has_native_bf16()}")
    for dt in models:
        print(f"{str(dt):15s} decode {statistics.median(decode[dt]):7.1f} tok/s   "
              f"prefill {statistics.median(prefill[dt]):8.1f} tok/s")
    f32, b16 = torch.float32, torch.bfloat16
    print(f"bf16/fp32: decode {statistics.median(decode[b16]) / statistics.median(decode[f32]):.2f}x"
          f", prefill {statistics.median(prefill[b16]) / statistics.median(prefill[f32]):.2f}x")


if __name__ == "__main__":
    main()
