"""Usage: what one step (or a run, the sum of its steps) used, counted from engine events.

Pydantic models with the OpenAI-shaped core (prompt/completion/total tokens, cached prompt
tokens, accepted/rejected prediction tokens) and the `speculative`, `compute` and `timing`
sections of ../shared/specs/usage.md. Sums add counts field by field and recompute ratios from
the sums (never an average of averages).
"""

from __future__ import annotations

from pydantic import BaseModel, Field, computed_field

from agentflash.engine.sequence import SeqCounters


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Speculative(BaseModel):
    drafts: int = 0                      # drafter forwards (one per verified block)
    draft_tokens: int = 0                # tokens proposed
    accepted_tokens: int = 0             # proposals the target accepted
    committed_tokens: int = 0            # tokens committed by verify steps (sum of tau)
    accepted_per_position: list[int] = Field(default_factory=list)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def mean_acceptance_length(self) -> float:
        """Committed tokens per verify step (tau); 0 without speculation."""
        return self.committed_tokens / self.drafts if self.drafts else 0.0


class Compute(BaseModel):
    target_forwards: int = 0
    draft_forwards: int = 0
    prefill_tokens_computed: int = 0
    verify_tokens_computed: int = 0      # tokens fed after the prompt (decode and verify)
    flops: float = 0.0                   # 2 x params x tokens, target and drafter
    device: str = ""                     # e.g. "cpu", "cuda:0"


class Timing(BaseModel):
    queue_s: float = 0.0                 # submitted -> KV reserved, first forward
    ttft_s: float = 0.0                  # submitted -> first token
    prefill_s: float = 0.0               # admitted -> first token
    decode_s: float = 0.0                # first token -> finished
    grammar_s: float = 0.0               # output-constraint masks and matcher updates
    tool_s: float = 0.0                  # the step's tools (run concurrently: wall time)
    total_s: float = 0.0                 # the whole step


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails = Field(
        default_factory=CompletionTokensDetails)
    speculative: Speculative = Field(default_factory=Speculative)
    compute: Compute = Field(default_factory=Compute)
    timing: Timing = Field(default_factory=Timing)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @classmethod
    def from_counters(cls, c: SeqCounters, prompt_tokens: int, completion_tokens: int,
                      target_params: int, draft_params: int, block_size: int, device: str,
                      tool_s: float, total_s: float) -> Usage:
        """The usage of one generation from its engine counters and timestamps."""
        t_first = c.first_token_at or c.finished_at or c.submitted_at
        t_admit = c.admitted_at or t_first
        verify_tokens = c.decode_tokens
        drafter_tokens = c.draft_forwards * block_size + c.draft_context_tokens
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=c.cached_tokens),
            completion_tokens_details=CompletionTokensDetails(
                accepted_prediction_tokens=c.accepted_tokens,
                rejected_prediction_tokens=c.draft_tokens - c.accepted_tokens),
            speculative=Speculative(
                drafts=c.draft_forwards, draft_tokens=c.draft_tokens,
                accepted_tokens=c.accepted_tokens, committed_tokens=sum(c.acceptance_lengths),
                accepted_per_position=list(c.accepted_per_position)),
            compute=Compute(
                target_forwards=c.target_forwards, draft_forwards=c.draft_forwards,
                prefill_tokens_computed=c.prefill_tokens, verify_tokens_computed=verify_tokens,
                flops=2.0 * (target_params * (c.prefill_tokens + verify_tokens)
                             + draft_params * drafter_tokens),
                device=device),
            timing=Timing(
                queue_s=max(0.0, t_admit - c.submitted_at),
                ttft_s=max(0.0, t_first - c.submitted_at),
                prefill_s=max(0.0, t_first - t_admit),
                decode_s=max(0.0, (c.finished_at or t_first) - t_first),
                grammar_s=c.grammar_s, tool_s=tool_s, total_s=total_s),
        )

    def __add__(self, other: Usage) -> Usage:
        return Usage.model_validate(_add(self.model_dump(), other.model_dump()))

    @classmethod
    def sum(cls, usages: list[Usage]) -> Usage:
        total = cls()
        for u in usages:
            total = total + u
        return total


def _add(a: dict, b: dict) -> dict:
    out: dict = {}
    for key, x in a.items():
        y = b[key]
        if key in ("total_tokens", "mean_acceptance_length"):
            continue  # derived: recomputed from the sums
        if isinstance(x, dict):
            out[key] = _add(x, y)
        elif isinstance(x, list):
            n = max(len(x), len(y))
            out[key] = [(x[i] if i < len(x) else 0) + (y[i] if i < len(y) else 0)
                        for i in range(n)]
        elif isinstance(x, str):
            out[key] = x if x == y or not y else y if not x else f"{x},{y}"
        else:
            out[key] = x + y
    return out
