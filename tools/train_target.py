"""Pretrain the embedded target: a small Qwen3 on the agent corpus, saved as a Hugging Face dir.

    python tools/train_target.py --corpus corpus/ --tokenizer tok/ --out model/ \\
        --phase 1024:40 --phase 4096:15

Each --phase LEN:MINUTES trains on conversations packed into rows of LEN tokens (documents
separated by <|endoftext|>) for that much wall time; a phase with LEN above 1024 uses only the
long conversations (>= LEN/4 tokens), so the last phase teaches the full context. The learning
rate warms up, then follows a cosine over the total planned time. The loss is next-token
cross-entropy on every token. Uses transformers' Qwen3ForCausalLM (sdpa attention), float32 on
CPU. Writes config.json, model.safetensors (--save-dtype, bfloat16 by default),
generation_config.json, the tokenizer files and training.json (arguments, log, validation loss).
Seeded: data order and init are reproducible; the number of steps depends on machine speed.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from corpus import Tokenized, read_conversations

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--corpus", required=True, help="dir with train.jsonl and validation.jsonl")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--phase", action="append", required=True, metavar="LEN:MINUTES")
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--max-position", type=int, default=4096)
    p.add_argument("--rope-theta", type=float, default=1_000_000.0)
    p.add_argument("--batch-tokens", type=int, default=8192, help="tokens per optimizer step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--validation-rows", type=int, default=16)
    p.add_argument("--save-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    return p.parse_args(argv)


def pack(examples: list[list[int]], length: int, eot: int, rng: random.Random) -> torch.Tensor:
    """Shuffled documents, each cut to `length`, laid end to end and split into rows."""
    order = list(range(len(examples)))
    rng.shuffle(order)
    stream: list[int] = []
    for i in order:
        stream += examples[i][:length - 1] + [eot]
    rows = len(stream) // length
    return torch.tensor(stream[:rows * length]).view(rows, length)


@torch.no_grad()
def validation_loss(model: Qwen3ForCausalLM, rows: torch.Tensor) -> float:
    model.eval()
    losses = [model(input_ids=r[None], labels=r[None]).loss.item() for r in rows]
    model.train()
    return sum(losses) / max(1, len(losses))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    phases = [(int(a), float(b)) for a, b in (p.split(":") for p in args.phase)]
    total_s = 60 * sum(m for _, m in phases)
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    enc = Tokenized(tok)
    corpus = Path(args.corpus)
    train = [enc.encode(c).input_ids for c in read_conversations(corpus / "train.jsonl")]
    valid = [enc.encode(c).input_ids for c in read_conversations(corpus / "validation.jsonl")]
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    print(f"train {len(train)} conversations {sum(map(len, train))} tokens; "
          f"validation {len(valid)}", flush=True)

    config = Qwen3Config(
        vocab_size=len(tok), hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, intermediate_size=args.intermediate,
        max_position_embeddings=args.max_position, rope_theta=args.rope_theta,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id)
    model = Qwen3ForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model {n_params / 1e6:.2f}M parameters", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))

    log: list[dict] = []
    step, tokens, start = 0, 0, time.time()
    for length, minutes in phases:
        docs = train if length <= 1024 else [d for d in train if len(d) >= length // 4]
        vdocs = valid if length <= 1024 else [d for d in valid if len(d) >= length // 4]
        vrows = pack(vdocs, length, eot, random.Random(0))[:args.validation_rows]
        rows_per_step = max(1, args.batch_tokens // length)
        phase_end = time.time() + 60 * minutes
        data, cursor = pack(docs, length, eot, rng), 0
        print(f"phase {length}: {len(docs)} conversations, {len(data)} rows", flush=True)
        while time.time() < phase_end:
            elapsed = time.time() - start
            lr = args.lr * min(1.0, (step + 1) / args.warmup_steps)
            lr = args.min_lr + (lr - args.min_lr) * 0.5 * (1 + math.cos(math.pi * min(
                1.0, elapsed / total_s)))
            for g in opt.param_groups:
                g["lr"] = lr
            if cursor + rows_per_step > len(data):
                data, cursor = pack(docs, length, eot, rng), 0
            rows = data[cursor:cursor + rows_per_step]
            cursor += rows_per_step
            loss = model(input_ids=rows, labels=rows).loss
            loss.backward()
            loss_sum = loss.item()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            tokens += rows_per_step * length
            if step % args.log_every == 0:
                rate = tokens / (time.time() - start)
                print(f"step {step} len {length} loss {loss_sum:.3f} lr {lr:.2e} "
                      f"{tokens / 1e6:.2f}M tokens {rate:.0f} tok/s", flush=True)
                log.append({"step": step, "length": length, "loss": loss_sum, "lr": lr,
                            "tokens": tokens, "seconds": time.time() - start})
        vloss = validation_loss(model, vrows)
        print(f"phase {length} done: validation loss {vloss:.3f}", flush=True)
        log.append({"phase": length, "validation_loss": vloss, "step": step, "tokens": tokens})

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.to(getattr(torch, args.save_dtype)).save_pretrained(out)
    # generation ends at the end of the turn or of the document (<|endoftext|> separates the
    # training stream's conversations), as Qwen3 chat models' generation_config.json has it
    GenerationConfig(eos_token_id=[tok.eos_token_id, eot], pad_token_id=tok.pad_token_id,
                     do_sample=False).save_pretrained(out)
    for f in TOKENIZER_FILES:
        shutil.copy(Path(args.tokenizer) / f, out / f)
    (out / "training.json").write_text(json.dumps(
        {"args": vars(args), "parameters": n_params, "steps": step, "tokens": tokens,
         "seconds": time.time() - start, "log": log}, indent=1) + "\n")
    print(f"saved {out} after {step} steps, {tokens} tokens", flush=True)


if __name__ == "__main__":
    main()
