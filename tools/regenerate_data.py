"""Replace the replies of drafter training examples by the target's own (greedy or sampled) ones.

    python tools/regenerate_data.py --target DIR --data prompts.jsonl --response-len 128 \
        --out train.jsonl
    python tools/regenerate_data.py ... --temperature 0.8 --seed 1 --out sampled.jsonl

Each line of --data is an `Example` (tools/drafter_data.py); its prompt (the tokens before the
first loss_mask 1) is kept and its reply replaced by the target's greedy continuation of at
most --response-len tokens (or one sampled at --temperature, example i seeded by --seed + i),
generated batched by the engine (`agentflash.training.regenerate`). The spec
trains drafters on these. `tools/train_drafter.py --regenerate` does the same before training;
this tool makes a data set once, to train on it several times or to add to an earlier one.
"""

from __future__ import annotations

import argparse
import time

from agentflash.engine.device import resolve_device, training_dtype
from agentflash.engine.models.loader import load_model
from agentflash.training.data import read_jsonl, write_jsonl
from agentflash.training.regenerate import prompts_of, regenerate


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", required=True, help="target checkpoint directory (Qwen3/Llama)")
    p.add_argument("--data", required=True, help="JSONL examples (their prompts are kept)")
    p.add_argument("--out", required=True)
    p.add_argument("--response-len", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy replies")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of the first example")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    p.add_argument("--dtype", help="target dtype (default: float32 on CPU, bfloat16 on CUDA)")
    args = p.parse_args(argv)
    device = resolve_device(args.device)
    dtype = training_dtype(args.dtype, device)
    target = load_model(args.target, dtype=dtype, device=device)
    t0 = time.perf_counter()
    examples = regenerate(target, prompts_of(read_jsonl(args.data)), args.response_len,
                          temperature=args.temperature, seed=args.seed)
    write_jsonl(args.out, examples)
    print(f"{len(examples)} examples, {sum(sum(e.loss_mask) for e in examples)} response tokens "
          f"({time.perf_counter() - t0:.0f}s)")


if __name__ == "__main__":
    main()
