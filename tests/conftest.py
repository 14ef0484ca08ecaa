"""Shared fixtures: tiny random Hugging Face checkpoints and DFlash drafters in temporary dirs;
Triton in interpreter mode on machines without CUDA."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import anyio
import pytest
import torch

# Without CUDA, Triton kernels run in Triton's CPU interpreter. Triton reads the switch when it is
# first imported (transformers and xgrammar import it too), so it is set before any test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Engines do not compile their decode step unless a test asks (compile=True): a compile takes
# ~35 s per model, and most tests build engines on fresh random models. Compiled programs go to
# one directory per test session (tests/test_compiled.py and the bf16 equality tests use it).
os.environ["AGENTFLASH_COMPILE"] = "0"

import skips  # noqa: E402  (after the switches above: it imports agentflash)
from agentflash.kernels import disk_cache  # noqa: E402


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI ($CI set), a skip that the machine's kind does not explain fails the test
    (tests/skips.py lists the reasons a test may skip, and which kinds explain each)."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("CI") and isinstance(report.longrepr, tuple):
        reason = report.longrepr[2].removeprefix("Skipped: ")
        if not skips.excused(reason):
            report.outcome = "failed"
            report.longrepr = (f"skipped under CI on a machine that should run it: {reason} "
                               "(tests/skips.py lists the skips a machine's kind explains)")


@pytest.fixture
def anyio_backend():
    """Async tests run on asyncio, unless they parametrize it (trio)."""
    return "asyncio"


@pytest.fixture(scope="module")
def rt():
    """A runtime on the embedded model and its drafter, one per test module."""
    from agentflash import Runtime

    runtime = Runtime.load()
    yield runtime
    runtime.close()


@contextmanager
def running(app: Any) -> Iterator[str]:
    """uvicorn serving `app` on a free 127.0.0.1 port in a thread; yields the base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


class EngineGate:
    """Holds a runtime's engine thread right after its first step that gave a request tokens
    and left it running (that step's updates delivered), until `release()`: whatever the
    machine's speed, the request is then in flight and stays so (no step runs), while submits
    and aborts queue up. How tests of cancellation and disconnects control time."""

    HANG_S = 300.0  # a guard against a test that would otherwise hang, never a speed limit

    def __init__(self, rt: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.held = threading.Event()
        self._release = threading.Event()
        self.running = 0  # requests running when the engine was held
        engine_step, runtime_step = rt.engine.step, rt._step
        gave_tokens = threading.Event()

        def step() -> Any:
            updates = engine_step()
            if any(u.new_token_ids and not u.finished for u in updates):
                gave_tokens.set()
            return updates

        def gated_step() -> None:
            runtime_step()  # engine.step (the one above), then its updates delivered
            if gave_tokens.is_set() and not self.held.is_set() and not self._release.is_set():
                self.running = rt.engine.stats()["running"]  # the engine's thread: no race
                self.held.set()
                self._release.wait(self.HANG_S)

        monkeypatch.setattr(rt.engine, "step", step)
        monkeypatch.setattr(rt, "_step", gated_step)

    def wait(self) -> None:
        """Until the engine is held with a request running (from a thread)."""
        assert self.held.wait(self.HANG_S), "no request ever ran"

    async def wait_async(self) -> None:
        await anyio.to_thread.run_sync(self.wait)

    def release(self) -> None:
        self._release.set()


def assert_clean(rt: Any, timeout: float = 10.0) -> None:
    """No request left running and no page pinned or referenced (aborts settle on the engine
    thread, so give them a moment)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = rt.stats()
        clean = (stats["pages_pinned"] == 0 and stats["pages_referenced"] == 0
                 and stats["running"] == 0 and stats["waiting"] == 0)
        if clean or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert clean, stats
    rt._call(rt.engine.kv.check_integrity)


@pytest.fixture(scope="session", autouse=True)
def compiled_cache(tmp_path_factory):
    """Compiled programs go to a cache directory of this session's (compiled afresh from the
    code under test); the CPU kernels' builds stay the user cache's, as for a user (built once
    per machine: subprocesses need not build them again)."""
    cache = tmp_path_factory.mktemp("agentflash-cache")
    kernels = disk_cache.root() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    (cache / "kernels").symlink_to(kernels, target_is_directory=True)
    os.environ["AGENTFLASH_CACHE_DIR"] = str(cache)
    yield

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


def make_hf_model(family: str = "qwen3", seed: int = 0, **overrides: Any):
    """A randomly initialised transformers model (float32, eval mode) of a tiny config."""
    import transformers

    kwargs = {**TINY, **overrides}
    if family == "qwen3":
        cfg = transformers.Qwen3Config(**kwargs)
        cls = transformers.Qwen3ForCausalLM
    elif family == "llama":
        cfg = transformers.LlamaConfig(**kwargs)
        cls = transformers.LlamaForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    # Random init leaves norms at 1 and makes logits nearly flat; perturb them so tests bite.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def save_hf_model(model, path: Path, **save_kwargs: Any) -> Path:
    model.save_pretrained(path, safe_serialization=True, **save_kwargs)
    return path


@pytest.fixture
def hf_checkpoint(tmp_path):
    """Factory: hf_checkpoint(family, **config_overrides) -> (directory, transformers model)."""

    def make(family: str = "qwen3", seed: int = 0, name: str = "model", **overrides: Any):
        model = make_hf_model(family, seed=seed, **overrides)
        return save_hf_model(model, tmp_path / name), model

    return make


def _target_fields(target_config: Any) -> dict[str, Any]:
    """Shape fields of a target given as an HF config dict, a transformers config or ModelConfig."""
    if hasattr(target_config, "rope"):  # our ModelConfig
        c = target_config
        names = ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps",
                 "max_position_embeddings")
        return {**{n: getattr(c, n) for n in names}, "rope_theta": c.rope.theta}
    cfg = dict(target_config.to_dict() if hasattr(target_config, "to_dict") else target_config)
    heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    return dict(
        hidden_size=cfg["hidden_size"],
        vocab_size=cfg["vocab_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        # a MoE target has no dense MLP width: its drafter takes the experts'
        intermediate_size=cfg.get("intermediate_size") or cfg["moe_intermediate_size"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
    )


def make_dflash_checkpoint(
    path: Path,
    target_config: Any,
    num_layers: int = 2,
    block_size: int = 4,
    mask_token_id: int | None = None,
    target_layer_ids: list[int] | None = None,
    seed: int = 0,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    v2: dict[str, int] | None = None,
    **overrides: Any,
) -> Path:
    """Write a random DFlash drafter for `target_config` in the published format.

    v2: a DFlash2 drafter instead (architectures ["DFlash2DraftModel"], is_causal false), with
    these dflash_config fields (conv_kernel_size, conv_group_size, selector_rank,
    selector_top_k) and its convolution and selector tensors.
    config.json is what z-lab publishes (architectures ["DFlashDraftModel"], model_type qwen3,
    block_size, num_target_layers, dflash_config {mask_token_id, target_layer_ids}); the drafter
    copies the target's layer shapes. Defaults: mask_token_id = vocab - 1, target_layer_ids =
    every target layer. `overrides` replace top-level config fields (the weights follow them);
    `dflash_config={...}` is merged into dflash_config. Weights are float32, norms perturbed.
    """
    from safetensors.torch import save_file

    t = _target_fields(target_config)
    vocab, depth = t["vocab_size"], t["num_hidden_layers"]
    dflash = {
        "mask_token_id": vocab - 1 if mask_token_id is None else mask_token_id,
        "target_layer_ids": list(range(depth)) if target_layer_ids is None else target_layer_ids,
        **(v2 or {}),
        **overrides.pop("dflash_config", {}),
    }
    if v2 is not None:
        overrides = {"architectures": ["DFlash2DraftModel"], "is_causal": False, **overrides}
    cfg: dict[str, Any] = {
        **{k: v for k, v in t.items() if k != "num_hidden_layers"},
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": block_size,
        "dflash_config": dflash,
        "dtype": "float32",
        "hidden_act": "silu",
        "layer_types": layer_types or ["full_attention"] * num_layers,
        "max_window_layers": num_layers,
        "num_hidden_layers": num_layers,
        "num_target_layers": depth,
        "rope_scaling": None,
        "sliding_window": sliding_window,
        "tie_word_embeddings": False,
        "use_sliding_window": sliding_window is not None,
        **overrides,
    }
    hidden, head_dim, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    q_rows = cfg["num_attention_heads"] * head_dim
    kv_rows = cfg["num_key_value_heads"] * head_dim
    k = len(dflash["target_layer_ids"])
    g = torch.Generator().manual_seed(seed)

    def linear(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) / cols**0.5

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    tensors = {"fc.weight": linear(hidden, k * hidden), "hidden_norm.weight": norm(hidden),
               "norm.weight": norm(hidden)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        attn = {"q_proj": (q_rows, hidden), "k_proj": (kv_rows, hidden),
                "v_proj": (kv_rows, hidden), "o_proj": (hidden, q_rows)}
        for name, (rows, cols) in attn.items():
            tensors[f"{p}self_attn.{name}.weight"] = linear(rows, cols)
            if cfg["attention_bias"]:
                tensors[f"{p}self_attn.{name}.bias"] = 0.1 * torch.randn(rows, generator=g)
        tensors[f"{p}self_attn.q_norm.weight"] = norm(head_dim)
        tensors[f"{p}self_attn.k_norm.weight"] = norm(head_dim)
        tensors[f"{p}input_layernorm.weight"] = norm(hidden)
        tensors[f"{p}post_attention_layernorm.weight"] = norm(hidden)
        tensors[f"{p}mlp.gate_proj.weight"] = linear(inter, hidden)
        tensors[f"{p}mlp.up_proj.weight"] = linear(inter, hidden)
        tensors[f"{p}mlp.down_proj.weight"] = linear(hidden, inter)
        if v2 is not None:
            width, groups = v2["conv_kernel_size"], hidden // v2["conv_group_size"]
            for conv in ("attention_conv", "mlp_conv"):
                base = 0.3 * torch.randn(2, width, hidden, generator=g)
                base[:, 0] += 1.0  # near the identity: activations stay in range
                tensors[f"{p}{conv}.base_kernel"] = base
                tensors[f"{p}{conv}.kernel_projection.weight"] = \
                    0.5 * linear(2 * width * groups, hidden)
    if v2 is not None:
        rank = v2["selector_rank"]
        tensors["candidate_selector.hidden_projection.weight"] = linear(rank, hidden)
        for book in ("predecessor_codebook", "successor_codebook"):
            tensors[f"candidate_selector.{book}"] = torch.randn(vocab, rank, generator=g)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture
def dflash_checkpoint(tmp_path):
    """Factory: dflash_checkpoint(target_config, name="drafter", **kwargs) -> drafter directory
    (see make_dflash_checkpoint for the keyword arguments)."""

    def make(target_config: Any, name: str = "drafter", **kwargs: Any) -> Path:
        return make_dflash_checkpoint(tmp_path / name, target_config, **kwargs)

    return make


def random_linear_case(out_features: int, in_features: int, bias: bool, rows: int = 33):
    """A bfloat16 weight [out, in], a bias (or None) and inputs [rows, in], seeded by shape."""
    g = torch.Generator().manual_seed(out_features * 7919 + in_features)
    w = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16)
    b = torch.randn(out_features, generator=g).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
    return w, b, x


def assert_rows_independent(layer, x: torch.Tensor) -> None:
    """layer(x[:m]) equals its rows computed one by one, for every m: the property that keeps a
    verify block's rows bitwise a plain decode step's."""
    rows = [layer(x[i:i + 1]) for i in range(x.shape[0])]
    for m in range(2, x.shape[0] + 1):
        assert torch.equal(layer(x[:m]), torch.cat(rows[:m])), f"{m} rows"
