"""tools/bench_gpu.py's end-to-end part on CPU with a tiny shape, so the GPU benchmark cannot rot
between the sessions that have a GPU: random target and drafter, plain vs DFlash decode, each
eager and from graphs (replayed eagerly on CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from bench_gpu import QWEN3_8B, end_to_end  # noqa: E402

TINY = {**QWEN3_8B, "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 256}


def test_end_to_end_decode_reports_and_matches_on_cpu() -> None:
    results = end_to_end(TINY, 1, 6, "cpu", batches=(1, 2), prompt_len=9, dtype=torch.float32)
    assert [r["batch"] for r in results] == [1, 2]
    for r in results:
        assert r["identical_outputs"] == f"{r['batch']}/{r['batch']}"  # float32: exact
        assert r["graphs_identical_to_eager"] == "2/2"
        for run in ("plain", "dflash", "plain_graphs", "dflash_graphs"):
            assert r[run]["tokens_per_s"] > 0
        assert r["dflash"]["tau"] >= 1 and r["dflash_graphs"]["tau"] >= 1
        assert r["plain_graphs"]["graph_eager_steps"] == r["dflash_graphs"]["graph_eager_steps"] == 0
        assert r["break_even_tau"] > 0 and r["break_even_tau_graphs"] > 0
