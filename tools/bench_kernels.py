"""agentflash's CPU kernels (kernels.cpu_ops) against torch on this machine, one op at a time.

    python tools/bench_kernels.py [--threads 2] [--repeats 200]

Linear: y = x W^T for decode (1 row) and verify (4, 16 rows) at agentflash-11m's and
Qwen3-0.6B's shapes, the weight either hot (the same matrix every call: it stays in cache) or
cold (cycling through 64 distinct matrices of that shape, so each call streams its weight from
memory or the shared L3, as a decode step does): microseconds a call (median) and the weight
bytes read per second, beside torch's F.linear in bfloat16 and in float32 on the same numbers.
The int8 kernel (per-row scales) reads half the bytes; its GB/s counts int8 bytes.
Attention: one layer's decode row and 16-query verify block over 1000 keys in the paged pool,
against the torch path (gather + batched matmuls). Which instruction set the kernels were built
for is printed first.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from agentflash.engine.attention import PagedAttention
from agentflash.engine.cpu.attention import KernelAttention
from agentflash.kernels import cpu_ops

SHAPES = {  # (N, K) of the linears of one layer, and the head
    "11m": [(384, 384), (128, 384), (1024, 384), (384, 1024), (4096, 384)],
    "0.6b": [(2048, 1024), (1024, 1024), (3072, 1024), (1024, 3072)],
}
ATTENTION = {"11m": (6, 2, 64), "0.6b": (16, 8, 128)}  # query heads, KV heads, head_dim


def median_us(fn: Callable[[int], object], repeats: int) -> float:
    for i in range(5):
        fn(i)
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def bench_linear(repeats: int) -> None:
    print("| model | N x K | rows | weight | kernel us (GB/s) | int8 kernel us (GB/s) "
          "| torch bf16 us | torch fp32 us |")
    print("|---|---|---|---|---|---|---|---|")
    for model, shapes in SHAPES.items():
        for n, k in shapes:
            copies = 64 if n * k * 2 * 64 > 64 << 20 else max(1, (96 << 20) // (n * k * 2))
            ws = [torch.randn(n, k).to(torch.bfloat16) for _ in range(copies)]
            ws32 = [w.float() for w in ws]
            scales = [w.float().abs().amax(1) / 127 for w in ws]
            qs = [(w.float() / s[:, None]).round().to(torch.int8) for w, s in zip(ws, scales)]
            for rows in (1, 4, 16):
                x = torch.randn(rows, k).to(torch.bfloat16)
                x32 = x.float()
                for label, pick in (("hot", lambda i: 0), ("cold", lambda i: i % copies)):
                    kern = median_us(lambda i: cpu_ops.linear(x, ws[pick(i)]), repeats)
                    int8 = median_us(lambda i: cpu_ops.linear_int8(x, qs[pick(i)],
                                                                   scales[pick(i)]), repeats)
                    bf16 = median_us(lambda i: F.linear(x, ws[pick(i)]), repeats)
                    fp32 = median_us(lambda i: F.linear(x32, ws32[pick(i)]), repeats)
                    gbs, gbs8 = n * k * 2 / kern / 1e3, n * k / int8 / 1e3
                    print(f"| {model} | {n} x {k} | {rows} | {label} | {kern:.1f} ({gbs:.1f}) | "
                          f"{int8:.1f} ({gbs8:.1f}) | {bf16:.1f} | {fp32:.1f} |")


def bench_attention(repeats: int) -> None:
    print("\n| model | heads / KV heads / dim | queries | kernel us | torch path us |")
    print("|---|---|---|---|---|")
    page, context = 16, 1000
    for model, (heads, kv_heads, dim) in ATTENTION.items():
        pages = 2 * (context + 32) // page + 2
        k_cache = torch.randn(pages * page, kv_heads, dim).to(torch.bfloat16)
        v_cache = torch.randn(pages * page, kv_heads, dim).to(torch.bfloat16)
        table = [list(range(pages // 2))]
        for queries in (1, 16):
            q = torch.randn(queries, heads, dim).to(torch.bfloat16)
            k = torch.randn(queries, kv_heads, dim).to(torch.bfloat16)
            v = torch.randn(queries, kv_heads, dim).to(torch.bfloat16)
            scale = 1 / math.sqrt(dim)
            kernel = KernelAttention.build([k_cache], [v_cache], table, [context], [queries],
                                           page, scale)
            paged = PagedAttention.build([k_cache], [v_cache], table, [context], [queries],
                                         page, scale)
            a = median_us(lambda i: kernel.attend(0, q, k, v), repeats)
            b = median_us(lambda i: paged.attend(0, q, k, v), repeats)
            print(f"| {model} | {heads} / {kv_heads} / {dim} | {queries} | {a:.1f} | {b:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_ops.available():
        raise SystemExit(f"the CPU kernels do not run here: {cpu_ops.load()}")
    isa = cpu_ops.isa()
    print(f"kernels built for {isa.name if isa else '?'}, {args.threads} threads\n")
    with torch.inference_mode():
        bench_linear(args.repeats)
        bench_attention(args.repeats)


if __name__ == "__main__":
    main()
