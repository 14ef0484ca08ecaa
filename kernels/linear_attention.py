"""CUDA kernels for a Gated DeltaNet prefill, where the `linear-cuda` extra is installed.

A prefill span of one sequence takes flash-linear-attention's `chunk_gated_delta_rule` for the
delta rule and causal-conv1d's `causal_conv1d_fn` for the depthwise causal convolution when its
tensors are on CUDA and the package imports; everywhere else (CPU, or a package missing) the torch
reference in engine.models.gated_deltanet runs. Decode steps and speculative verify blocks always
take the reference's one-token form: `replay` rebuilds a rejected block's state from that form's
exact arithmetic.

Both functions take and return the reference's layouts: tokens first, one sequence, its state
beside it. The delta rule's q arrives L2-normalised and scaled (scale=1 here), k normalised.
"""

from __future__ import annotations

import importlib.util
from functools import cache

import torch


@cache
def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def fla_available(device: torch.device) -> bool:
    """Whether `chunk_delta_rule` runs for tensors on `device`."""
    return device.type == "cuda" and _installed("fla")


def conv_available(device: torch.device) -> bool:
    """Whether `causal_conv` runs for tensors on `device`."""
    return device.type == "cuda" and _installed("causal_conv1d")


def chunk_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence's L tokens: q, k [L, H, Dk], v [L, H, Dv], g (log
    decay), beta [L, H], state [H, Dk, Dv] float32. Returns the output [L, H, Dv] and the state
    after the last token, as engine.models.gated_deltanet.delta_rule_chunked does."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    out, final = chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], scale=1.0,
        initial_state=state[None].contiguous(), output_final_state=True)
    return out[0], final[0].to(state.dtype)


def causal_conv(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d + SiLU of one sequence's x [L, C] after `window` [C, K - 1] (its
    previous inputs); weight [C, 1, K]. Returns the output [L, C] and the window after x."""
    from causal_conv1d import causal_conv1d_fn

    # causal-conv1d returns final states only for channel-last inputs: x and the initial
    # window as [1, C, L] views of [L, C]-contiguous memory
    channels_last = x.to(window.dtype).contiguous().t()[None]
    initial = window.t().contiguous().t()[None]
    out, final = causal_conv1d_fn(channels_last, weight[:, 0, :], None,
                                  initial_states=initial, return_final_states=True,
                                  activation="silu")
    return out[0].t(), final[0]
