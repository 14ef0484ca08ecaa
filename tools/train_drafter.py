"""Train a DFlash drafter for a target checkpoint (recipe: shared/specs/dflash.md, "Training").

    python tools/train_drafter.py --target DIR --data train.jsonl --out DIR
    python tools/train_drafter.py --target DIR --random-prompts 256 --prompt-len 32 \\
        --response-len 64 --out DIR     # no dataset: random prompts, target-regenerated responses

--data is JSONL, one object per line: {"input_ids": [int, ...], "loss_mask": [0|1, ...]}, both
lists of the same length; loss_mask is 1 on response tokens (the drafter learns to predict them;
the rest is context only). With --regenerate, each line's prompt (its tokens before the first
loss_mask 1) is kept and its response replaced by the target's greedy continuation of
--response-len tokens: the spec trains on target-regenerated responses. --save-data writes the
examples used (after regeneration) in the same format.

--out receives a drafter checkpoint in the published format (config.json + model.safetensors,
loadable by `load_drafter` and `agentflash --draft`) and training.json (arguments, last log,
held-out scores with --holdout). The log prints the loss, tau (1 + the leading hits of a block,
averaged over anchors) and the accuracy at each block position. The held-out score adds the
decode tau: greedy speculative decoding replayed over the held-out responses, the acceptance
length the engine will see. It is the lower one (a decode spends most of its steps where the
drafter is wrong), and it is the number to compare with `tools/eval_drafter.py`. --init
continues an earlier drafter, for example on more data. --dflash2 trains a DFlash2 drafter
(convolutions and a candidate selector, shared/specs/dflash.md); with --init of a DFlash
drafter it starts from that drafter's weights, drafting what it drafts (`grow_to_v2`). Runs are seeded: the same arguments
give the same drafter on the same machine (unless --max-minutes cuts the run short).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from agentflash.engine.device import resolve_device, resolve_dtype, training_dtype
from agentflash.engine.models.dflash import load_drafter
from agentflash.engine.models.loader import load_model
from agentflash.engine.models.qwen3 import CausalLM
from agentflash.training.data import Example, read_jsonl, write_jsonl
from agentflash.training.dflash import Scores, TrainConfig, TrainLog, evaluate, train
from agentflash.engine.models.dflash_config import DFlash2Extras
from agentflash.training.drafter_checkpoint import grow_to_v2, init_drafter, save_drafter
from agentflash.training.regenerate import prompts_of, regenerate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", required=True, help="target checkpoint directory (Qwen3/Llama)")
    p.add_argument("--out", required=True, help="output drafter directory")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", nargs="+", help="JSONL training data (see above), one or more "
                        "files read in order")
    source.add_argument("--random-prompts", type=int, metavar="N",
                        help="N random-token prompts with target-regenerated responses")
    p.add_argument("--regenerate", action="store_true",
                   help="replace --data responses by the target's greedy ones")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--response-len", type=int, default=64)
    p.add_argument("--save-data", help="write the training examples to this JSONL file")
    p.add_argument("--holdout", type=int, default=0,
                   help="examples kept out to score at the end (the first ones)")
    p.add_argument("--init", metavar="DIR",
                   help="continue training this drafter (its shape replaces --block-size, "
                        "--layers, --target-layer-ids and --mask-token-id)")
    p.add_argument("--dflash2", action="store_true", help="a DFlash2 drafter (see above)")
    p.add_argument("--conv-kernel-size", type=int, default=4, help="DFlash2 convolution width")
    p.add_argument("--conv-group-size", type=int, default=64,
                   help="DFlash2: channels sharing one dynamic weight")
    p.add_argument("--selector-rank", type=int, default=64, help="DFlash2 pair-score rank")
    p.add_argument("--selector-top-k", type=int, default=8, help="DFlash2 candidates per position")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=1, help="drafter depth")
    p.add_argument("--target-layer-ids", help="comma list (default: the spec's spread)")
    p.add_argument("--mask-token-id", type=int, help="default: vocab_size - 1")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--anchors", type=int, default=512, help="blocks per sequence at most")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=float, default=0.04)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--gamma", type=float, help="loss decay (default: 7, 5, 4 for B = 16, 10, 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    p.add_argument("--dtype", help="target dtype (default: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--save-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--max-minutes", type=float, help="stop early after this much training time")
    return p.parse_args(argv)


def load_examples(args: argparse.Namespace, target: CausalLM) -> list[Example]:
    if args.random_prompts is not None:
        g = torch.Generator().manual_seed(args.seed)
        prompts = torch.randint(0, target.config.vocab_size, (args.random_prompts, args.prompt_len),
                                generator=g).tolist()
        return regenerate(target, prompts, args.response_len, ignore_eos=True)
    examples = [e for path in args.data for e in read_jsonl(path)]
    if not args.regenerate:
        return examples
    return regenerate(target, prompts_of(examples), args.response_len)


def describe(scores: Scores) -> str:
    acc = " ".join(f"{a:.2f}" for a in scores.accuracy)
    walk = "" if scores.decode_tau is None else f"  decode tau {scores.decode_tau:.2f}"
    return f"loss {scores.loss:.4f}  tau {scores.tau:.2f}{walk}  acc@k [{acc}]"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = resolve_device(args.device)
    dtype = training_dtype(args.dtype, device)
    target = load_model(args.target, dtype=dtype, device=device)
    t0 = time.perf_counter()
    examples = load_examples(args, target)
    print(f"{len(examples)} examples, {sum(map(sum, (e.loss_mask for e in examples)))} response "
          f"tokens ({time.perf_counter() - t0:.1f}s)", flush=True)
    if args.save_data:
        write_jsonl(args.save_data, examples)
    held_out, examples = examples[: args.holdout], examples[args.holdout :]
    layer_ids = None
    if args.target_layer_ids:
        layer_ids = [int(i) for i in args.target_layer_ids.split(",")]
    extras = None
    if args.dflash2:
        extras = DFlash2Extras(args.conv_kernel_size, args.conv_group_size, args.selector_rank,
                               args.selector_top_k)
    if args.init:
        drafter = load_drafter(args.init, target, dtype=torch.float32)
        if extras is not None and drafter.config.v2 is None:
            drafter = grow_to_v2(drafter, extras, args.seed)
    else:
        drafter = init_drafter(target.config, args.block_size, args.layers, layer_ids,
                               args.mask_token_id, args.seed, extras).to(device)
    config = TrainConfig(
        steps=args.steps, batch_size=args.batch_size, max_anchors=args.anchors, lr=args.lr,
        warmup=args.warmup, weight_decay=args.weight_decay, grad_clip=args.grad_clip,
        gamma=args.gamma, seed=args.seed, log_every=args.log_every,
        max_seconds=None if args.max_minutes is None else 60 * args.max_minutes,
    )

    def log(record: TrainLog) -> None:
        print(f"step {record.step:5d}  lr {record.lr:.2e}  {record.seconds:7.1f}s  "
              f"{describe(record.scores)}", flush=True)

    last = train(target, drafter, examples, config, log)
    out = save_drafter(drafter, args.out, resolve_dtype(args.save_dtype, device))
    summary = {"args": vars(args), "last": {**last._asdict(), "scores": last.scores._asdict()}}
    if held_out:
        scores = evaluate(target, drafter, held_out, args.batch_size, args.gamma)
        print(f"held out ({len(held_out)} examples): {describe(scores)}")
        summary["held_out"] = scores._asdict()
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
