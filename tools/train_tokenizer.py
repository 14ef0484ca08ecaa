"""Train the embedded model's byte-level BPE tokenizer on the corpus, with its chat template.

    python tools/train_tokenizer.py --corpus corpus/train.jsonl --out model/ --vocab-size 4096

Writes tokenizer.json and tokenizer_config.json (Qwen3-style chat template with tools, from
tools/chat_template.jinja), so `AutoTokenizer.from_pretrained(out)` and
`apply_chat_template(messages, tools=...)` work unchanged. Token ids 0..7 are fixed:
<|endoftext|> (padding, end of document), <|im_start|>, <|im_end|> (end of turn: the model's eos),
<|mask|> (the DFlash drafter's mask token), then <tool_call>, </tool_call>, <tool_response>,
</tool_response> (single tokens that stay in decoded text, as in Qwen3).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Iterator

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

TEMPLATE = Path(__file__).with_name("chat_template.jinja")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
MAX_LENGTH = 4096


def render(template: str) -> "callable":
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    compiled = env.from_string(template)
    return lambda conv: compiled.render(messages=conv["messages"], tools=conv["tools"] or None)


def texts(corpus: Path, template: str) -> Iterator[str]:
    to_text = render(template)
    for line in corpus.open():
        yield to_text(json.loads(line))


def train(corpus: Path, vocab_size: int) -> Tokenizer:
    template = TEMPLATE.read_text()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL + TOOL_TAGS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts(corpus, template), trainer)
    return tok


def save(tok: Tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    spec = json.loads(tok.to_str())
    for added in spec["added_tokens"]:
        added["special"] = added["content"] in SPECIAL  # tool tags stay in decoded text
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False) + "\n")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "mask_token": "<|mask|>",
        "model_max_length": MAX_LENGTH,
        "clean_up_tokenization_spaces": False,
        "chat_template": TEMPLATE.read_text(),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--corpus", required=True, help="train.jsonl from tools/build_corpus.py")
    p.add_argument("--out", required=True)
    p.add_argument("--vocab-size", type=int, default=4096)
    args = p.parse_args(argv)
    tok = train(Path(args.corpus), args.vocab_size)
    save(tok, Path(args.out))
    ids = {t: tok.token_to_id(t) for t in SPECIAL + TOOL_TAGS}
    print(f"vocab {tok.get_vocab_size()}  special ids {ids}")


if __name__ == "__main__":
    main()
