"""Turn-N time to first token on a hybrid (Qwen3.5-shaped) target: resuming from the state
snapshot where the previous turn ended, against computing the whole history again.

    python tools/bench_hybrid.py                       # 2k and 8k tokens of history
    python tools/bench_hybrid.py --history 2048 --hidden 1024 --layers 16
    python tools/bench_hybrid.py --experts 32   # Qwen3.5-MoE-shaped: 32 experts, top 4

A random Qwen3.5 text model (three Gated DeltaNet layers to each gated-attention layer, as the
published models; its size set by the flags) is saved to a temporary directory and loaded by
`Engine.from_dir`, eager. For each history length H: turn 1 prefills H tokens and generates 16;
turn 2 sends turn 1's prompt and reply plus 64 new tokens, once resuming (the engine restores
the snapshot and computes the new tokens) and once with reuse=False (the whole prompt computed).
Then a sibling conversation: all but the last 100 tokens of turn 1's prompt plus 64 new ones,
resuming from the snapshot the prefill took inside the prompt (every `state_interval` tokens).
Reported: each TTFT, the tokens each computed, and the bytes of one state snapshot.
Then c(B): a verify forward of B tokens (stepwise through the linear layers, with the rollback to
its first token that a rejection costs) in plain decode steps, at the first history length.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers

from agentflash.engine.config import CacheConfig
from agentflash.engine.engine import Engine
from agentflash.engine.states import LinearStates
from agentflash.engine.sampler import SamplingParams
from agentflash.engine.batch import BatchItem


def hybrid_checkpoint(path: Path, args: argparse.Namespace) -> None:
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                   for i in range(args.layers)]
    mlp = (dict(num_experts=args.experts, num_experts_per_tok=4,
                moe_intermediate_size=args.hidden // 2, shared_expert_intermediate_size=args.hidden)
           if args.experts else dict(intermediate_size=3 * args.hidden))
    config_cls, model_cls = ((transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM)
                             if args.experts else
                             (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM))
    cfg = config_cls(
        vocab_size=args.vocab, hidden_size=args.hidden, **mlp,
        num_hidden_layers=args.layers, layer_types=layer_types,
        num_attention_heads=args.hidden // 128, num_key_value_heads=2, head_dim=128,
        linear_num_key_heads=args.hidden // 128, linear_num_value_heads=args.hidden // 64,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        max_position_embeddings=max(args.history) + 1024,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                         "partial_rotary_factor": 0.25}, dtype="bfloat16")
    torch.manual_seed(0)
    model = model_cls(cfg).to(torch.bfloat16)
    model.save_pretrained(path)


def ttft(engine: Engine, prompt: list[int], reuse: bool) -> tuple[float, int]:
    done, = engine.generate([prompt], SamplingParams(max_new_tokens=1), reuse=reuse)
    c = done.counters
    return c.first_token_at - c.submitted_at, c.prefill_tokens


def verify_costs(engine: Engine, prompt: list[int], blocks: list[int], rounds: int = 5
                 ) -> dict[int, float]:
    """Median seconds of a target forward over B new tokens after `prompt` (B > 1: a verify
    block of drafts, then its state rolled back to the first token, as a rejection does), each
    B once per round; the KV and state are put back after every forward."""
    engine.generate([prompt], SamplingParams(max_new_tokens=1))   # prompt cached, snapshotted
    sid = engine.submit(prompt + [1], SamplingParams(max_new_tokens=10**6, ignore_eos=True))
    seq = engine.sequence(sid)
    while seq.prefilling or not seq.output_ids:
        engine.step()
    assert isinstance(engine.states, LinearStates) and seq.state_slot is not None
    times: dict[int, list[float]] = {b: [] for b in blocks}
    for _ in range(rounds + 1):
        for b in blocks:
            length = seq.kv.length
            conv, recurrent = engine.states.pool.gather([seq.state_slot])
            item = BatchItem(seq, b)
            item.draft = [1] * (b - 1) if item.verifies else None
            t0 = time.perf_counter()
            engine.runner.forward([item])
            if item.verifies:
                engine.states.settle(seq.id, 1)
            times[b].append(time.perf_counter() - t0)
            engine.kv.truncate(seq.kv, length)
            engine.states.pool.scatter([seq.state_slot], conv, recurrent)
    engine.abort(sid)
    while engine.has_work():
        engine.step()
    return {b: statistics.median(t[1:]) for b, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--history", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--experts", type=int, default=0,
                    help="a mixture-of-experts model with this many experts (4 per token)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        hybrid_checkpoint(Path(tmp), args)
        longest = max(args.history) + 1024
        engine = Engine.from_dir(tmp, cache=CacheConfig(16, 2 * -(-longest // 16) + 64),
                                 dtype=torch.bfloat16, max_model_len=longest)
        assert isinstance(engine.states, LinearStates)
        snapshot = sum(t[0].numel() * t.element_size()
                       for t in (*engine.states.pool.conv, *engine.states.pool.recurrent))
        params = sum(p.numel() for p in engine.model.parameters())
        warm = [rng.randrange(args.vocab) for _ in range(256)]  # first-call costs out of the way
        ttft(engine, warm, reuse=False)
        for history in args.history:
            prompt = [rng.randrange(args.vocab) for _ in range(history)]
            first, = engine.generate([prompt], SamplingParams(max_new_tokens=16))
            turn2 = prompt + first.output_ids + [rng.randrange(args.vocab) for _ in range(64)]
            scratch_s, scratch_tokens = ttft(engine, turn2, reuse=False)
            resumed_s, resumed_tokens = ttft(engine, turn2, reuse=True)
            # another conversation sharing all but the last 100 tokens of turn 1's prompt (a
            # system prompt and tools, say): it resumes from the snapshot inside the prompt
            sibling = prompt[:history - 100] + [rng.randrange(args.vocab) for _ in range(64)]
            sibling_s, sibling_tokens = ttft(engine, sibling, reuse=True)
            results.append({"history": history, "turn2_tokens": len(turn2),
                            "resumed_ttft_s": resumed_s, "resumed_computed": resumed_tokens,
                            "recomputed_ttft_s": scratch_s, "recomputed_computed": scratch_tokens,
                            "sibling_tokens": len(sibling), "sibling_ttft_s": sibling_s,
                            "sibling_computed": sibling_tokens})
            print(json.dumps(results[-1]), flush=True)
            engine.clear_cache()
        prompt = [rng.randrange(args.vocab) for _ in range(args.history[0])]
        blocks = [1, 2, 4, 8, 16]
        with torch.inference_mode():
            costs = verify_costs(engine, prompt, blocks)
    kind = f"Qwen3.5-MoE-shaped ({args.experts} experts, 4 per token)" if args.experts else \
        "Qwen3.5-shaped"
    print(f"\nrandom {kind} model: {params / 1e6:.0f}M parameters, {args.layers} layers "
          f"(3 linear : 1 full), hidden {args.hidden}, bf16, eager, {args.threads} threads; "
          f"one state snapshot {snapshot / 2**20:.2f} MiB\n")
    print("| history | turn-2 TTFT resuming | computed | turn-2 TTFT recomputing | computed "
          "| sibling prompt | its TTFT | computed |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['history']} | {1e3 * r['resumed_ttft_s']:.0f} ms | {r['resumed_computed']} "
              f"| {1e3 * r['recomputed_ttft_s']:.0f} ms | {r['recomputed_computed']} "
              f"| {r['sibling_tokens']} | {1e3 * r['sibling_ttft_s']:.0f} ms "
              f"| {r['sibling_computed']} |")
    print(f"\nplain decode step at {args.history[0]} tokens: {1e3 * costs[1]:.1f} ms; "
          "c(B) = verify of B tokens (stepwise, rolled back) / plain step:")
    print("| B | " + " | ".join(map(str, blocks)) + " |")
    print("|---|" + "---|" * len(blocks))
    print("| c(B) | " + " | ".join(f"{costs[b] / costs[1]:.2f}" for b in blocks) + " |")


if __name__ == "__main__":
    main()
