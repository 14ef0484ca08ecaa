"""Per-sequence state: tokens, KV handle, sampling state, stop checks and counters."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable

import torch

from .constraint import TokenConstraint
from .kv.manager import SeqKV
from .lookup import ContextIndex
from .sampler import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SeqCounters:
    """What the engine did for one sequence (the accounting layer reads these)."""

    cached_tokens: int = 0            # prompt tokens served from the prefix cache
    prefill_tokens: int = 0           # prompt tokens computed
    decode_tokens: int = 0            # tokens fed to the target after the prompt
    target_forwards: int = 0          # forwards this sequence took part in
    draft_forwards: int = 0           # drafter forwards (one per drafted block)
    draft_tokens: int = 0             # tokens proposed
    accepted_tokens: int = 0          # proposals the target accepted
    draft_context_tokens: int = 0     # positions whose drafter context K/V was computed
    prediction_tokens: int = 0        # tokens of the caller's prediction (Predicted Outputs)
    prediction_accepted: int = 0      # of those, reproduced by the output (OpenAI's accepted)
    lookups: int = 0                  # verify steps whose drafts were read from the context
    lookup_tokens: int = 0            # tokens they proposed
    lookup_accepted: int = 0          # of those, accepted by the target
    lookup_committed: int = 0         # tokens those steps committed
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens committed per verify
    accepted_per_position: list[int] = field(default_factory=list)  # index k: draft k accepted
    drafts: list[list[int]] | None = None  # proposals per step, when tracing
    # time.perf_counter() stamps: submitted, admitted (KV reserved), first token, finished
    submitted_at: float = 0.0
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    grammar_s: float = 0.0            # time spent in the output constraint (masks, matcher)
    # forward time attributed to this sequence: its share (by tokens fed) of each target
    # forward it was in, split by prefill vs decode/verify items, and its share of drafter
    # forwards (split evenly between the blocks drafted together)
    prefill_compute_s: float = 0.0
    decode_compute_s: float = 0.0     # decode and verify items
    verify_compute_s: float = 0.0     # of which verify items
    draft_compute_s: float = 0.0
    # for the counterfactuals (agentflash.usage), what its speculation cost and what plain
    # decoding would have: the forward time of its drafted and context-drafted verify steps,
    # and the seconds plain decode steps for the tokens they committed would have taken (their
    # cost at load, StepCost at the step's batch and context, times the engine's slowdown
    # then; None without step costs); and the prefill cost units (PrefillCost) of the chunks
    # it computed and of computing its whole prompt (None without a prefill cost)
    speculated_s: float = 0.0
    plain_equivalent_s: float | None = 0.0
    prefill_units: float | None = 0.0
    recompute_units: float | None = 0.0

    @property
    def plain_steps(self) -> int:
        """Decode steps that fed one token: a verify fed its anchor and its drafts."""
        return (self.decode_tokens - self.draft_forwards - self.draft_tokens - self.lookups
                - self.lookup_tokens)

    @property
    def acceptance_histogram(self) -> dict[int, int]:
        """Verify steps by tokens committed (tau)."""
        hist: dict[int, int] = {}
        for tau in self.acceptance_lengths:
            hist[tau] = hist.get(tau, 0) + 1
        return dict(sorted(hist.items()))


@dataclass
class SpecState:
    """One request's speculation state (engine.policy keeps it)."""

    drafts: bool = False       # the drafter proposes its blocks
    # with step costs: drafts the drafter proposes at its next drafted step, plain steps before
    # that step, and how many follow the next drafted step that does not pay
    draft_rows: int = 0
    cooldown: int = 0
    backoff: int = 1
    # tokens committed per plain step of cost by its recent drafted steps (2.0 before the
    # first: until the drafter shows otherwise, only context drafts expected to double plain
    # decoding take its place)
    draft_rate: float = 2.0
    # its tokens indexed for context drafts, and the next step's context drafts with their
    # match length, where they pay more than the step planned
    index: ContextIndex | None = None
    lookup: list[int] | None = None
    lookup_match: int = 0


@dataclass(eq=False)
class Sequence:
    """One request moving through the engine: prompt, generated tokens and its KV handle."""

    id: int
    prompt_ids: list[int]
    params: SamplingParams
    max_len: int                      # context limit for prompt + output
    pin: bool = False                 # keep the finished sequence's KV pinned (live sessions)
    reuse: bool = True                # start from the longest cached prefix of the prompt
    block_size: int = 1               # > 1: speculative (anchor + block_size-1 drafts per step)
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    kv: SeqKV | None = None
    state_slot: int | None = None     # hybrid models: its row in the StatePool, while running
    generator: torch.Generator | None = None
    constraint: TokenConstraint | None = None  # grammar every generated token must follow
    prediction: list[int] | None = None  # the caller's guess of the output, while it holds
    spec: SpecState = field(default_factory=SpecState)  # engine.policy's state of the request
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: Exception | None = None
    counters: SeqCounters = field(default_factory=SeqCounters)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """tokens[start:end] without building the whole list (the decode loop calls this)."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n:end - n]
        return self.prompt_ids[start:] + self.output_ids[:end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def computed(self) -> int:
        """Tokens whose KV is written."""
        return self.kv.length if self.kv is not None else 0

    @property
    def predicting(self) -> bool:
        """The output so far equals the start of the prediction, and some of it is left."""
        return self.prediction is not None and len(self.output_ids) < len(self.prediction)

    def follow_prediction(self, kept: int) -> None:
        """After `kept` tokens were appended: count those that reproduce the prediction, and
        drop the prediction once the output leaves it."""
        if self.prediction is None:
            return
        n = len(self.output_ids)
        for i in range(n - kept, n):
            if i >= len(self.prediction) or self.output_ids[i] != self.prediction[i]:
                self.prediction = None
                return
            self.counters.prediction_accepted += 1

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prompt_ids)

    @property
    def budget(self) -> int:
        """Upper bound on this sequence's total length (what its KV reservation covers)."""
        return min(self.max_len, len(self.prompt_ids) + self.params.max_new_tokens)

    def append(
        self, tokens: list[int], eos_ids: frozenset[int], detokenize: Callable[[list[int]], str] | None
    ) -> int:
        """Append generated tokens one by one, stopping at the first stop condition.

        Returns how many were kept (tokens after a stop are dropped)."""
        params = self.params
        for n, tok in enumerate(tokens, 1):
            self.output_ids.append(tok)
            if tok in params.stop_token_ids or (not params.ignore_eos and tok in eos_ids):
                self.finish_reason = "stop"
            elif params.stop and detokenize is not None and self._hit_stop_string(detokenize):
                self.finish_reason = "stop"
            elif len(self.output_ids) >= params.max_new_tokens or self.num_tokens >= self.max_len:
                self.finish_reason = "length"
            if self.finish_reason is not None:
                return n
        return len(tokens)

    def _hit_stop_string(self, detokenize: Callable[[list[int]], str]) -> bool:
        # Only the tail can contain a stop string completed by the newest token.
        longest = max(len(s) for s in self.params.stop)
        # (an earlier occurrence would already have stopped the sequence)
        tail = detokenize(self.output_ids[-(longest + 8):])
        return any(s in tail for s in self.params.stop)
