"""The DFlash drafter: a small block-diffusion transformer that reads the target's hidden states.

One draft step for N sequences (spec: shared/specs/dflash.md), tokens flattened as N blocks of B:
1. `context_features(captured)` fuses the target's captured hidden states of newly committed
   positions into ctx [T, H]; `context_kv(layer, ctx, positions)` is each layer's K/V of them
   (`store_context_kv` writes it into cache slots with one fused kernel).
   Context rows never get queries, so the engine caches that K/V per drafter layer (the
   drafter's warm state); context key j of a sequence sits at position j.
2. `embed_block(target, block_input_ids(anchors))` embeds [anchor, MASK x (B-1)] with the
   target's embedding, times `input_embedding_scale`; the block starts at the anchor's position.
3. `forward(h, positions, attn)` runs the layers over the N*B block tokens: `attn.attend(layer,
   q, k, v)` receives the block's own q/k/v and attends over the cached context plus the block
   (kernel `draft_attention`, mode from `layer_kind(layer)`). Block K/V are never cached. With
   `rows`, the last layer computes only the rows whose drafts are verified (every row's K/V).
4. `logits(target, hidden)` on block rows 1..B-1: row k predicts the token at start + k, through
   the target's head (or the drafter's own copy of it, `head`: engine.cpu.fastpath's int8 one).

The layers are the target's Qwen3 `DecoderLayer` (pre-norm, q/k RMSNorm, RoPE): a block token's
computation is exactly a target layer's. A DFlash2 drafter (`config.v2`) has `DFlash2Layer`s,
which convolve each sublayer's input and output over the block, and a `candidate_selector` that
chooses the drafts from the logits (engine.models.dflash2). Parameter names are the checkpoint's (no `model.`
prefix) except the fused `qkv_proj` and `gate_up_proj`, which the loader concatenates.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from agentflash.kernels import dispatch
from ..attention import AttentionBackend
from ..config import read_config_json
from ..errors import CheckpointError
from .dflash2 import CandidateSelector, DFlash2Layer
from .dflash_config import DFlashConfig, check_compatible, default_target_layer_ids
from .layers import RMSNorm
from .checkpoint import assemble_state, load_dtype, read_safetensors_dir
from .loader import unfused_sources
from .qwen3 import CausalLM, DecoderLayer
from .rope import RotaryEmbedding, apply_rope

__all__ = [
    "DRAFTER_SUBDIR", "DFlashConfig", "DFlashDraftModel", "LayerKind", "bundled_drafter_dir",
    "check_compatible", "default_target_layer_ids", "load_drafter",
]

DRAFTER_SUBDIR = "drafter"
"""A model directory may carry its own DFlash drafter in this subdirectory."""


class LayerKind(NamedTuple):
    """How a drafter layer's block queries see keys (see kernels.torch_ops.draft_attention)."""

    causal: bool          # block keys only up to the query's own position
    window: int | None    # keys only within this distance of the query (None: all)


class DFlashDraftModel(nn.Module):
    """Drafter layers plus `fc`/`hidden_norm` (context fusion) and `norm`; no embedding, and no
    head of its own in the checkpoint (it drafts with the target's)."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.attention_scale = config.head_dim**-0.5
        self.fc = nn.Linear(len(config.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        decoder, v2 = config.decoder, config.v2
        self.layers = nn.ModuleList(
            DecoderLayer(decoder, i) if v2 is None else DFlash2Layer(decoder, i, v2)
            for i in range(config.num_hidden_layers)
        )
        self.candidate_selector = (
            None if v2 is None else CandidateSelector(hidden, config.vocab_size, v2))
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)
        # Inference transformations that cannot slice qkv_proj's weight (packed weights) give
        # each layer a linear of its own for the context K/V rows (engine.cpu.fastpath).
        self.context_kv_proj: nn.ModuleList | None = None
        # An inference transformation may give the drafter a copy of the target's head to draft
        # with (engine.cpu.fastpath: an int8 one); None: the target's own.
        self.head: nn.Module | None = None
        # As the reference: sliding layers are causal in the block unless is_causal says otherwise.
        self._kinds = tuple(
            LayerKind(
                t == "sliding_attention" if config.is_causal is None else config.is_causal,
                config.sliding_window if t == "sliding_attention" else None,
            )
            for t in config.layer_types
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def layer_kind(self, layer: int) -> LayerKind:
        return self._kinds[layer]

    def block_input_ids(self, anchors: torch.Tensor) -> torch.Tensor:
        """[N, B] blocks `[anchor, MASK x (B-1)]` for the anchors [N] (last committed tokens)."""
        shape = (anchors.shape[0], self.config.block_size)
        ids = anchors.new_full(shape, self.config.mask_token_id)
        ids[:, 0] = anchors
        return ids

    def embed_block(self, target: CausalLM, ids: torch.Tensor) -> torch.Tensor:
        """The drafter's input for block token ids: target embedding x input_embedding_scale."""
        h = target.embed(ids)
        scale = self.config.input_embedding_scale
        return h if scale == 1.0 else h * scale

    def context_features(self, captured: torch.Tensor) -> torch.Tensor:
        """ctx [T, H] from the target's residual stream after each target layer [T, K*H]."""
        return self.hidden_norm(self.fc(captured))

    def context_kv(
        self, layer: int, ctx: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys (k_norm, RoPE at `positions` [T]) and values [T, Hkv, D] of ctx
        (differentiable: the training path)."""
        attn = self.layers[layer].self_attn
        k, v = self._context_projection(layer, ctx)
        cos, sin = self.rotary.cos_sin(positions, ctx.dtype)
        return apply_rope(attn.k_norm(k), cos, sin), v

    def store_context_kv(
        self, layer: int, ctx: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor,
    ) -> None:
        """`context_kv` written straight into cache `slots` [T]: after the projection, k_norm,
        RoPE and the store are one fused kernel (kernels.dispatch.store_context_kv)."""
        k, v = self._context_projection(layer, ctx)
        norm = self.layers[layer].self_attn.k_norm
        weight, eps = (norm.weight, norm.eps) if isinstance(norm, RMSNorm) else (None, 0.0)
        dispatch.store_context_kv(k, v, weight, eps, self.rotary.cos_half, self.rotary.sin_half,
                                  positions, slots, k_cache, v_cache)

    def context_kv_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The K and V rows of layer `layer`'s fused qkv_proj (weight, bias): the projection
        of the context (a linear of its own once packed: `context_kv_proj`)."""
        attn = self.layers[layer].self_attn
        q_size, bias = attn.split_sizes[0], attn.qkv_proj.bias
        return attn.qkv_proj.weight[q_size:], None if bias is None else bias[q_size:]

    def _context_projection(
        self, layer: int, ctx: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s raw keys and values [T, Hkv, D] of ctx: the K/V rows of its qkv_proj."""
        attn = self.layers[layer].self_attn
        kv_size = attn.split_sizes[1]
        if self.context_kv_proj is not None:
            kv = self.context_kv_proj[layer](ctx)
        else:
            kv = F.linear(ctx, *self.context_kv_rows(layer))
        k, v = kv.split(kv_size, dim=-1)
        n = ctx.shape[0]
        return (k.view(n, attn.num_kv_heads, attn.head_dim),
                v.view(n, attn.num_kv_heads, attn.head_dim))

    def forward(
        self, block_hidden: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
        rows: torch.Tensor | None = None, block_size: int | None = None,
    ) -> torch.Tensor:
        """Hidden states [N*B, H] after the final norm, from the embedded blocks [N*B, H] at
        their absolute `positions` [N*B] (below `config.max_position_embeddings`).

        rows: only these block tokens' hidden states [len(rows), H] (indices into the N*B; the
        rows whose drafts are verified), bitwise those rows of the whole forward: the last
        layer computes keys and values for every token but queries, its MLP and the norm only
        for `rows`. `attn` then needs `select(rows)`, the same attention for those queries
        (KernelDraftAttention).

        block_size: the tokens are N blocks [anchor, MASK x (B-1)] of this size, as
        `block_input_ids` makes them. Every mask token then enters the first layer with the
        same input, which only RoPE sets apart, so that layer normalises and projects the N
        anchors and one mask token (`distinct_rows`) instead of N*B tokens: the same numbers
        where the linears compute each row alone (the CPU kernels).

        A DFlash2 drafter needs `block_size` (its convolutions run over each block) and
        computes every row, then keeps `rows`."""
        h = block_hidden
        cos, sin = self.rotary.cos_sin(positions, h.dtype)
        if self.config.v2 is not None:
            if block_size is None:
                raise ValueError("a DFlash2 drafter's forward needs the block size")
            for layer in self.layers:
                h = layer(h, cos, sin, attn, block_size)
            return self.norm(h if rows is None else h.index_select(0, rows))
        expand = None
        if block_size is not None:
            unique, expand = distinct_rows(h.shape[0] // block_size, block_size, h.device)
            h = h.index_select(0, unique)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            select = rows if i == last else None
            h = layer(h, cos, sin, attn if select is None else attn.select(select), select,
                      expand if i == 0 else None)
        return self.norm(h)

    def logits(self, target: CausalLM, hidden: torch.Tensor) -> torch.Tensor:
        """float32 draft logits: the target's head (or `head`), then output_multiplier and the
        softcap."""
        return self.scaled(target.logits(hidden, self.head))

    def scaled(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 head outputs with output_multiplier and the softcap applied."""
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


def distinct_rows(blocks: int, block_size: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """For N blocks [anchor, MASK x (B-1)] flattened: (unique [N + 1], the anchors' rows then the
    first mask token's; expand [N*B], each token's index into unique)."""
    token = torch.arange(blocks * block_size, device=device)
    offset = token % block_size
    unique = torch.cat((torch.arange(blocks, device=device) * block_size,
                        torch.ones(1, dtype=torch.long, device=device)))
    expand = torch.where(offset == 0, token // block_size, blocks)
    return unique, expand


def bundled_drafter_dir(model_dir: str | Path) -> Path | None:
    """The drafter a model directory carries: `<model_dir>/drafter/` when it holds a
    config.json, else None. (Whether it fits the model is checked by `load_drafter`.)"""
    path = Path(model_dir) / DRAFTER_SUBDIR
    return path if (path / "config.json").is_file() else None


def load_drafter(
    path: str | Path,
    target: CausalLM,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> DFlashDraftModel:
    """Load the drafter checkpoint at `path` for `target` (dtype/device default to the target's).
    Raises DrafterMismatchError if it was made for another target, CheckpointError if broken."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"drafter directory {root} does not exist")
    config = DFlashConfig.from_hf(read_config_json(root))
    check_compatible(config, target.config)
    dtype = load_dtype(target.dtype if dtype is None else dtype)
    device = target.device if device is None else torch.device(device)
    tensors = read_safetensors_dir(root)
    with torch.device("meta"):
        model = DFlashDraftModel(config)
    sources = {
        key: unfused_sources(key, tuple(p.shape), config.decoder)
        for key, p in model.state_dict().items()
    }
    ids = list(config.target_layer_ids)
    why = {"fc.weight": f"hidden_size x {len(ids)} target_layer_ids {ids} * hidden_size"}
    kind = "a DFlash drafter" if config.v2 is None else "a DFlash2 drafter"
    state = assemble_state(sources, tensors, dtype, device, root, kind, why=why)
    model.load_state_dict(state, assign=True)
    model.rotary.build(device)
    return model.eval().requires_grad_(False)
