"""The on-disk cache survives its builders' deaths (kernels.disk_cache): `agentflash generate`
killed with SIGKILL while it builds the CPU kernels, and again while it compiles its decode
step, leaves a cache the next run completes with, giving the same output; a lock held by a
dead process is taken over at once, and a waiter says what it waits for."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agentflash.cli import main
from agentflash.kernels import disk_cache
from skips import CPU_KERNELS

GENERATE = ["generate", "--prompt", "The weather in Paris is", "--max-new-tokens", "12",
            "--no-draft", "--json"]


def _start(cache: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "AGENTFLASH_CACHE_DIR": str(cache), "AGENTFLASH_COMPILE": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}  # Inductor's own, fresh too
    return subprocess.Popen([sys.executable, "-m", "agentflash", *GENERATE, *extra], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own group: the compilers it starts too


def _finish(proc: subprocess.Popen) -> tuple[dict, str]:
    """The run's JSON output and its stderr, once it completed."""
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out), err


def _kill_once(proc: subprocess.Popen, started: str, midway) -> None:
    """SIGKILL the run (and the compilers it started) once its stderr printed `started` and
    `midway()` holds; it must still be running then."""
    for line in proc.stderr:
        if started in line:
            break
    else:
        pytest.fail(f"the run ended before it printed {started!r}: {proc.wait()}")
    # keep reading its stderr, so that it never blocks on a full pipe
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    while not midway() and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed midway"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stdout.close()


@CPU_KERNELS.mark
def test_killed_kernel_build_and_compile_leave_a_cache_the_next_run_completes(
        tmp_path, capsys):
    assert main([*GENERATE, "--no-compile"]) == 0  # the kernels this process loaded, eager
    expected = json.loads(capsys.readouterr().out)["output_ids"]
    cache = tmp_path / "cache"
    builds = cache / "kernels"

    def objects_built() -> bool:  # the build is under way: some of its objects exist
        return any(builds.glob("*/*.o"))

    _kill_once(_start(cache, "--no-compile"), "building agentflash's CPU kernels",
               objects_built)
    [leftover] = [p for p in builds.iterdir() if p.is_dir()]
    assert (leftover / "lock").exists() and not (leftover / "complete").exists()
    out, err = _finish(_start(cache, "--no-compile"))
    assert "building agentflash's CPU kernels" in err
    assert out["output_ids"] == expected

    compiled = cache / "compiled"

    def generating_code() -> bool:  # Inductor is under way: it wrote some of its C++
        return any((cache / "inductor").rglob("*.cpp"))

    _kill_once(_start(cache), "compiling the step", generating_code)
    assert all(".partial." in p.name for p in compiled.glob("*.pt2"))
    out, err = _finish(_start(cache))
    assert "compiling the step" in err and "building agentflash's" not in err
    assert "aoti-compiled-step" in out["fast_path"]
    again, err = _finish(_start(cache))
    assert "compiling" not in err and "building agentflash's" not in err  # loaded, both
    assert again["output_ids"] == out["output_ids"]
    assert not list(compiled.glob("*.partial.pt2"))


def test_a_dead_holders_lock_is_taken_at_once_and_a_waiter_says_what_it_waits_for(
        tmp_path, caplog):
    lock = tmp_path / "entry.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from agentflash.kernels import disk_cache\n"
         f"with disk_cache.locked(__import__('pathlib').Path({str(lock)!r}), 'x'):\n"
         "    print('held', flush=True); time.sleep(3600)"],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    waited = threading.Event()

    def wait_for_it() -> None:
        with disk_cache.locked(lock, "building a test entry"):
            waited.set()

    notice = f"waiting for another process that is building a test entry (lock {lock})"
    with caplog.at_level(logging.WARNING, logger=disk_cache.__name__):
        waiter = threading.Thread(target=wait_for_it)
        waiter.start()
        while notice not in caplog.text:
            assert waiter.is_alive()
            waited.wait(0.05)
        assert not waited.is_set()  # the holder lives: the waiter still waits
        holder.kill()  # SIGKILL: the lock goes with the process
        holder.wait()
        waiter.join(60)
    assert waited.is_set()
    with disk_cache.locked(lock, "x"):  # and free again afterwards
        pass


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("AGENTFLASH_CACHE_DIR", str(tmp_path))
    assert disk_cache.root() == tmp_path
    monkeypatch.delenv("AGENTFLASH_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert disk_cache.root() == tmp_path / "xdg" / "agentflash"
