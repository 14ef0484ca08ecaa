"""Usage: what one step (or a run, the sum of its steps) used, counted from engine events.

Pydantic models with the OpenAI-shaped core (prompt/completion/total tokens, cached prompt
tokens, accepted/rejected prediction tokens: OpenAI's Predicted Outputs, the tokens of a
caller-supplied prediction the target accepted or did not; DFlash's drafts are counted in
`speculative`, never there) and the `speculative`, `compute`, `timing` and
`cost` sections of ../shared/specs/usage.md. Sums add counts field by field and recompute ratios
from the sums (never an average of averages).

Cost comes from a `Pricing`:
- per device-hour: the step pays for the forward time the engine attributed to it (its share,
  by tokens fed, of every batched target forward, and of the drafter forwards). Savings are
  counterfactuals priced at the speed the machine ran the step at, so they follow a machine
  that is busier or quieter than it was at load: speculation saved the plain decode steps of
  the tokens its verify steps committed (their cost measured at load, StepCost at the step's
  batch and context, times how much slower the engine's recent forwards ran than at load:
  engine.slowdown) minus what those verify steps and the drafter took (negative when it cost
  more than it saved); the cache saved what computing the cached prompt tokens would have
  added to the step's own prefill (its measured time, scaled by the prefill cost shape, in
  which attention grows with the context: engine PrefillCost). None where the counterfactual
  is unknown (no step costs: speculation="always"; no prefill cost measured).
- per 1M tokens (an API price sheet): input, cached input and output tokens. Caching saves
  the input/cached-input difference; speculation does not change a token bill (saves 0).

A step on a remote server (agentflash.remote) has only what the server reports and what the
client measures: a number the server does not report is None (a section the server does not
report at all, e.g. `speculative` or `compute`, is None), never estimated. A sum is None where
any of its terms is.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, computed_field, model_validator

from agentflash.engine.sequence import SeqCounters


class PromptTokensDetails(BaseModel):
    cached_tokens: int | None = 0


class CompletionTokensDetails(BaseModel):
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Speculative(BaseModel):
    drafts: int = 0                      # drafter forwards (one per verified block)
    draft_tokens: int = 0                # tokens proposed
    accepted_tokens: int = 0             # proposals the target accepted
    committed_tokens: int = 0            # tokens committed by verify steps (sum of tau)
    accepted_per_position: list[int] = Field(default_factory=list)  # k: draft k+1 accepted
    acceptance_histogram: dict[int, int] = Field(default_factory=dict)  # tau -> verify steps
    # verify steps of drafts read from the context instead (engine.lookup; no drafter forward)
    lookups: int = 0
    lookup_tokens: int = 0               # tokens they proposed
    lookup_accepted: int = 0             # of those, accepted by the target

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
    queue_s: float | None = 0.0          # submitted -> KV reserved, first forward
    ttft_s: float = 0.0                  # submitted -> first token
    prefill_s: float | None = 0.0        # admitted -> first token
    decode_s: float = 0.0                # first token -> finished
    grammar_s: float | None = 0.0        # output-constraint masks and matcher updates
    tool_s: float = 0.0                  # the step's tools (run concurrently: wall time)
    total_s: float = 0.0                 # the whole step


class Pricing(BaseModel):
    """A price: per device-hour of compute, or per 1M input / cached input / output tokens."""

    model_config = ConfigDict(frozen=True)

    usd_per_hour: float | None = None
    input_per_1m: float | None = None
    cached_input_per_1m: float | None = None
    output_per_1m: float | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> Pricing:
        tokens = (self.input_per_1m, self.cached_input_per_1m, self.output_per_1m)
        if (self.usd_per_hour is None) == all(p is None for p in tokens):
            raise ValueError("set either usd_per_hour or the per-1M token prices")
        if self.usd_per_hour is None and None in tokens:
            raise ValueError("token pricing needs input_per_1m, cached_input_per_1m and "
                             "output_per_1m")
        if any(p is not None and p < 0 for p in (self.usd_per_hour, *tokens)):
            raise ValueError("prices must be >= 0")
        return self


class Cost(BaseModel):
    usd: float = 0.0
    saved_by_cache_usd: float | None = 0.0   # prefill that prefix reuse avoided
    saved_by_speculation_usd: float | None = 0.0  # target forwards avoided, net of drafting
    #                                               and rejected drafts

    @classmethod
    def of_tokens(cls, pricing: Pricing, prompt_tokens: int, cached_tokens: int | None,
                  completion_tokens: int) -> Cost | None:
        """The bill under per-1M token prices; None when the cached tokens are unknown."""
        if cached_tokens is None:
            return None
        assert pricing.input_per_1m is not None and pricing.cached_input_per_1m is not None \
            and pricing.output_per_1m is not None
        per = 1e-6
        fresh = prompt_tokens - cached_tokens
        return cls(
            usd=per * (fresh * pricing.input_per_1m + cached_tokens * pricing.cached_input_per_1m
                       + completion_tokens * pricing.output_per_1m),
            saved_by_cache_usd=per * cached_tokens * (pricing.input_per_1m
                                                     - pricing.cached_input_per_1m))

    @classmethod
    def of(cls, pricing: Pricing | None, c: SeqCounters, prompt_tokens: int,
           completion_tokens: int) -> Cost:
        """The cost of one generation, from its engine counters."""
        if pricing is None:
            return cls()
        if pricing.usd_per_hour is None:
            cost = cls.of_tokens(pricing, prompt_tokens, c.cached_tokens, completion_tokens)
            assert cost is not None
            return cost
        rate = pricing.usd_per_hour / 3600
        saved_cache, saved_spec = _recompute_s(c), 0.0
        if c.draft_forwards or c.lookups:  # plain steps for what it committed, minus what it took
            saved_spec = None if c.plain_equivalent_s is None else \
                c.plain_equivalent_s - c.speculated_s - c.draft_compute_s
        return cls(
            usd=rate * (c.prefill_compute_s + c.decode_compute_s + c.draft_compute_s),
            saved_by_cache_usd=None if saved_cache is None else rate * saved_cache,
            saved_by_speculation_usd=None if saved_spec is None else rate * saved_spec)


def _recompute_s(c: SeqCounters) -> float | None:
    """Seconds that computing the cached prompt tokens too would have added to the prefill,
    at the speed the prefill ran: its time over its cost units, times the units the whole
    prompt costs beyond them (0 without cached tokens; None without a prefill cost)."""
    if not c.cached_tokens:
        return 0.0
    if c.prefill_units is None or c.recompute_units is None or c.prefill_units <= 0:
        return None
    return max(0.0, c.prefill_compute_s * (c.recompute_units / c.prefill_units - 1))


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails | None = Field(
        default_factory=CompletionTokensDetails)
    speculative: Speculative | None = Field(default_factory=Speculative)
    compute: Compute | None = Field(default_factory=Compute)
    timing: Timing = Field(default_factory=Timing)
    cost: Cost | None = Field(default_factory=Cost)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens served from the prefix cache (None: the server does not say)."""
        return self.prompt_tokens_details.cached_tokens

    @classmethod
    def from_counters(cls, c: SeqCounters, prompt_tokens: int, completion_tokens: int,
                      target_params: int, draft_params: int, block_size: int, device: str,
                      tool_s: float, total_s: float, pricing: Pricing | None = None
                      ) -> Usage:
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
                accepted_prediction_tokens=c.prediction_accepted,
                rejected_prediction_tokens=c.prediction_tokens - c.prediction_accepted),
            speculative=Speculative(
                drafts=c.draft_forwards, draft_tokens=c.draft_tokens,
                accepted_tokens=c.accepted_tokens, committed_tokens=sum(c.acceptance_lengths),
                accepted_per_position=list(c.accepted_per_position),
                acceptance_histogram=c.acceptance_histogram, lookups=c.lookups,
                lookup_tokens=c.lookup_tokens, lookup_accepted=c.lookup_accepted),
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
            cost=Cost.of(pricing, c, prompt_tokens, completion_tokens),
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
        if x is None or y is None:
            out[key] = None  # not reported by one of the terms: unknown in the sum
            continue
        if key == "acceptance_histogram":
            out[key] = {k: x.get(k, 0) + y.get(k, 0) for k in sorted({*x, *y})}
        elif isinstance(x, dict):
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
