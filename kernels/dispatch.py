"""Kernel dispatch: Triton on CUDA where a kernel exists, the torch reference elsewhere.

`use("reference")` / `use("triton")` / `use("auto")` overrides the choice (tests force either).
"""

from __future__ import annotations

from typing import Callable

from . import reference

_BACKENDS: dict[str, dict[str, Callable]] = {
    "reference": {
        "paged_attention": reference.paged_attention,
        "store_kv": reference.store_kv,
        "draft_attention": reference.draft_attention,
    },
}
_choice = "auto"


def register(backend: str, name: str, fn: Callable) -> None:
    """Add a kernel implementation under a backend name (Triton modules register themselves)."""
    _BACKENDS.setdefault(backend, {})[name] = fn


def use(backend: str) -> None:
    if backend != "auto" and backend not in _BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; known: {sorted(_BACKENDS)}")
    global _choice
    _choice = backend


def _pick(name: str, device_type: str) -> Callable:
    if _choice != "auto":
        return _BACKENDS[_choice].get(name) or _BACKENDS["reference"][name]
    if device_type == "cuda" and name in _BACKENDS.get("triton", {}):
        return _BACKENDS["triton"][name]
    return _BACKENDS["reference"][name]


def paged_attention(q, k_cache, v_cache, gather, q_index, out_index, mask, scale):
    return _pick("paged_attention", q.device.type)(
        q, k_cache, v_cache, gather, q_index, out_index, mask, scale
    )


def store_kv(k_cache, v_cache, slots, k, v):
    return _pick("store_kv", k.device.type)(k_cache, v_cache, slots, k, v)


def draft_attention(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, scale, causal, window):
    return _pick("draft_attention", q.device.type)(
        q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, scale, causal, window
    )
