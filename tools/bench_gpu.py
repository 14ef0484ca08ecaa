"""GPU benchmark of the speculative hot path: each Triton kernel against its torch reference and
torch SDPA, then end-to-end decode with and without DFlash on a random-weight model of Qwen3-8B's
shapes. Needs CUDA; `bash tools/bench_gpu.sh` installs, runs the GPU tests, then this.

    python tools/bench_gpu.py [--out bench_gpu.json] [--quick] [--dry-run]

Kernel timings are medians of CUDA-event-timed repeats after warm-up (triton.testing.do_bench);
"GB/s" counts the bytes a kernel must read and write at least. The end-to-end part runs the
engine at batch 1 and 8 (512-token prompts), greedy, ignore_eos, on the same random target,
once plainly and once with a random 5-layer DFlash drafter (block 16), each eager and from CUDA
graphs (engine.graphs). Random weights accept almost nothing (tau ~ 1), so the
speculative tokens/s is a floor; what transfers to trained weights is the cost of a verify step
relative to a plain decode step, reported as the break-even acceptance length (a drafter must
commit this many tokens per verify step to beat plain decoding). Every speculative output is
compared with the plain output, token for token (in bfloat16 on a GPU a 16-row verify and a
1-row decode round differently, so near-tied logits of random weights can differ: reported).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Callable

import torch
import torch.nn.functional as F

from agentflash.engine.config import CacheConfig, ModelConfig, SchedulerConfig, SpecConfig
from agentflash.engine.engine import Engine
from agentflash.engine.models.qwen3 import CausalLM
from agentflash.engine.sampler import SamplingParams
from agentflash.kernels import dispatch, torch_ops
from agentflash.training.drafter_checkpoint import init_drafter

# Qwen3-8B (config.json of Qwen/Qwen3-8B): 36 layers, hidden 4096, 32 query / 8 KV heads of 128
QWEN3_8B = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
    num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
    tie_word_embeddings=False, torch_dtype="bfloat16",
)
HQ, HKV, D, PAGE = 32, 8, 128, 16
DTYPE = torch.bfloat16


def bench(fn: Callable[[], object]) -> float:
    """Median milliseconds of fn on the GPU."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def row(name: str, shape: str, times: dict[str, float], nbytes: int) -> dict:
    best = min(times.values())
    cols = "  ".join(f"{k} {v * 1e3:8.1f} us" for k, v in times.items())
    print(f"{name:18s} {shape:28s} {cols}  ({nbytes / best / 1e6:7.1f} GB/s best)", flush=True)
    return {"kernel": name, "shape": shape, "ms": times, "min_bytes": nbytes}


def paged_case(batch: int, ctx: int, q_len: int) -> dict:
    """Verify (q_len 16) or decode (1) attention of `batch` sequences over `ctx` paged keys."""
    g = torch.Generator(device="cuda").manual_seed(0)
    pages = batch * math.ceil(ctx / PAGE)
    k_cache = torch.randn(pages * PAGE, HKV, D, device="cuda", dtype=DTYPE, generator=g)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(pages, device="cuda", generator=g).view(batch, -1)  # scattered pages
    slot = (perm[:, :, None] * PAGE + torch.arange(PAGE, device="cuda")).flatten(1)[:, :ctx]
    q = torch.randn(batch * q_len, HQ, D, device="cuda", dtype=DTYPE, generator=g)
    q_index = torch.arange(batch * q_len, device="cuda").view(batch, q_len)
    key_pos = torch.arange(ctx, device="cuda")
    q_pos = ctx - q_len + torch.arange(q_len, device="cuda")
    mask = (key_pos[None, :] <= q_pos[:, None])[None, None].expand(batch, 1, q_len, ctx)
    mask = mask.contiguous()
    args = (q, k_cache, v_cache, slot, q_index, None, mask, D ** -0.5)
    # SDPA on K/V already contiguous per sequence: the no-paging lower bound of torch
    k_dense = k_cache[slot].transpose(1, 2).contiguous()
    v_dense = v_cache[slot].transpose(1, 2).contiguous()
    q_dense = q.view(batch, q_len, HQ, D).transpose(1, 2)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q_dense, k_dense, v_dense, attn_mask=mask,
                                              enable_gqa=True)

    from agentflash.kernels import triton_attention

    out_t = triton_attention.paged_attention(*args)
    torch.testing.assert_close(out_t, torch_ops.paged_attention(*args), atol=2e-2, rtol=0)
    times = {"triton": bench(lambda: triton_attention.paged_attention(*args)),
             "torch": bench(lambda: torch_ops.paged_attention(*args)),
             "sdpa_dense": bench(sdpa)}
    nbytes = 2 * k_cache[: batch * ctx].numel() * 2 + 2 * q.numel() * 2
    return row("paged_attention", f"N={batch} ctx={ctx} q={q_len}", times, nbytes)


def draft_case(batch: int, ctx: int, block: int = 16) -> dict:
    from agentflash.kernels import triton_attention

    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(batch, block, HQ, D, device="cuda", dtype=DTYPE, generator=g)
    k_ctx = torch.randn(batch, ctx, HKV, D, device="cuda", dtype=DTYPE, generator=g)
    v_ctx = torch.randn_like(k_ctx)
    k_blk = torch.randn(batch, block, HKV, D, device="cuda", dtype=DTYPE, generator=g)
    v_blk = torch.randn_like(k_blk)
    lens = torch.full((batch,), ctx, device="cuda")
    args = (q, k_ctx, v_ctx, lens, k_blk, v_blk, D ** -0.5, False, None)
    k_all = torch.cat([k_ctx, k_blk], 1).transpose(1, 2)
    v_all = torch.cat([v_ctx, v_blk], 1).transpose(1, 2)
    q_t = q.transpose(1, 2)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q_t, k_all, v_all, enable_gqa=True)

    torch.testing.assert_close(triton_attention.draft_attention(*args),
                               torch_ops.draft_attention(*args), atol=2e-2, rtol=0)
    times = {"triton": bench(lambda: triton_attention.draft_attention(*args)),
             "torch": bench(lambda: torch_ops.draft_attention(*args)),
             "sdpa_dense": bench(sdpa)}
    nbytes = 2 * (k_ctx.numel() + k_blk.numel()) * 2 + 2 * q.numel() * 2
    return row("draft_attention", f"N={batch} ctx={ctx} B={block}", times, nbytes)


def accept_case(batch: int, block: int = 16, vocab: int = 151936) -> list[dict]:
    from agentflash.kernels import triton_accept

    g = torch.Generator(device="cuda").manual_seed(2)
    rows = batch * block
    logits = torch.randn(rows, vocab, device="cuda", generator=g)
    start = torch.arange(batch, device="cuda") * block
    num = torch.full((batch,), block - 1, device="cuda")
    choice = logits.argmax(-1).view(batch, block)
    drafts = choice[:, : block - 1].clone()
    drafts[:, 4:] = 0  # 4 accepted drafts per block: the kernel stops reading there
    args = (logits, start, num, drafts)
    assert torch.equal(triton_accept.accept_greedy(*args), torch_ops.accept_greedy(*args))

    draft_lists = drafts.tolist()

    def host_loop() -> None:  # what the engine did before: argmax of every row, then Python
        ids = logits.argmax(-1).tolist()
        for i in range(batch):
            k = 0
            while k < block - 1 and draft_lists[i][k] == ids[i * block + k]:
                k += 1

    out = [row("accept_greedy", f"N={batch} B={block} V={vocab}",
               {"triton": bench(lambda: triton_accept.accept_greedy(*args)),
                "torch": bench(lambda: torch_ops.accept_greedy(*args)),
                "host_loop": bench(host_loop)}, batch * 5 * vocab * 4)]
    probs = torch.softmax(logits, -1)
    uniforms = torch.rand(batch, block, device="cuda", generator=g)
    s_args = (probs, start, num, drafts, uniforms)
    out.append(row("accept_sample", f"N={batch} B={block} V={vocab}",
                   {"triton": bench(lambda: triton_accept.accept_sample(*s_args)),
                    "torch": bench(lambda: torch_ops.accept_sample(*s_args))},
                   batch * 2 * vocab * 4))
    return out


def context_kv_case(tokens: int) -> dict:
    from agentflash.kernels import triton_context_kv

    g = torch.Generator(device="cuda").manual_seed(3)
    k = torch.randn(tokens, HKV, D, device="cuda", dtype=DTYPE, generator=g)
    v = torch.randn_like(k)
    weight = torch.ones(D, device="cuda", dtype=DTYPE)
    angles = torch.rand(40960, D // 2, device="cuda", generator=g)
    cos, sin = angles.cos(), angles.sin()
    positions = torch.arange(tokens, device="cuda")
    slots = torch.randperm(tokens * 2, device="cuda", generator=g)[:tokens]
    caches = [torch.zeros(tokens * 2, HKV, D, device="cuda", dtype=DTYPE) for _ in range(4)]
    ref = (k, v, weight, 1e-6, cos, sin, positions, slots, caches[0], caches[1])
    tri = (k, v, weight, 1e-6, cos, sin, positions, slots, caches[2], caches[3])
    torch_ops.store_context_kv(*ref)
    triton_context_kv.store_context_kv(*tri)
    torch.testing.assert_close(caches[2].float(), caches[0].float(), atol=2e-2, rtol=2 ** -6)
    times = {"triton": bench(lambda: triton_context_kv.store_context_kv(*tri)),
             "torch": bench(lambda: torch_ops.store_context_kv(*ref))}
    return row("store_context_kv", f"T={tokens}", times, 4 * k.numel() * 2)


def random_target(shape: dict, device: str, dtype: torch.dtype = DTYPE) -> CausalLM:
    """A Qwen3 of `shape` (HF config keys) with random N(0, 0.02) weights, built on `device`."""
    config = ModelConfig.from_hf(shape)
    with torch.device("meta"):
        model = CausalLM(config).to(dtype)
    model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=g) if p.dim() > 1 else p.fill_(1.0)
    model.rotary.build(device)
    return model.eval().requires_grad_(False)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def decode(engine: Engine, prompts: list[list[int]], new: int, device: str) -> tuple[list, dict]:
    """All prompts at once; tokens/s and step time counted after every sequence's first token
    (so prefill is left out)."""
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    ids = [engine.submit(p, params) for p in prompts]
    started: set[int] = set()
    t0 = steps = tokens = 0
    while engine.has_work():
        updates = engine.step()
        if len(started) == len(ids):
            steps += 1
            tokens += sum(len(u.new_token_ids) for u in updates)
        for u in updates:
            if u.new_token_ids and u.seq_id not in started:
                started.add(u.seq_id)
                if len(started) == len(ids):
                    _sync(device)
                    t0, verifies0 = time.perf_counter(), engine.counters.draft_forwards
    _sync(device)
    seconds = time.perf_counter() - t0
    verifies = engine.counters.draft_forwards - verifies0
    return [engine.result(i).output_ids for i in ids], {
        "tokens_per_s": tokens / seconds, "step_ms": 1e3 * seconds / max(1, steps),
        "tau": tokens / verifies / len(ids) if verifies else None,
    }


def end_to_end(shape: dict, draft_layers: int, new: int, device: str,
               batches: tuple[int, ...] = (1, 8), prompt_len: int = 512,
               dtype: torch.dtype = DTYPE) -> list[dict]:
    """Plain vs DFlash decode on one random target (and random drafter), per batch size, each
    eager and from graphs (engine.graphs: CUDA graphs on CUDA, the eager replay on CPU)."""
    target = random_target(shape, device, dtype)
    drafter = init_drafter(target.config, 16, draft_layers, seed=0).to(device, dtype)
    results = []
    g = torch.Generator().manual_seed(4)
    for batch in batches:
        prompts = torch.randint(0, shape["vocab_size"], (batch, prompt_len), generator=g).tolist()
        runs = {}
        for graphs in (False, True):
            for name, d in (("plain", None), ("dflash", drafter)):
                engine = Engine(target, CacheConfig(16, 2 * batch * (prompt_len + new) // 16 + 64),
                                SchedulerConfig(max_running=batch), drafter=d,
                                spec=SpecConfig(16), speculation="always", fast_path=not graphs,
                                graphs=graphs)
                decode(engine, prompts, 4, device)  # warm-up: Triton compiles, graphs captured
                outputs, stats = decode(engine, prompts, new, device)
                if graphs:
                    forwards = [engine.runner.decode, getattr(engine.runner.drafter, "forward",
                                                              None)]
                    stats["graph_eager_steps"] = sum(f.stats.eager for f in forwards if f)
                runs[name + (" graphs" if graphs else "")] = outputs, stats
        plain, spec = runs["plain"][1], runs["dflash"][1]
        same = sum(a == b for a, b in zip(runs["plain"][0], runs["dflash"][0]))
        same_graphs = sum(runs[k][0] == runs[k + " graphs"][0] for k in ("plain", "dflash"))
        result = {"batch": batch, **{k.replace(" ", "_"): v[1] for k, v in runs.items()},
                  "break_even_tau": spec["step_ms"] / plain["step_ms"],
                  "break_even_tau_graphs": (runs["dflash graphs"][1]["step_ms"]
                                            / runs["plain graphs"][1]["step_ms"]),
                  "identical_outputs": f"{same}/{batch}",
                  "graphs_identical_to_eager": f"{same_graphs}/2"}
        for label, suffix in (("eager ", ""), ("graphs", " graphs")):
            p, s = runs["plain" + suffix][1], runs["dflash" + suffix][1]
            print(f"decode batch {batch} {label}: plain {p['tokens_per_s']:8.1f} tok/s "
                  f"({p['step_ms']:.2f} ms/step); DFlash {s['tokens_per_s']:8.1f} tok/s "
                  f"({s['step_ms']:.2f} ms/verify step, tau {s['tau']:.2f}); "
                  f"break-even tau {s['step_ms'] / p['step_ms']:.2f}", flush=True)
        print(f"decode batch {batch}: DFlash outputs identical to plain {same}/{batch}; graph "
              f"runs identical to eager {same_graphs}/2", flush=True)
        results.append(result)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="bench_gpu.json")
    p.add_argument("--quick", action="store_true", help="small sweep, 4-layer target")
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU: the end-to-end part on CPU at a tiny shape (no kernel timings)")
    p.add_argument("--new-tokens", type=int, default=128)
    args = p.parse_args()
    if args.dry_run:
        tiny = {**QWEN3_8B, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 32, "max_position_embeddings": 1024}
        print(f"dry run on CPU (torch {torch.__version__}): no kernel timings", flush=True)
        e2e = end_to_end(tiny, 1, 16, "cpu", prompt_len=64, dtype=torch.float32)
        with open(args.out, "w") as f:
            json.dump({"device": "cpu (dry run)", "torch": torch.__version__, "kernels": [],
                       "end_to_end": e2e}, f, indent=2)
        print(f"wrote {args.out}")
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs CUDA (--dry-run runs its end-to-end part on CPU)")
    dispatch.use("triton")  # registers the kernels (and is the engine's choice on CUDA anyway)
    dispatch.use("auto")
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    kernels: list[dict] = []
    for batch, ctx in ((1, 4096), (8, 4096), (32, 2048)) if not args.quick else ((1, 1024),):
        kernels.append(paged_case(batch, ctx, 1))
        kernels.append(paged_case(batch, ctx, 16))
        kernels.append(draft_case(batch, ctx))
    for batch in (1, 32) if not args.quick else (1,):
        kernels.extend(accept_case(batch))
    for tokens in (16, 4096):
        kernels.append(context_kv_case(tokens))
    shape = {**QWEN3_8B, "num_hidden_layers": 4} if args.quick else QWEN3_8B
    e2e = end_to_end(shape, 1 if args.quick else 5, 16 if args.quick else args.new_tokens, "cuda")
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "kernels": kernels, "end_to_end": e2e}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
