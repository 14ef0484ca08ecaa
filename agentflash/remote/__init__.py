"""The Agent API on a remote OpenAI-compatible server (vLLM, SGLang, `agentflash serve`).

`Runtime.connect(base_url)` returns a `RemoteRuntime` (runtime.py); an `Agent` runs on it as on
a local runtime. wire.py maps a chat request onto each server's API and its usage report back;
turn.py reads the streamed reply as the SDK's chat events; faults.py types the failures and
decides the retries. docs/remote.md says what is and is not available remotely.
"""

from .runtime import RemoteRuntime

__all__ = ["RemoteRuntime"]
