#!/usr/bin/env bash
# The GPU check in one command (under 8 minutes on an H100/H200; a few on a warm machine):
#   1. install agentflash into the current Python, which must hold a CUDA build of torch and
#      triton (with network: its dependencies from PyPI; offline: only the package itself, so
#      pydantic, jsonschema, anyio, xgrammar, transformers must be there already);
#   2. every Triton kernel compiled ahead of time for sm_80, sm_90, sm_100 and this GPU
#      (python -m agentflash.kernels.aot: registers, spills, shared memory against the limits);
#   3. the GPU tests: every Triton kernel against its torch reference, the engine's greedy tokens
#      with Triton vs the reference path, CUDA vs CPU, CUDA graphs vs eager; with LINEAR_CUDA=1
#      the `linear-cuda` extra (FLA, causal-conv1d: a source build of several minutes) is
#      installed first and its Gated DeltaNet kernels are checked too (else that test skips);
#   4. tools/bench_gpu.py: kernel micro-benchmarks (Triton vs torch reference vs SDPA) and
#      end-to-end decode with and without DFlash on a random Qwen3-8B-shaped model at batch 1
#      and 8, eager and from CUDA graphs, with the break-even acceptance length of each.
#
#   bash tools/bench_gpu.sh [--dry-run] [OUT_DIR]   # logs and bench_gpu.json in OUT_DIR
#   (the Python: $PYTHON, else python3)
#
# --dry-run (no GPU): the same steps on CPU as far as they go: the AOT compile for the three
# architectures, the CPU tests of the compile, the graph bookkeeping and this benchmark, and the
# benchmark's end-to-end part at a tiny shape with the graphs replayed eagerly.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
FAILED=""   # each step runs whatever the one before gave; the exit status says what failed
step() { local name=$1; shift; "$@" 2>&1 | tee "$OUT/$name.log" || FAILED="$FAILED $name"; }
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUT=${1:-bench-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
if [ "$DRY" = 1 ]; then
  echo "dry run: no GPU; $("$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')"
  step aot env TRITON_INTERPRET=0 "$PY" -m agentflash.kernels.aot --arch 80,90,100
  step tests "$PY" -m pytest -q -p no:cacheprovider tests/test_aot.py tests/test_graphs.py \
    tests/test_bench_gpu.py
  step bench "$PY" tools/bench_gpu.py --dry-run --out "$OUT/bench_gpu.json"
else
  "$PY" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'; \
print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)"
  "$PY" -m pip install -q -e ".[test]" 2>/dev/null || "$PY" -m pip install -q --no-deps -e .
  if [ "${LINEAR_CUDA:-0}" = 1 ]; then "$PY" -m pip install -q -e ".[linear-cuda]"; fi
  ARCH=$("$PY" -c "import torch; m, n = torch.cuda.get_device_capability(); print(10 * m + n)")
  step aot "$PY" -m agentflash.kernels.aot \
    --arch "$(echo "80,90,100,$ARCH" | tr , '\n' | sort -un | paste -sd,)"
  step tests "$PY" -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py \
    tests/test_cuda.py tests/test_graphs.py
  step bench "$PY" tools/bench_gpu.py --out "$OUT/bench_gpu.json"
fi
if [ -n "$FAILED" ]; then echo "failed:$FAILED (logs in $OUT)"; exit 1; fi
echo "all steps passed (logs in $OUT)"
