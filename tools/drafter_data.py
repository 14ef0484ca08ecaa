"""Drafter training or evaluation prompts from the corpus: one line per assistant turn.

    python tools/drafter_data.py --corpus corpus/train.jsonl --tokenizer model/ --out prompts.jsonl

Each line is an `Example` (JSONL `{"input_ids", "loss_mask"}`): the conversation up to an
assistant turn (loss_mask 0) followed by the corpus's reply (loss_mask 1). Feed it to
`tools/train_drafter.py --data prompts.jsonl --regenerate`, which keeps each prompt and replaces
the reply by the target's own greedy one (the spec trains drafters on target-regenerated
responses). At most --per-conversation turns are taken from each conversation, chosen with the
seed, and prompts longer than --max-prompt tokens are dropped, so that prompt+reply fits the
model's context (--min-prompt drops the short ones, for a long-context set). --per-source
balances the sources (BFCL categories, stdlib code and prose).
--exclude skips the prompts of earlier files (a second set that adds to a first), --limit
stops after that many examples.
"""

from __future__ import annotations

import argparse
import random

from transformers import AutoTokenizer

from agentflash.training.data import Example, read_jsonl, write_jsonl
from agentflash.training.regenerate import prompts_of
from corpus import Tokenized, read_conversations


def examples(corpus: str, tokenizer_dir: str, per_conversation: int, max_prompt: int,
             per_source: int | None, seed: int, exclude: frozenset[tuple[int, ...]] = frozenset(),
             limit: int | None = None, min_prompt: int = 0) -> list[Example]:
    enc = Tokenized(AutoTokenizer.from_pretrained(tokenizer_dir))
    rng = random.Random(seed)
    conversations = read_conversations(corpus)
    rng.shuffle(conversations)
    out: list[Example] = []
    taken: dict[str, int] = {}
    for conv in conversations:
        if per_source is not None and taken.get(conv["source"], 0) >= per_source:
            continue
        prompts = [p for p in enc.prompts(conv)
                   if min_prompt <= len(p.ids) <= max_prompt and tuple(p.ids) not in exclude]
        for p in rng.sample(prompts, min(per_conversation, len(prompts))):
            if limit is not None and len(out) >= limit:
                return out
            out.append(Example(p.ids + p.reply, [0] * len(p.ids) + [1] * len(p.reply)))
            taken[conv["source"]] = taken.get(conv["source"], 0) + 1
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--corpus", required=True, help="a split from tools/build_corpus.py")
    p.add_argument("--tokenizer", required=True, help="model or tokenizer directory")
    p.add_argument("--out", required=True)
    p.add_argument("--per-conversation", type=int, default=2)
    p.add_argument("--max-prompt", type=int, default=3584)
    p.add_argument("--min-prompt", type=int, default=0)
    p.add_argument("--per-source", type=int, help="examples per corpus source at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--exclude", nargs="+", default=[], metavar="JSONL",
                   help="skip the prompts of these example files")
    p.add_argument("--limit", type=int, help="examples at most")
    args = p.parse_args(argv)
    exclude = frozenset(tuple(p) for path in args.exclude for p in prompts_of(read_jsonl(path)))
    data = examples(args.corpus, args.tokenizer, args.per_conversation, args.max_prompt,
                    args.per_source, args.seed, exclude, args.limit, args.min_prompt)
    write_jsonl(args.out, data)
    lens = sorted(len(e.input_ids) for e in data)
    print(f"{len(data)} examples; tokens median {lens[len(lens) // 2]}, max {lens[-1]}, "
          f"total {sum(lens)}")


if __name__ == "__main__":
    main()
