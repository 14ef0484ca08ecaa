"""Small frozen configuration dataclasses shared by every engine layer.

`ModelConfig` is parsed from a Hugging Face `config.json` (Qwen3 and Llama families); it accepts
both the classic `rope_theta` + `rope_scaling` fields and the newer `rope_parameters` form.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .errors import CheckpointError, UnsupportedModelError

# config.json "architectures" entry -> our family name.
ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; `rope_type` selects how inverse frequencies are scaled."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_scaling type {self.rope_type!r} is not supported (supported: {ROPE_TYPES})"
            )
        if self.theta <= 0 or self.factor <= 0:
            raise CheckpointError("rope theta and factor must be positive")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> RopeConfig:
        params = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or {}
        merged = {**scaling, **params}
        theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
        keys = (
            "factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor",
            "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate",
        )
        kwargs = {k: merged[k] for k in keys if merged.get(k) is not None}
        # transformers defaults the pretraining length to max_position_embeddings for both types.
        if rope_type in ("llama3", "yarn") and "original_max_position_embeddings" not in kwargs:
            kwargs["original_max_position_embeddings"] = cfg.get("max_position_embeddings")
        return cls(theta=float(theta), rope_type=str(rope_type), **kwargs)


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only target model (Qwen3 = Llama + per-head q/k RMSNorm)."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    torch_dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.family not in ARCHITECTURES.values():
            raise UnsupportedModelError(f"unknown model family {self.family!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise CheckpointError(f"config field {name} must be positive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def qk_norm(self) -> bool:
        return self.family == "qwen3"

    @property
    def num_kv_layers(self) -> int:
        """Layers whose K/V the paged pool holds: all of them."""
        return self.num_hidden_layers

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if family is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {sorted(ARCHITECTURES)}"
            )
        _refuse_unimplemented(cfg)
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            return cls(
                family=family,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope=RopeConfig.from_hf(cfg),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
                eos_token_ids=_token_ids(cfg.get("eos_token_id")),
            )
        except KeyError as e:
            raise CheckpointError(f"config.json lacks required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"config.json has an invalid field: {e}") from None

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """The model of `path`/config.json. Generation ends at generation_config.json's
        eos_token_id where that file names one, else at config.json's, as in transformers'
        `generate` (Qwen3 chat models name <|im_end|> in config.json and add <|endoftext|> in
        generation_config.json)."""
        config = cls.from_hf(read_config_json(path))
        eos = generation_eos_ids(path)
        return config if eos is None else replace(config, eos_token_ids=eos)


def generation_eos_ids(path: str | Path) -> tuple[int, ...] | None:
    """The eos_token_id of `path`/generation_config.json, where that file names one (what
    transformers' `generate` stops at instead of config.json's); None otherwise."""
    gen_path = Path(path) / "generation_config.json"
    if not gen_path.is_file():
        return None
    gen = _read_json_object(gen_path)
    if gen.get("eos_token_id") is None:
        return None
    try:
        return _token_ids(gen["eos_token_id"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{gen_path} has an invalid eos_token_id: {e}") from None


def _token_ids(value: Any) -> tuple[int, ...]:
    """A config's token id field (an int, a list of ints or null) as a tuple."""
    if value is None:
        return ()
    return tuple(int(t) for t in value) if isinstance(value, list) else (int(value),)


def _refuse_unimplemented(cfg: dict[str, Any]) -> None:
    """Raise UnsupportedModelError for config features our model code does not implement."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only 'silu')")
    layer_types = set(cfg.get("layer_types") or ["full_attention"])
    if cfg.get("use_sliding_window") or layer_types != {"full_attention"}:
        raise UnsupportedModelError("sliding-window attention layers are not supported")
    rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor")) or 1.0
    if partial != 1.0:
        raise UnsupportedModelError(f"partial_rotary_factor {partial} is not supported (only 1.0)")


def read_config_json(path: str | Path) -> dict[str, Any]:
    """Read `config.json` from a model directory with typed errors for the common failures."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{path} is not a model directory: no config.json")
    return _read_json_object(cfg_path)


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return obj


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV pool geometry: `num_pages` pages of `page_size` token slots per layer; for a
    hybrid model, at most `state_snapshots` linear-attention states kept where prompts and
    replies ended and every `state_interval` tokens of a prefill (0: not inside prompts)."""

    page_size: int = 16
    num_pages: int = 1024
    state_snapshots: int = 64
    state_interval: int = 1024

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.num_pages < 1:
            raise ValueError("page_size and num_pages must be >= 1")
        if self.state_snapshots < 0 or self.state_interval < 0:
            raise ValueError("state_snapshots and state_interval must be >= 0")


@dataclass(frozen=True)
class SchedulerConfig:
    """How much work one engine step may do."""

    max_batch_tokens: int = 512   # tokens per forward (prefill chunks + decode tokens)
    max_running: int = 64         # sequences in flight at once
    prefill_first_steps: int = 8
    """While prompts wait to be prefilled, up to this many steps in a row run only their chunks
    and the decode rows wait (first tokens come sooner under a burst of requests; the running
    sequences' next tokens later); 0: decode rows go in every step."""

    def __post_init__(self) -> None:
        if self.max_batch_tokens < 1 or self.max_running < 1 or self.prefill_first_steps < 0:
            raise ValueError("max_batch_tokens and max_running must be >= 1, "
                             "prefill_first_steps >= 0")


@dataclass(frozen=True)
class StepCost:
    """Measured step times of `batch` requests decoding together, in units of their plain
    decode step (engine.calibration): `draft[k - 1]` is a drafter forward over their
    blocks for k - 1 drafts each (draft[0] = 0: no drafts; the drafter computes only the rows
    verified, so it costs less for fewer), `verify[k - 1]` a target forward over k tokens of
    each (verify[0] = 1). The unit: `plain_s` seconds, a plain step of the batch after a
    `context`-token prompt each."""

    draft: tuple[float, ...]
    verify: tuple[float, ...]
    plain_s: float = 0.0
    context: int = 0
    batch: int = 1

    def speculative(self, k: int) -> float:
        """A speculative step that verifies k tokens: the anchor and k - 1 drafts."""
        return self.draft[k - 1] + self.verify[k - 1]

    def fraction(self, longer: StepCost, context: int) -> float:
        """Where `context` lies between this cost's context (0) and `longer`'s (1), clamped."""
        span = longer.context - self.context
        return min(max((context - self.context) / span, 0.0), 1.0) if span > 0 else 0.0

    def at_context(self, longer: StepCost, context: int) -> StepCost:
        """These costs and `longer`'s (the same batch at a longer context) interpolated
        linearly to `context`, clamped to the two: attention grows with the context, so a
        verify row costs more of a plain step there."""
        t = self.fraction(longer, context)
        if t == 0.0 or t == 1.0:
            return self if t == 0.0 else longer
        # (list comprehensions: this runs every drafted step)
        return StepCost(tuple([a + t * (b - a) for a, b in zip(self.draft, longer.draft)]),
                        tuple([a + t * (b - a) for a, b in zip(self.verify, longer.verify)]),
                        self.plain_s + t * (longer.plain_s - self.plain_s), context, self.batch)


@dataclass(frozen=True)
class PrefillCost:
    """The time of a prefill forward as a function of its size (engine.calibration, in
    any one unit: only ratios are used): n prompt tokens computed after p already in the KV
    cost `fixed + per_token * n + per_pair * n * (p + (n - 1) / 2)`, the last term the
    attention of each new token over the keys before it."""

    fixed: float
    per_token: float
    per_pair: float

    @classmethod
    def fit(cls, n1: int, n2: int, p: int, t1: float, t2: float, t3: float) -> PrefillCost:
        """The shape through three measured forwards: n1 and n2 < n1 tokens after none
        cached (t1, t2), and n1 after p (t3); terms that noise makes negative are 0."""
        per_pair = max(0.0, (t3 - t1) / (n1 * p)) if p else 0.0
        a1 = t1 - per_pair * n1 * (n1 - 1) / 2
        a2 = t2 - per_pair * n2 * (n2 - 1) / 2
        per_token = max(0.0, (a1 - a2) / (n1 - n2))
        return cls(max(0.0, a2 - per_token * n2), per_token, per_pair)

    def units(self, n: int, p: int) -> float:
        """n tokens after p in one forward."""
        return self.fixed + self.per_token * n + self.per_pair * n * (p + (n - 1) / 2)

    def chunked(self, end: int, chunk: int) -> float:
        """Computing positions 0 .. end in forwards of `chunk` tokens."""
        return sum(self.units(min(chunk, end - p), p) for p in range(0, end, chunk))


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding settings. block_size None: the drafter checkpoint's own.

    cost: with step costs, the drafter proposes `draft_rows` drafts for a request at first, and
    each step verifies as many of them as commit the most tokens per unit of time given the
    drafter's own confidence in each (spec.confident_length); lossless either way. A step that
    verified every draft, all accepted, lets the next propose 2n + 1 (up to the block);
    one that verified fewer halves them again (down to `draft_rows`). A drafted step that
    commits fewer tokens than the plain steps it cost is followed by one plain step without the
    drafter, then, while drafted steps keep failing, by twice as many, up to `max_backoff`:
    free prose pays the drafter rarely, a tool call after it speculates again at once. None:
    every verify step checks the whole block.

    lookup (with step costs): a step may verify drafts read from the request's own context
    instead (engine.lookup: what followed the last tokens where they occurred before), where
    their expected yield, learned per match length, beats the step planned: a drafted step's
    recent yield, or a plain step while the drafter backs off. They cost no forward.

    `batch_costs`: the same measured with more requests decoding at once (a verify token costs
    more, relative to a plain step, once the forward is compute-bound); a request decides with
    the costs of the batch size nearest its step's. `long_cost`: the batch-1 costs at a longer
    context; a request decoding alone decides with the two interpolated to its context."""

    block_size: int | None = None
    cost: StepCost | None = None
    batch_costs: tuple[StepCost, ...] = ()
    long_cost: StepCost | None = None
    draft_rows: int = 5
    max_backoff: int = 16
    lookup: bool = True
    MIN_BLOCK = 2
    MAX_BLOCK = 16

    def __post_init__(self) -> None:
        if self.draft_rows < 1 or self.max_backoff < 1:
            raise ValueError("draft_rows and max_backoff must be >= 1")
        if (self.batch_costs or self.long_cost) and self.cost is None:
            raise ValueError("batch_costs and long_cost need the batch-1 cost too")
        if self.block_size is not None and not self.MIN_BLOCK <= self.block_size <= self.MAX_BLOCK:
            raise ValueError(
                f"block_size must be in [{self.MIN_BLOCK}, {self.MAX_BLOCK}], got {self.block_size}"
            )

    def cost_at(self, batch: int, context: int = 0) -> StepCost | None:
        """The step costs measured at the batch size nearest `batch` (in ratio); at batch 1,
        interpolated to `context` where `long_cost` was measured."""
        nearest = self._nearest(batch)
        if nearest is self.cost and self.long_cost is not None:
            return self.cost.at_context(self.long_cost, context)
        return nearest

    def plain_s_at(self, batch: int, context: int = 0) -> float | None:
        """One request's share of a plain step's seconds at load (`cost_at(...).plain_s /
        batch`), without building the interpolated costs: the engine asks every step."""
        nearest = self._nearest(batch)
        if nearest is None:
            return None
        if nearest is self.cost and self.long_cost is not None:
            t = nearest.fraction(self.long_cost, context)
            plain = nearest.plain_s + t * (self.long_cost.plain_s - nearest.plain_s)
            return plain / nearest.batch
        return nearest.plain_s / nearest.batch

    def _nearest(self, batch: int) -> StepCost | None:
        if self.cost is None:
            return None
        if not self.batch_costs:
            return self.cost
        batch = max(1, batch)
        return min((self.cost, *self.batch_costs),
                   key=lambda c: max(c.batch, batch) / min(c.batch, batch))
