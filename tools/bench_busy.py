"""A decode forward on a busy machine: the CPU kernels' work split by OpenMP (any thread)
against the engine thread's pool (kernels.cpu_ops.set_engine_thread, what the runtime's engine
thread runs), alone and beside another process busy part of the time.

    python tools/bench_busy.py [--batch 6] [--context 1000] [--rows 4] [--calls 300]
                               [--duties 0,0.2,0.5,1]

The forward is agentflash-11m's compiled decode/verify program (with its drafter's context
store) over `batch` sequences of `context` tokens, `rows` new tokens each. The other process
spins for `duty` (each of --duties; 0: none) of every 10 ms and sleeps the rest; a server's
event loop and a client on the same cores are such a process. Prints the mean milliseconds a
forward, each setting measured right after the other on the same machine.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time

import torch

from agentflash.embedded import embedded_model_dir, model_drafter_dir
from agentflash.engine.cpu.fastpath import prepare
from agentflash.engine.models.dflash import load_drafter
from agentflash.engine.models.loader import load_model
from agentflash.kernels import cpu_ops

PAGE = 16
BUSY = """import time
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < {duty} * 0.01:
        pass
    time.sleep((1 - {duty}) * 0.01)
"""


def forward(batch: int, context: int, rows: int):
    """The compiled decode forward and a call of it on random caches."""
    torch.manual_seed(0)
    model = load_model(embedded_model_dir(), dtype=torch.bfloat16)
    drafter = load_drafter(model_drafter_dir(embedded_model_dir()), model)
    prepared = prepare(model, drafter, compile=True, page_size=PAGE)
    decode = prepared.decode
    if decode is None or decode.kind != "compiled":
        sys.exit(f"no compiled decode forward here (applied: {prepared.applied})")
    cfg, dcfg = model.config, drafter.config
    pages = -(-(context + rows) // PAGE)
    shape = (batch * pages * PAGE, cfg.num_key_value_heads, cfg.head_dim)
    k = [torch.randn(shape).bfloat16() for _ in model.layers]
    v = [torch.randn(shape).bfloat16() for _ in model.layers]
    dshape = (batch * pages * PAGE, dcfg.num_key_value_heads, dcfg.head_dim)
    dk = [torch.randn(dshape).bfloat16() for _ in drafter.layers]
    dv = [torch.randn(dshape).bfloat16() for _ in drafter.layers]
    tables = [list(range(b * pages, (b + 1) * pages)) for b in range(batch)]
    attn = decode.attention(k, v, tables, [context + rows] * batch, [rows] * batch, PAGE,
                            model.attention_scale)
    ids = torch.randint(0, cfg.vocab_size, (batch * rows,))
    pos = torch.cat([torch.arange(context, context + rows)] * batch)
    args = decode.args(ids, pos, attn)
    return lambda: decode(args, k, v, dk, dv)


def mean_ms(call, calls: int, engine_thread: bool) -> float:
    """Mean ms of `calls` forwards on a new thread (an engine thread or a plain one)."""
    out: list[float] = []

    def run() -> None:
        if engine_thread:
            cpu_ops.set_engine_thread(torch.get_num_threads())
        with torch.inference_mode():
            for _ in range(10):
                call()
            t0 = time.perf_counter()
            for _ in range(calls):
                call()
            out.append((time.perf_counter() - t0) / calls * 1e3)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=6)
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--duties", default="0,0.2,0.5,1")
    a = ap.parse_args()
    if not cpu_ops.available():
        sys.exit(f"the CPU kernels do not run here: {cpu_ops.load()}")
    # set up on a thread that then exits, as the runtime loads: a thread that keeps a team of
    # OpenMP workers makes libgomp's workers sleep between parallel regions in every team
    made: list = []
    setup = threading.Thread(target=lambda: made.append(forward(a.batch, a.context, a.rows)))
    setup.start()
    setup.join()
    call = made[0]
    isa = cpu_ops.isa()
    print(f"{isa.name if isa else '?'} kernels, {torch.get_num_threads()} threads; decode "
          f"forward of {a.batch} x {a.rows} rows after {a.context} tokens, mean ms a call")
    print("| other process busy | OpenMP split | engine thread |")
    print("|---|---|---|")
    for duty in (float(d) for d in a.duties.split(",")):
        busy = (subprocess.Popen([sys.executable, "-c", BUSY.format(duty=duty)])
                if duty > 0 else None)
        try:
            time.sleep(0.3)
            omp = mean_ms(call, a.calls, False)
            pool = mean_ms(call, a.calls, True)
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
        print(f"| {duty:.0%} | {omp:.2f} | {pool:.2f} |")


if __name__ == "__main__":
    main()
