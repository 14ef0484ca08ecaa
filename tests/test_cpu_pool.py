"""The CPU kernels on an engine thread (kernels.cpu_ops.set_engine_thread, common/parallel.cpp):
chunks claimed by the thread and the kernels' own workers give the numbers OpenMP's split
gives, bit for bit, from one thread or several at once and in a forked child; the thread's own
torch ops run on it alone until it is undone. Whether a busy machine slows a forward less is
measured by tools/bench_busy.py, not asserted here."""

from __future__ import annotations

import math
import os
import threading
import time

import pytest
import torch

from agentflash.kernels import cpu_ops
from skips import CPU_KERNELS

pytestmark = CPU_KERNELS.mark


def _bf16(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _calls():
    """Kernel calls of every split: linears of few rows (and, on AMX, many), int8 linears, and
    attention over sequences of unequal lengths. Returns [(name, thunk)]."""
    calls = []
    for n, k in ((384, 384), (4096, 384), (1024, 3072), (203, 200)):
        w, b = _bf16(n, k, seed=0), _bf16(n, seed=1)
        for rows in (1, 7, 24, 300):
            x = _bf16(rows, k, seed=rows)
            calls.append((f"linear {rows}x{k}->{n}",
                          lambda x=x, w=w, b=b: cpu_ops.linear(x, w, b)))
    g = torch.Generator().manual_seed(3)
    q8 = torch.randint(-127, 128, (1024, 384), generator=g, dtype=torch.int8)
    scale = torch.rand(1024, generator=g) * 0.02 + 0.001
    x = _bf16(12, 384, seed=4)
    calls.append(("int8 linear", lambda: torch.ops.agentflash.linear_int8(x, q8, scale, None,
                                                                          None)))
    calls.append(("int8 dynamic linear", lambda: torch.ops.agentflash.linear_int8_dynamic(
        x, q8, scale, None, None)))
    k_cache, v_cache = _bf16(8192, 2, 64, seed=5), _bf16(8192, 2, 64, seed=6)
    table = torch.randperm(512, generator=torch.Generator().manual_seed(7)).view(8, 64)
    lengths = [3, 90, 1000, 1017, 500, 64, 128, 777]  # unequal runs: chunks of unequal work
    seq = torch.tensor([s for s, n in enumerate(lengths) for _ in range(4)])
    keys = torch.tensor([n - 3 + j for n in lengths for j in range(4)]).clamp(min=1)
    q = _bf16(len(seq), 6, 64, seed=8)
    calls.append(("attention", lambda: cpu_ops.paged_attention(
        q, k_cache, v_cache, table, 16, seq, keys, 1 / math.sqrt(64))))
    return calls


def _on_thread(fn):
    """fn() on a new thread; its result (or its exception, raised here)."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def _engine_run(threads, calls, repeat=1):
    def run():
        cpu_ops.set_engine_thread(threads)
        try:
            return [[thunk() for _, thunk in calls] for _ in range(repeat)]
        finally:
            cpu_ops.set_engine_thread(0)
    return run


@pytest.mark.parametrize("threads", [2, 3])
def test_an_engine_threads_kernels_give_openmps_numbers(threads):
    """Three threads on two cores too: a worker the OS runs late finds the chunks taken."""
    calls = _calls()
    want = [thunk() for _, thunk in calls]  # OpenMP's split, on this thread
    for got in _on_thread(_engine_run(threads, calls, repeat=3)):
        for (name, _), a, b in zip(calls, want, got):
            assert torch.equal(a, b), name


def test_engine_threads_at_once_each_get_their_own_numbers():
    """Two engine threads calling together: one runs on the pool, the other computes its
    chunks itself while the pool is busy; neither waits for the other or mixes up results."""
    calls = _calls()
    want = [thunk() for _, thunk in calls]
    results: list = [None, None]
    errors: list = []

    def run(slot):
        try:
            results[slot] = _engine_run(2, calls, repeat=5)()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for got in results:
        for repeat in got:
            for (name, _), a, b in zip(calls, want, repeat):
                assert torch.equal(a, b), name


def test_an_engine_threads_torch_ops_run_on_it_alone_until_undone():
    main = torch.get_num_threads()

    def run():
        before = torch.get_num_threads()
        cpu_ops.set_engine_thread(2)
        during = torch.get_num_threads()
        cpu_ops.set_engine_thread(0)
        return before, during, torch.get_num_threads()

    before, during, after = _on_thread(run)
    assert during == 1 and after == before == main
    assert torch.get_num_threads() == main  # other threads keep theirs


def _thread_names() -> list[str]:
    return [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_starts_a_pool_of_its_own():
    """After the pool has run here, a forked child (whose copy names workers it does not have)
    computes on an engine thread of its own, the same numbers, with workers of its own."""
    calls = _calls()
    calls = calls[:3] + calls[-1:]  # bf16 linears and the attention
    want = [thunk() for _, thunk in calls]
    _on_thread(_engine_run(2, calls))  # the pool's workers exist in this process now
    pid = os.fork()
    if pid == 0:  # the child: exit 0 where its numbers are right
        ok = False
        try:
            got = _on_thread(_engine_run(2, calls, repeat=2))
            ok = all(torch.equal(a, b) for repeat in got for a, b in zip(want, repeat))
            ok = ok and "agentflash-cpu" in _thread_names()
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung on the kernels' pool")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0
