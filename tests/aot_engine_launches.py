"""Run by tests/test_aot.py in a process of its own (the jitted kernels, not Triton's
interpreter): a tiny engine on CPU generates with every Triton wrapper called as on CUDA, its
launches recorded (the torch ops give the results), and prints the code keys of the launches
next to those `agentflash.kernels.aot` compiles for the same geometry, as JSON."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # before conftest, which turns it on without CUDA


from agentflash.engine.config import CacheConfig, SpecConfig  # noqa: E402
from agentflash.engine.engine import Engine  # noqa: E402
from agentflash.engine.models.dflash import load_drafter  # noqa: E402
from agentflash.engine.models.loader import load_model  # noqa: E402
from agentflash.engine.sampler import SamplingParams  # noqa: E402
from agentflash.kernels import aot, dispatch  # noqa: E402
from conftest import make_dflash_checkpoint, make_hf_model  # noqa: E402

BLOCK, TOP_K = 4, 3


def on_cuda(key: tuple) -> tuple:
    """The key the launch has on CUDA: CPU tensors take the float32 dots Triton's interpreter
    needs (triton_attention._precision); on CUDA 16-bit inputs take tf32 dots."""
    name, parts = key
    sixteen = any(kind in ("*bf16", "*fp16") for arg, kind in parts if arg == "q_ptr")
    return name, tuple(("PRECISION", "tf32" if sixteen else "ieee") if arg == "PRECISION"
                       else (arg, value) for arg, value in parts)


def main(tmp: Path) -> None:
    table = aot.jitted(aot._modules())
    seen: set = set()
    dispatch._triton()
    for name, torch_fn in dispatch._BACKENDS["torch"].items():
        wrapper = dispatch._BACKENDS["triton"].get(name)

        def both(*args, _w=wrapper, _t=torch_fn):
            if _w is not None:
                _w(*args)  # launches are recorded, not run
            return _t(*args)
        dispatch.register("record", name, both)
    dispatch.use("record")

    hf = make_hf_model("qwen3", head_dim=128, vocab_size=64, bos_token_id=None,
                       eos_token_id=None)
    hf.save_pretrained(tmp / "target")
    make_dflash_checkpoint(tmp / "dflash", hf.config, block_size=BLOCK,
                           layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    make_dflash_checkpoint(tmp / "dflash2", hf.config, block_size=BLOCK,
                           layer_types=["sliding_attention"] * 2, sliding_window=3,
                           v2={"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8,
                               "selector_top_k": TOP_K})
    prompts = [[1, 2, 3], list(range(5, 40)), [7] * 9]
    params = [SamplingParams(max_new_tokens=6),
              SamplingParams(temperature=0.8, seed=1, max_new_tokens=6)]
    record = lambda launch: seen.add(on_cuda(aot.code_key(launch)))  # noqa: E731
    with aot.recording(list(table.values()), record):
        for dtype in aot.DTYPES:
            model = load_model(tmp / "target", dtype=dtype, device="cpu")
            for draft in (None, "dflash", "dflash2"):
                drafter = None if draft is None else load_drafter(tmp / draft, model)
                engine = Engine(model, CacheConfig(16, 64), drafter=drafter,
                                spec=SpecConfig(BLOCK), speculation="always", fast_path=False)
                for p in params:
                    engine.generate(prompts, p)
    shape = aot.Shape("tiny", heads=4, kv_heads=2, head_dim=128, vocab=64, block_size=BLOCK,
                      top_k=TOP_K)
    compiled = {aot.code_key(launch) for launch in aot.launches((shape,))}
    print(json.dumps({"engine": sorted(map(repr, seen)), "aot": sorted(map(repr, compiled))}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
