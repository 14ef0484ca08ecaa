"""Kernel dispatch: Triton on CUDA where a kernel exists, the torch ops (kernels.torch_ops)
elsewhere.

`use("torch")` / `use("triton")` / `use("auto")` overrides the choice (tests force either).
The Triton kernels register on first need, when `triton` is installed: importing triton is slow,
and its CPU interpreter (TRITON_INTERPRET=1) must be chosen before that import happens.
"""

from __future__ import annotations

import importlib.util
from typing import Callable

from . import torch_ops

_BACKENDS: dict[str, dict[str, Callable]] = {
    "torch": {
        "paged_attention": torch_ops.paged_attention,
        "store_kv": torch_ops.store_kv,
        "draft_attention": torch_ops.draft_attention,
        "accept_greedy": torch_ops.accept_greedy,
        "accept_sample": torch_ops.accept_sample,
        "store_context_kv": torch_ops.store_context_kv,
    },
}
_choice = "auto"
_triton_checked = False


def register(backend: str, name: str, fn: Callable) -> None:
    """Add a kernel implementation under a backend name (Triton modules register themselves)."""
    _BACKENDS.setdefault(backend, {})[name] = fn


def _triton() -> dict[str, Callable]:
    """The Triton backend's kernels, registered on the first call (empty without triton)."""
    global _triton_checked
    if not _triton_checked:
        _triton_checked = True
        if importlib.util.find_spec("triton") is not None:
            from . import triton_accept, triton_attention, triton_context_kv

            register("triton", "paged_attention", triton_attention.paged_attention)
            register("triton", "draft_attention", triton_attention.draft_attention)
            register("triton", "accept_greedy", triton_accept.accept_greedy)
            register("triton", "accept_sample", triton_accept.accept_sample)
            register("triton", "store_context_kv", triton_context_kv.store_context_kv)
    return _BACKENDS.get("triton", {})


def use(backend: str) -> None:
    if backend == "triton":
        _triton()
    if backend != "auto" and backend not in _BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; known: {sorted(_BACKENDS)}")
    global _choice
    _choice = backend


def _pick(name: str, device_type: str) -> Callable:
    if _choice != "auto":
        return _BACKENDS[_choice].get(name) or _BACKENDS["torch"][name]
    if device_type == "cuda" and name in _triton():
        return _BACKENDS["triton"][name]
    return _BACKENDS["torch"][name]


def uses_torch(name: str, device_type: str) -> bool:
    """Whether `name` runs the torch ops on this device type (callers may then take a
    host-side shortcut with the same result)."""
    return _pick(name, device_type) is _BACKENDS["torch"][name]


def paged_attention(q, k_cache, v_cache, gather, q_index, out_index, mask, scale, plan=None):
    return _pick("paged_attention", q.device.type)(
        q, k_cache, v_cache, gather, q_index, out_index, mask, scale, plan
    )


def store_kv(k_cache, v_cache, slots, k, v):
    return _pick("store_kv", k.device.type)(k_cache, v_cache, slots, k, v)


def draft_attention(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, scale, causal, window):
    return _pick("draft_attention", q.device.type)(
        q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, scale, causal, window
    )


def accept_greedy(logits, row_start, num_drafts, drafts):
    return _pick("accept_greedy", logits.device.type)(logits, row_start, num_drafts, drafts)


def accept_sample(probs, row_start, num_drafts, drafts, uniforms, q_probs=None, q_ids=None):
    return _pick("accept_sample", probs.device.type)(
        probs, row_start, num_drafts, drafts, uniforms, q_probs, q_ids
    )


def store_context_kv(k, v, norm_weight, eps, cos_half, sin_half, positions, slots, k_cache,
                     v_cache):
    return _pick("store_context_kv", k.device.type)(
        k, v, norm_weight, eps, cos_half, sin_half, positions, slots, k_cache, v_cache
    )
