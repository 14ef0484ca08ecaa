"""Agent sessions of the server: a client's session id -> the pinned KV of its conversation.

A request with `{"session": {"id": ..., "ttl_s": ...}}` pins what its reply leaves in the prefix
cache (the whole conversation so far) and replaces the session's earlier pin, which covered a
prefix of it. The runtime releases a pin when its TTL runs out, or earlier, the longest idle
first, when a request needs the pages (agentflash.runtime); `release` is DELETE
/v1/sessions/{id}. Used on the event loop's thread only.
"""

from __future__ import annotations

from agentflash.engine.kv.manager import Pin
from agentflash.runtime import Runtime


class Sessions:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._pins: dict[str, Pin] = {}

    def hold(self, session_id: str, pin: Pin | None, ttl_s: float) -> None:
        """Pin `pin` for the session (for `ttl_s` seconds from now), releasing its old pin."""
        old = self._pins.pop(session_id, None)
        if pin is not None:
            self._pins[session_id] = pin
            self.runtime.keep(pin, ttl_s)
        if old is not None and old is not pin:
            self.runtime.unpin(old)

    def release(self, session_id: str) -> bool:
        """Unpin the session's KV; False when the session is unknown or already expired."""
        pin = self._pins.pop(session_id, None)
        if pin is None or not pin.active:
            return False
        self.runtime.unpin(pin)
        return True

    def clear(self) -> int:
        """Release every session's pin; returns how many were live."""
        return sum(self.release(session_id) for session_id in list(self._pins))

    def __len__(self) -> int:
        self._pins = {k: p for k, p in self._pins.items() if p.active}
        return len(self._pins)
