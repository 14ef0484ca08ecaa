"""A multi-turn session on the engine: each turn appends a "tool result" and generates a reply.

Shows what the prefix cache buys an agent loop: turn N prefills only its new tokens because
turn N-1 (prompt AND reply) stays pinned in the paged KV pool. The same session is then re-run
with a fresh cache every turn for comparison. Until the embedded trained model lands this uses a
random-weight ~30M Qwen3 (token ids, not text) unless --model points at a checkpoint.

    python examples/multi_turn.py [--model DIR] [--turns 5] [--system-tokens 1500]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from agentflash.engine.config import CacheConfig, SchedulerConfig
from agentflash.engine.engine import Engine
from agentflash.engine.models.loader import load_model
from agentflash.engine.sampler import SamplingParams


def random_qwen3(path: str) -> str:
    import transformers

    cfg = transformers.Qwen3Config(
        vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        max_position_embeddings=8192, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


def run_session(model, turns: list[list[int]], reply_tokens: int, reuse: bool) -> list[dict]:
    cache, sched = CacheConfig(page_size=16, num_pages=1024), SchedulerConfig(max_batch_tokens=2048)
    engine = Engine(model, cache, sched)
    params = SamplingParams(max_new_tokens=reply_tokens, ignore_eos=True)
    history: list[int] = []
    pin = None
    rows = []
    for new in turns:
        history = history + new
        if not reuse:
            engine = Engine(model, cache, sched)  # nothing survives from the last turn
        t0 = time.perf_counter()
        seq = engine.submit(history, params, pin=reuse)
        ttft = None
        while engine.has_work():
            for u in engine.step():
                if u.new_token_ids and ttft is None:
                    ttft = time.perf_counter() - t0
        total = time.perf_counter() - t0
        done = engine.result(seq)
        if pin is not None:
            engine.unpin(pin)  # the new turn's pin covers the whole conversation now
        pin = done.pin
        rows.append(dict(prompt=len(history), cached=done.counters.cached_tokens,
                         computed=done.counters.prefill_tokens, ttft=ttft, total=total))
        history = history + done.output_ids
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--tool-tokens", type=int, default=60)
    ap.add_argument("--reply-tokens", type=int, default=24)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(args.model or random_qwen3(tmp))
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    turns = [torch.randint(0, vocab, (args.system_tokens,), generator=g).tolist()]
    turns += [torch.randint(0, vocab, (args.tool_tokens,), generator=g).tolist()
              for _ in range(args.turns - 1)]
    with torch.inference_mode():
        run_session(model, turns[:1], 2, reuse=True)  # warm-up
        reuse = run_session(model, turns, args.reply_tokens, reuse=True)
        fresh = run_session(model, turns, args.reply_tokens, reuse=False)
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'computed':>8} {'TTFT ms':>8} "
          f"{'no-reuse TTFT ms':>17} {'speedup':>8}")
    for i, (r, f) in enumerate(zip(reuse, fresh), 1):
        print(f"{i:>4} {r['prompt']:>7} {r['cached']:>7} {r['computed']:>8} "
              f"{r['ttft'] * 1e3:>8.1f} {f['ttft'] * 1e3:>17.1f} {f['ttft'] / r['ttft']:>7.1f}x")
    tr, tf = sum(r["total"] for r in reuse), sum(f["total"] for f in fresh)
    print(f"session total: {tr:.2f} s with KV reuse vs {tf:.2f} s re-prefilling ({tf / tr:.1f}x)")


if __name__ == "__main__":
    main()
