"""Where one decode step and one verify forward spend their time, and what verifying B tokens
costs in plain decode steps (c(B)), at batch 1 after a context of --context tokens.

    python tools/profile_step.py                                   # the embedded model
    python tools/profile_step.py --model /tmp/qwen3-0.6b-shaped    # tools/make_random_model.py
    python tools/profile_step.py --no-compile                      # eager forwards, packed
    python tools/profile_step.py --no-fast-path                    # models as loaded (eager)

For B = 1 (a decode step) and B = --verify (default 16) it profiles the target forward with
torch.profiler and splits it into: linear layers (with the weight bytes they stream per second),
the attention's K/V gather and matmuls, every other aten op, and what is outside aten (Python,
dispatch, metadata). Then c(B) for B = 1..16 and, where the model carries a drafter, d(B), the
drafter's forward for B - 1 drafts: each the median of --steps timed forwards, B interleaved (a
shared machine's drift falls on every B alike). The KV of each timed forward is rolled back, so
every one runs at the same context.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from agentflash.embedded import embedded_model_dir
from agentflash.engine.config import CacheConfig
from agentflash.engine.device import resolve_dtype
from agentflash.engine.engine import Engine
from agentflash.engine.models.dflash import bundled_drafter_dir, load_drafter
from agentflash.engine.models.loader import load_model
from agentflash.engine.sampler import SamplingParams
from agentflash.engine.batch import BatchItem

LINEAR_OPS = {"mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::linear",
              "agentflash::linear_bf16", "agentflash::linear_panels",
              "agentflash::linear_int8"}
GATHER_OPS = {"aten::index_select"}
# the torch path's batched matmuls, or agentflash's CPU attention kernel (which reads the pool in
# place: no gather). Inside a compiled program only these custom ops are seen (Inductor's own
# kernels and oneDNN calls are not profiled): its time is "other" and "outside aten".
ATTENTION_MATMUL_OPS = {"aten::bmm", "agentflash::paged_attention_bf16"}


def _forward(engine: Engine, seq, tokens: int, draft: bool) -> tuple[float, float]:
    """Seconds of one target forward over `tokens` new tokens (and of the drafter forward
    before it, if `draft`), then the KV rolled back."""
    length = seq.kv.length
    item = BatchItem(seq, tokens)
    item.draft = [1] * (tokens - 1) if item.verifies else None
    t0 = time.perf_counter()
    if draft:
        engine.runner.drafter.draft([item], engine.block_size, tokens - 1)
    t1 = time.perf_counter()
    engine.runner.forward([item])
    t2 = time.perf_counter()
    engine.kv.truncate(seq.kv, length)
    return t2 - t1, t1 - t0


def _breakdown(engine: Engine, seq, tokens: int, steps: int, weight_bytes: int) -> dict:
    _forward(engine, seq, tokens, False)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            _forward(engine, seq, tokens, False)
        wall = (time.perf_counter() - t0) / steps
    split = {"linear": 0.0, "gather": 0.0, "attn_mm": 0.0, "other": 0.0}
    calls = {key: 0 for key in split}
    for event in prof.key_averages():
        key = ("linear" if event.key in LINEAR_OPS else "gather" if event.key in GATHER_OPS
               else "attn_mm" if event.key in ATTENTION_MATMUL_OPS else "other")
        split[key] += event.self_cpu_time_total / 1e6 / steps
        calls[key] += event.count // steps
    profiled = sum(split.values())
    return {"wall_ms": wall * 1e3, **{f"{k}_ms": v * 1e3 for k, v in split.items()},
            "outside_aten_ms": max(0.0, wall - profiled) * 1e3,
            "aten_calls": sum(calls.values()), "linear_calls": calls["linear"],
            "linear_gb_s": weight_bytes / split["linear"] / 1e9 if split["linear"] else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(embedded_model_dir()))
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--verify", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--no-fast-path", action="store_true")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-draft", action="store_true")
    ap.add_argument("--quantize", choices=["int8"], default=None)
    args = ap.parse_args()

    device = torch.device("cpu")
    model = load_model(args.model, dtype=resolve_dtype(args.dtype, device))
    draft_dir = None if args.no_draft else bundled_drafter_dir(args.model)
    drafter = load_drafter(draft_dir, model) if draft_dir is not None else None
    weight_bytes = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                       if name.endswith("proj.weight") or name == "lm_head.weight")
    if model.lm_head is None:  # tied head: the embedding matrix is streamed once more
        weight_bytes += model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    if args.quantize == "int8":  # one byte a weight
        weight_bytes //= 2
    pages = -(-(args.context + 64) // 16) + 8
    engine = Engine(model, CacheConfig(16, pages), drafter=drafter,
                    fast_path=not args.no_fast_path, compile=not args.no_compile,
                    quantize=args.quantize,
                    max_model_len=args.context + 64, speculation="always")
    prompt = [(7 * i + 11) % model.config.vocab_size for i in range(args.context)]
    seq_id = engine.submit(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True),
                           speculative=False)
    seq = engine.sequence(seq_id)
    while not seq.output_ids:
        engine.step()  # prefill (in chunks) and the first token
    print(f"model {args.model}: {model.dtype}, fast path {engine.fast_paths or 'none'}, "
          f"context {seq.kv.length}, weights streamed per forward {weight_bytes / 1e6:.1f} MB, "
          f"{torch.get_num_threads()} threads")

    print("\n| forward | wall ms | linear ms (GB/s) | K/V gather ms | attention ms "
          "| other aten ms | outside aten ms | aten calls |\n" + "|---" * 8 + "|")
    for tokens in (1, args.verify):
        b = _breakdown(engine, seq, tokens, args.steps, weight_bytes)
        print(f"| {tokens} token{'s' * (tokens > 1)} | {b['wall_ms']:.2f} | {b['linear_ms']:.2f} "
              f"({b['linear_gb_s']:.1f}) | {b['gather_ms']:.2f} | {b['attn_mm_ms']:.2f} | "
              f"{b['other_ms']:.2f} | {b['outside_aten_ms']:.2f} | {b['aten_calls']} |")

    blocks = list(range(1, args.verify + 1))
    target: dict[int, list[float]] = {b: [] for b in blocks}
    draft: dict[int, list[float]] = {b: [] for b in blocks}
    for rnd in range(args.steps + 1):
        for b in blocks:
            t, d = _forward(engine, seq, b, drafter is not None and b > 1)
            if rnd:
                target[b].append(t)
                draft[b].append(d)
    plain = statistics.median(target[1])
    print(f"\nplain decode step (target forward) {plain * 1e3:.2f} ms; in plain steps, c(B): a "
          "verify of B tokens, d(B): the drafter's forward for its B - 1 drafts")
    print("| B | " + " | ".join(map(str, blocks)) + " |\n" + "|---" * (len(blocks) + 1) + "|")
    rows = [("c(B)", target)] + ([("d(B)", draft)] if drafter is not None else [])
    for name, times in rows:
        print(f"| {name} | " + " | ".join(f"{statistics.median(times[b]) / plain:.2f}"
                                          for b in blocks) + " |")
    engine.abort(seq_id)


if __name__ == "__main__":
    main()
