"""The forward of a step's decode rows and verify blocks, and the DFlash drafter's block
forward: the modules engine.cpu.compiled exports, and how a step runs them (a DFlash2 drafter's
block forward is its module's own, `ModuleDraftForward`).

A decode/verify forward serves every decode row and verify block of a step (the runner sends
prefill chunks to the eager model in a forward of their own), so a row's numbers never depend on
what else shares its forward: a verify block's rows are bitwise the plain decode steps' rows,
which greedy speculative decoding needs to equal plain decoding. `DecodeForward` runs
`TargetStep` and `DraftForward` runs `DraftStep`, eager on agentflash's CPU kernels
(kernels.cpu_ops: linears and attention whose rows are independent of the call by
construction); engine.cpu.compiled's `CompiledForward` and `CompiledDraft` run the same modules
compiled ahead of time instead (faster: fused elementwise kernels, no Python per op). The eager
runners are what an engine on a CPU with the kernels uses where no program is made: compiling
turned off, or a model over the compile bound (its package would copy the weights).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from agentflash.kernels import cpu_ops, torch_ops

from ..attention import PagedAttention, PagedDraftAttention
from ..models.dflash import DFlashDraftModel
from ..models.qwen3 import CausalLM
from .attention import KernelAttention, KernelDraftAttention
from .kernel_linear import KernelLinear, with_kernel_linears


@dataclass(frozen=True)
class StepArgs:
    """The tensors of one decode/verify forward (built by `step_args` from its metadata)."""

    ids: torch.Tensor            # [T]
    positions: torch.Tensor      # [T]
    rows: torch.Tensor           # [R] the tokens whose outputs the forward returns (those that
                                 # sample: a prefill chunk's last)
    slot_mapping: torch.Tensor   # [T] where each new token's K/V goes
    attention: tuple[torch.Tensor, ...]
    """With the CPU kernels, KernelAttention's (page_table [B, P], token_seq [T], token_keys
    [T]); else the torch path's (q_index [B, Q]: token row per (sequence, query), T padding;
    out_index [T]: row of the [B*Q] output holding each token; the ChunkPlan's kv_index
    [B, Hkv, n, C] and visible [B, n, Q, C])."""


def step_args(ids: torch.Tensor, positions: torch.Tensor,
              attn: PagedAttention | KernelAttention,
              rows: torch.Tensor | None = None) -> StepArgs:
    """The forward's inputs for a forward whose metadata is `attn`: a KernelAttention, or a
    PagedAttention built with `one_group=True` on CPU in bfloat16 (so with a ChunkPlan).
    rows: the tokens whose outputs are wanted (None: every token)."""
    if rows is None:
        rows = torch.arange(ids.shape[0], device=ids.device)
    if isinstance(attn, KernelAttention):
        return StepArgs(ids, positions, rows, attn.slot_mapping,
                        (attn.page_table, attn.token_seq, attn.token_keys))
    (group,) = attn.groups
    assert group.plan is not None
    out_index = group.out_index
    if out_index is None:
        out_index = torch.arange(ids.shape[0], device=ids.device)
    return StepArgs(ids, positions, rows, attn.slot_mapping,
                    (group.q_index, out_index, group.plan.kv_index, group.plan.visible))


def draft_metadata(attn: KernelDraftAttention | PagedDraftAttention) -> tuple[torch.Tensor, ...]:
    """The drafter forward's attention tensors, in `DraftStep.forward`'s order."""
    if isinstance(attn, KernelDraftAttention):
        return (attn.page_table, attn.token_seq, attn.token_keys, attn.causal_keys,
                attn.ctx_lens)
    return (attn.gather, attn.ctx_lens)


def kernel_view(module: nn.Module) -> nn.Module:
    """`module` with its linears through the kernel (a copy sharing the weights); a drafter's
    context K/V rows too (the K and V rows of each layer's fused qkv_proj, as a linear, unless
    it has its own: the int8 drafter's, engine.cpu.fastpath)."""
    out = with_kernel_linears(module)
    if isinstance(module, DFlashDraftModel) and module.context_kv_proj is None:
        out.context_kv_proj = nn.ModuleList(
            KernelLinear(*module.context_kv_rows(i)) for i in range(len(module.layers)))
    return out


def without_head(model: CausalLM) -> CausalLM:
    """The model sharing every module but its head: the forward ends at the final norm, and a
    packed head (engine.cpu.fastpath, an earlier engine on the same model) cannot be traced."""
    trunk = copy.copy(model)
    trunk._modules = {**model._modules, "lm_head": None}
    return trunk


def kernel_head(model: CausalLM) -> nn.Module:
    """The model's head through the CPU kernel, on the checkpoint's matrix (a tied head on the
    embedding's): what a step's program computes its logits with."""
    head = model.lm_head
    if head is None:
        return KernelLinear(model.embed_tokens.weight, None)
    return with_kernel_linears(head)


class TargetStep(nn.Module):
    """The target's decode/verify forward over one group of paged attention, then, with a
    drafter, the drafter's context K/V of the fed positions stored into its caches (the runner's
    `_store_draft_context`, folded in). kernels: linears and attention through the CPU kernels,
    the head too (the forward returns float32 logits: no Python between the last layer and the
    head), else the model's own linears and the torch attention's row-invariant path (the
    forward returns the final hidden states; the head stays eager: a head an earlier engine
    packed for oneDNN cannot be traced). Either way of the tokens `rows` only (every row of a
    decode or verify step; a prefill chunk's last: DecodeForward.takes_prefill)."""

    def __init__(self, model: CausalLM, drafter: DFlashDraftModel | None,
                 kernels: bool, page_size: int) -> None:
        super().__init__()
        self.model = without_head(model)
        self.kernels = kernels
        self.page_size = page_size
        self.head = None
        if kernels:
            self.model = kernel_view(self.model)
            self.head = kernel_head(model)
            drafter = None if drafter is None else kernel_view(drafter)
        self.drafter = drafter
        self.capture = tuple(drafter.config.target_layer_ids) if drafter is not None else ()

    def forward(self, ids, positions, rows, slot_mapping, attention, k_caches, v_caches,
                draft_k_caches, draft_v_caches):
        scale = self.model.attention_scale
        if self.kernels:
            attn = KernelAttention(k_caches, v_caches, slot_mapping, *attention, self.page_size,
                                   scale)
        else:
            q_index, out_index, kv_index, visible = attention
            attn = PagedAttention.from_plan(k_caches, v_caches, slot_mapping, q_index, out_index,
                                            torch_ops.ChunkPlan(kv_index, visible), scale)
        out = self.model(ids, positions, attn, self.capture)
        if self.drafter is not None:
            ctx = self.drafter.context_features(out.captured)
            for i, (k, v) in enumerate(zip(draft_k_caches, draft_v_caches)):
                self.drafter.store_context_kv(i, ctx, positions, slot_mapping, k, v)
        hidden = out.hidden.index_select(0, rows)
        return hidden if self.head is None else self.head(hidden).float()


class DraftStep(nn.Module):
    """The drafter's forward: N blocks of B tokens embedded, through its layers over each
    sequence's cached context K/V, to the final norm, for the block tokens `rows` (indices into
    the N*B: those whose drafts are verified), and with the CPU kernels through its own head
    (`DFlashDraftModel.head`, the int8 copy engine.cpu.fastpath gives it) to float32 logits; else
    the hidden states (the head stays eager). With the CPU kernels (and no windowed layer) the
    attention reads the context in place (KernelDraftAttention) and the last layer computes only
    `rows` (its K/V for every token); else the attention goes through the torch path
    (PagedDraftAttention) and every row is computed, `rows` then taken."""

    def __init__(self, model: CausalLM, drafter: DFlashDraftModel, block_size: int,
                 kernels: bool, page_size: int) -> None:
        super().__init__()
        self.embed = model.embed_tokens
        self.drafter = kernel_view(drafter) if kernels else drafter
        self.block_size = block_size
        self.page_size = page_size
        self.kernel_attention = kernels and KernelDraftAttention.supports(drafter)
        self.returns_logits = self.computes_head(drafter, kernels)

    @staticmethod
    def computes_head(drafter: DFlashDraftModel, kernels: bool) -> bool:
        """Whether the forward ends in the drafter's head: with the CPU kernels, when it has a
        head of its own (the target's may be packed for oneDNN, which cannot be traced)."""
        return kernels and drafter.head is not None

    def forward(self, ids, positions, rows, attention, k_caches, v_caches):
        d = self.drafter
        h = self.embed(ids)
        scale = d.config.input_embedding_scale
        h = h if scale == 1.0 else h * scale
        if self.kernel_attention:
            attn = KernelDraftAttention(
                k_caches, v_caches, *attention, self.page_size, d.attention_scale,
                [d.layer_kind(i).causal for i in range(len(d.layers))])
            hidden = d(h, positions, attn, rows, self.block_size)
        else:
            gather, ctx_lens = attention
            attn = PagedDraftAttention(k_caches, v_caches, gather, ctx_lens, self.block_size,
                                       d.attention_scale,
                                       [d.layer_kind(i) for i in range(len(d.layers))])
            hidden = d(h, positions, attn, block_size=self.block_size).index_select(0, rows)
        # the head either way: a drafter whose attention the kernel cannot take (a window, an
        # odd head size) still has the head engine.cpu.fastpath gave it
        return d.scaled(d.head(hidden).float()) if self.returns_logits else hidden


class DecodeForward:
    """A step's decode/verify forward: call it with `StepArgs`, the target's per-layer caches
    and the drafter's (with a drafter, whose context K/V it stores); returns the float32 logits
    [R, V] of `StepArgs.rows` where it runs the CPU kernels (`returns_logits`), else their
    hidden states [R, H] after the final norm. This one runs `TargetStep` eager on the CPU
    kernels.

    `takes_prefill`: a forward on the kernels takes a prefill chunk's rows faster than oneDNN
    (kernels.cpu_ops.fast_many_rows: native bfloat16 dot products; compiled, AVX2 too), so the
    runner sends prefill chunks through this forward too, every item of a step in one forward
    (rows independent of the call by construction); elsewhere each chunk runs on the eager
    model in a forward of its own."""

    kind = "eager"

    def __init__(self, kernels: bool, step: TargetStep | None = None) -> None:
        self.kernels = kernels     # linears and attention through agentflash's CPU kernels
        self.returns_logits = kernels  # the head inside (TargetStep)
        self.takes_prefill = kernels and cpu_ops.fast_many_rows(self.kind == "compiled")
        self.step = step

    @classmethod
    def eager(cls, model: CausalLM, drafter: DFlashDraftModel | None = None,
              page_size: int = 16) -> DecodeForward:
        return cls(True, TargetStep(model, drafter, True, page_size))

    def attention(self, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor],
                  page_tables: Sequence[Sequence[int]], ctx_lens: Sequence[int],
                  num_new: Sequence[int], page_size: int,
                  scale: float) -> KernelAttention | PagedAttention:
        """A forward's attention metadata in the form this forward takes (`step_args`)."""
        if self.kernels:
            return KernelAttention.build(k_caches, v_caches, page_tables, ctx_lens, num_new,
                                         page_size, scale)
        return PagedAttention.build(k_caches, v_caches, page_tables, ctx_lens, num_new,
                                    page_size, scale, one_group=True)

    def args(self, ids: torch.Tensor, positions: torch.Tensor,
             attn: KernelAttention | PagedAttention,
             rows: torch.Tensor | None = None) -> StepArgs:
        """The forward's inputs for new tokens `ids` at `positions` with metadata `attn`, the
        outputs of tokens `rows` wanted (None: every token's)."""
        return step_args(ids, positions, attn, rows)

    def __call__(self, args: StepArgs, k_caches: Sequence[torch.Tensor],
                 v_caches: Sequence[torch.Tensor], draft_k_caches: Sequence[torch.Tensor] = (),
                 draft_v_caches: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        assert self.step is not None
        return self.step(args.ids, args.positions, args.rows, args.slot_mapping, args.attention,
                         k_caches, v_caches, draft_k_caches, draft_v_caches)


class DraftForward:
    """The drafter's forward for one block size: call it with the blocks' token ids [N*B],
    positions [N*B], the attention metadata of `attention` and the rows wanted (indices into
    the N*B); returns their float32 draft logits [len(rows), V] where it computes the head
    (`returns_logits`), else their hidden states [len(rows), H] after its final norm. This one
    runs `DraftStep` eager on the CPU kernels."""

    kind = "eager"

    def __init__(self, kernel_attention: bool, returns_logits: bool,
                 step: DraftStep | None = None) -> None:
        self.kernel_attention = kernel_attention  # KernelDraftAttention, else the torch path
        self.returns_logits = returns_logits
        self.step = step

    @classmethod
    def eager(cls, model: CausalLM, drafter: DFlashDraftModel, block_size: int,
              page_size: int = 16) -> DraftForward:
        step = DraftStep(model, drafter, block_size, True, page_size)
        return cls(step.kernel_attention, step.returns_logits, step)

    def attention(self, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor],
                  page_tables: Sequence[Sequence[int]], ctx_lens: Sequence[int],
                  block_size: int, page_size: int,
                  drafter: DFlashDraftModel) -> KernelDraftAttention | PagedDraftAttention:
        """A draft forward's attention metadata in the form this forward takes."""
        build = KernelDraftAttention.build if self.kernel_attention else PagedDraftAttention.build
        return build(k_caches, v_caches, page_tables, ctx_lens, block_size, page_size, drafter)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor,
                 attn: KernelDraftAttention | PagedDraftAttention,
                 rows: torch.Tensor) -> torch.Tensor:
        assert self.step is not None
        return self.step(ids, positions, rows, draft_metadata(attn), attn.k_caches,
                         attn.v_caches)


class ModuleDraftForward(DraftForward):
    """A drafter `DraftStep` does not implement (a DFlash2 drafter: its convolutions and
    selector) runs its own module forward, eager, with the CPU kernels' attention where they take
    its layers (`KernelDraftAttention.supports`); returns the rows' hidden states."""

    kind = "module"

    def __init__(self, model: CausalLM, drafter: DFlashDraftModel, block_size: int) -> None:
        super().__init__(KernelDraftAttention.supports(drafter), returns_logits=False)
        self.model, self.drafter, self.block_size = model, drafter, block_size

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor,
                 attn: KernelDraftAttention | PagedDraftAttention,
                 rows: torch.Tensor) -> torch.Tensor:
        h = self.drafter.embed_block(self.model, ids)
        return self.drafter(h, positions, attn, rows=rows, block_size=self.block_size)
