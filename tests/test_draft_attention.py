"""kernels.torch_ops.draft_attention (the DFlash drafter's attention) against its oracle, a
per-query loop (kernels.reference)."""

from __future__ import annotations

import pytest
import torch

from agentflash.kernels import dispatch, reference, torch_ops

# (causal, window): full layers, sliding layers, and the windowed non-causal form the reference
# code also defines.
KINDS = [(False, None), (True, None), (True, 1), (True, 3), (False, 2), (False, 4)]
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 3e-2}


def inputs(lens: list[int], block: int, dtype: torch.dtype, hq: int = 6, hkv: int = 2,
           d: int = 8, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    n, width = len(lens), max(max(lens), 1)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    k_ctx, v_ctx = rand(n, width, hkv, d), rand(n, width, hkv, d)
    for s, length in enumerate(lens):  # padding holds large values the mask must hide
        k_ctx[s, length:] = 50.0
        v_ctx[s, length:] = 1e4
    return rand(n, block, hq, d), k_ctx, v_ctx, torch.tensor(lens), rand(n, block, hkv, d), \
        rand(n, block, hkv, d)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block", [1, 2, 5])
def test_matches_the_oracle_on_odd_shapes(kind: tuple[bool, int | None], block: int) -> None:
    causal, window = kind
    args = inputs([0, 1, 7, 4], block, torch.float64)
    out = torch_ops.draft_attention(*args, 0.3, causal, window)
    assert out.shape == args[0].shape
    torch.testing.assert_close(out, reference.draft_attention(*args, 0.3, causal, window), atol=1e-10, rtol=0)


@pytest.mark.parametrize("dtype", TOLERANCE)
@pytest.mark.parametrize("kind", [(False, None), (True, 3)])
def test_dtypes_and_mha(dtype: torch.dtype, kind: tuple[bool, int | None]) -> None:
    args = inputs([5, 3], 4, dtype, hq=3, hkv=3, d=16, seed=1)
    out = torch_ops.draft_attention(*args, 0.25, *kind)
    assert out.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), reference.draft_attention(*args, 0.25, *kind), atol=tol, rtol=tol)


def test_all_context_padding_and_dispatch() -> None:
    args = inputs([0, 0], 3, torch.float32, seed=2)  # no valid context: the block sees itself
    out = dispatch.draft_attention(*args, 0.5, False, None)
    torch.testing.assert_close(out, torch_ops.draft_attention(*args, 0.5, False, None))
    torch.testing.assert_close(out.double(), reference.draft_attention(*args, 0.5, False, None), atol=1e-5, rtol=0)
