#!/usr/bin/env bash
# The GPU check of the Triton path in one command (about 3 to 5 minutes on an H200):
#   1. install agentflash into the current Python, which must hold a CUDA build of torch and
#      triton (with network: its dependencies from PyPI; offline: only the package itself, so
#      pydantic, jsonschema, anyio, xgrammar, transformers must be there already);
#   2. the GPU tests: every Triton kernel compiled for this GPU against its torch reference, the
#      engine's greedy tokens with Triton vs the reference path, CUDA vs CPU; with LINEAR_CUDA=1
#      the `linear-cuda` extra (FLA, causal-conv1d: a source build of several minutes) is
#      installed first and its Gated DeltaNet kernels are checked too (else that test skips);
#   3. tools/bench_gpu.py: kernel micro-benchmarks (Triton vs torch reference vs SDPA) and
#      end-to-end decode with and without DFlash on a random Qwen3-8B-shaped model.
#
#   bash tools/bench_gpu.sh [OUT_DIR]      # logs and bench_gpu.json in OUT_DIR (./bench-gpu)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${1:-bench-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
"$PY" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'; \
print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)"
"$PY" -m pip install -q -e ".[test]" 2>/dev/null || "$PY" -m pip install -q --no-deps -e .
if [ "${LINEAR_CUDA:-0}" = 1 ]; then "$PY" -m pip install -q -e ".[linear-cuda]"; fi
"$PY" -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_cuda.py \
  2>&1 | tee "$OUT/tests.log"
"$PY" tools/bench_gpu.py --out "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench.log"
