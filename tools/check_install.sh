#!/usr/bin/env bash
# Plain-install check, as a user installs agentflash: build the wheel, install it (not editable,
# no extras) into fresh virtual environments that have only the CPU torch, once with the newest
# dependencies (what `pip install agentflash` gets today) and once with every dependency at the
# lowest version pyproject.toml allows (so the declared lower bounds are what ran); in each,
# outside the checkout, run `agentflash generate` and one agent step with a forced tool call.
#   bash tools/check_install.sh            # .ci/run calls it
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$PY" -m pip wheel -q --no-deps -w "$work/dist" . >/dev/null
# name==lower bound of every dependency that has one
"$PY" - >"$work/lowest.txt" <<'EOF'
import re, tomllib
for req in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    m = re.match(r"([A-Za-z0-9_.\-]+)\s*>=\s*([^,;\s]+)", req)
    if m:
        print(f"{m.group(1)}=={m.group(2)}")
EOF

AGENT_STEP='
import anyio
from agentflash import Agent, Runtime, tool

@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b

async def main() -> None:
    async with Runtime.load() as rt:
        async with Agent(rt, "Be brief.", tools=[add], tool_choice="add") as agent:
            step = await agent.step("What is 2 + 3?")
            assert step.tool_calls and step.tool_calls[0].name == "add", step
            print("agent step:", [(c.name, c.arguments) for c in step.tool_calls],
                  "->", [r.content for r in step.tool_results])

anyio.run(main)
'

check() {  # check NAME [pip install options...]
  local name=$1 env="$work/$1"
  shift
  "$PY" -m venv "$env"
  "$env/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  "$env/bin/python" -m pip install -q "${AGENTFLASH_TORCH:-torch==2.13.0}"
  "$env/bin/python" -m pip install -q "$@" "$work"/dist/agentflash-*.whl
  "$env/bin/python" -m pip check
  echo "plain install ($name):" $("$env/bin/python" -m pip list --format=freeze 2>/dev/null \
    | grep -E -i '^(torch|transformers|tokenizers|safetensors|pydantic|anyio|jsonschema|xgrammar)==')
  # away from the checkout, so that everything imports the installed wheel
  (cd "$work" && "$env/bin/agentflash" generate --prompt "Hello" --max-new-tokens 8 --json \
    && "$env/bin/python" -c "$AGENT_STEP")
  echo "plain install ($name): ok"
}

check latest
check lowest -c "$work/lowest.txt"
