"""The Triton kernels compiled ahead of time for real GPUs on this GPU-less machine
(agentflash.kernels.aot): every `@triton.jit` function under kernels/ compiles to cubin for
sm_80, sm_90 and sm_100 within each architecture's register, spill and shared-memory limits, and
the specializations compiled are the ones the engine launches."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed")

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests"),
                                                      env.get("PYTHONPATH")]))
    return env


def test_every_triton_kernel_compiles_for_sm80_sm90_sm100_within_limits() -> None:
    names = set()
    for path in (ROOT / "kernels").glob("*.py"):
        names |= set(re.findall(r"@triton\.jit\s*\ndef (\w+)", path.read_text()))
    assert len(names) >= 8
    run = subprocess.run([sys.executable, "-m", "agentflash.kernels.aot", "--arch", "80,90,100",
                          "--json"], capture_output=True, text=True, env=_env(), timeout=900)
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    failed = [line for line in lines if not line["ok"]]
    assert run.returncode == 0 and not failed, (failed, run.stderr[-2000:])
    for arch in (80, 90, 100):
        compiled = {line["kernel"] for line in lines if line["arch"] == arch}
        assert compiled == names, (arch, names ^ compiled)
    kernels = [line for line in lines if line["case"] != "helper"]
    assert all(0 < line["registers"] <= 255 and line["spill_bytes"] == 0 for line in kernels)
    # the engine's cases are there: decode (q=1), verify/prefill, every drafter layer kind,
    # both verification rules with and without a draft distribution, both dtypes
    cases = " | ".join(line["case"] for line in kernels)
    for case in ("decode q=1 bfloat16", "verify q=16 bfloat16", "draft sliding B=16 float32",
                 "draft windowed", "accept greedy", "accept sample q K=8", "context kv"):
        assert case in cases, case


def test_the_kernels_compiled_are_the_ones_the_engine_launches(tmp_path) -> None:
    """A tiny engine (head_dim 128, bfloat16 and float32, no drafter, a DFlash drafter with
    sliding and full layers, a DFlash2 one; greedy and sampled) calls every Triton wrapper as on
    CUDA; the set of (kernel, pointer dtypes, constexprs) it launches equals the set aot compiles
    for its geometry."""
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "aot_engine_launches.py"),
                          str(tmp_path)], capture_output=True, text=True, env=_env(),
                         timeout=600, cwd=ROOT / "tests")
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.splitlines()[-1])
    engine, compiled = set(found["engine"]), set(found["aot"])
    assert len(engine) >= 12
    assert engine == compiled, {"launched, not compiled": engine - compiled,
                                "compiled, never launched": compiled - engine}
