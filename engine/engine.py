"""The synchronous engine loop: submit / abort / step, one owner thread.

Each `step()` schedules a batch (decode tokens and prefill chunks together), runs one target
forward, samples, appends tokens, and retires finished sequences: their prompt AND generated
tokens go into the radix prefix cache, optionally pinned for a live session, so the next turn
of a conversation prefills only what is new. Hybrid targets (Qwen3.5) decode plainly and resume
from a state snapshot where the previous turn ended (see `Engine`).
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Literal, Sequence as Seq

import torch

from .config import CacheConfig, PrefillCost, SchedulerConfig, SpecConfig, StepCost
from .constraint import TokenConstraint, follow, masked, propose, settle
from .errors import ContextLengthError, KVPoolExhaustedError, RequestError
from .fastpath import Prepared, prepare
from .slowdown import Slowdown
from .kv.manager import KVManager, Pin
from .kv.pool import KVPool
from .kv.state_pool import StatePool
from .lookup import ContextIndex, LookupStats
from .models.dflash import DFlashDraftModel, load_drafter
from .models.gated_deltanet import RecurrentStates
from .models.loader import load_model
from .models.qwen3 import CausalLM
from .models.qwen3_5 import HybridCausalLM
from .runner import ModelRunner
from .sampler import SamplingParams, make_generator, top1
from .scheduler import BatchItem, Scheduler
from .sequence import SeqCounters, Sequence, Status
from .spec import Rows, Verdict, confident_length, judge

PREDICTION_BLOCK = 16
"""Tokens per verify step (anchor + 15 predicted) for a prediction on a sequence the drafter
does not serve (no drafter, or speculative=False)."""


@dataclass
class SeqUpdate:
    """What happened to one sequence in one step."""

    seq_id: int
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: Exception | None = None
    draft_tokens: int = 0       # proposed by the drafter this step
    accepted_tokens: int = 0    # of those, accepted by the target
    lookup_tokens: int = 0      # proposed from the context this step (engine.lookup)


@dataclass
class Completion:
    """A finished sequence."""

    seq_id: int
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str
    counters: SeqCounters
    pin: Pin | None = None
    error: Exception | None = None


@dataclass
class EngineCounters:
    """Engine-wide totals since start."""

    steps: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    cached_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    draft_context_tokens: int = 0
    lookups: int = 0            # verify steps of context drafts (engine.lookup)
    lookup_tokens: int = 0
    lookup_accepted: int = 0
    draft_s: float = 0.0        # drafter forwards
    target_s: float = 0.0       # target forwards (prefill, decode and verify)
    step_s: float = 0.0         # whole steps: the rest is scheduling and bookkeeping


class Engine:
    """Requests in, tokens out, one step at a time, on one target model (and optional drafter).

    A hybrid target (`HybridCausalLM`, Qwen3.5) keeps its full-attention layers' K/V in the paged
    pool and each running sequence's linear-attention state in a `StatePool` slot. A finished
    sequence's state is snapshotted onto the radix node where its cached tokens end, and a
    prefix hit is taken only up to such a node (the state is restored from it), so the next turn
    of a conversation computes only its new tokens. Verify blocks (DFlash drafts, predictions)
    run stepwise through the linear layers, and once judged the state is rolled back to the
    last committed token (ModelRunner.settle), as the KV is. Its forwards run eager
    (engine.fastpath leaves hybrid models as loaded)."""

    def __init__(
        self,
        model: CausalLM | HybridCausalLM,
        cache: CacheConfig = CacheConfig(),
        scheduler: SchedulerConfig = SchedulerConfig(),
        max_model_len: int | None = None,
        detokenize: Callable[[list[int]], str] | None = None,
        drafter: DFlashDraftModel | None = None,
        spec: SpecConfig = SpecConfig(),
        fast_path: bool = True,
        quantize: str | None = None,
        compile: bool | None = None,
    ):
        """fast_path: prepare the models for inference on this machine, in place (engine.fastpath:
        faster; the models stay usable for inference only); False keeps them as given.
        compile: with the fast path on CPU in bfloat16, compile the decode/verify forward ahead
        of time (engine.compiled; cached on disk, so ~35 s once per model and machine at 11m;
        None: unless $AGENTFLASH_COMPILE=0). quantize="int8": int8 weights for the
        target's layers (CPU, bfloat16; other numbers than the checkpoint's, so only when asked
        for; engine.fastpath)."""
        cfg = model.config
        if quantize is not None and not fast_path:
            raise ValueError("quantize needs the fast path (fast_path=True)")
        t0 = time.perf_counter()
        block_size = 1
        if drafter is not None:
            block_size = spec.block_size or drafter.config.block_size
            SpecConfig(block_size)  # validates a checkpoint's own block size too
        prepared = (prepare(model, drafter, quantize, compile, block_size, cache.page_size)
                    if fast_path else Prepared([]))
        self.fast_paths = prepared.applied
        self.fast_path_seconds = prepared.seconds
        self.fast_path_s = time.perf_counter() - t0  # preparing the models (once, at start)
        self.model = model
        self.config = cfg
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings,
                                 cfg.max_position_embeddings)
        self.pool = KVPool(
            cache.page_size, cache.num_pages,
            [(cfg.num_key_value_heads, cfg.head_dim)] * cfg.num_kv_layers,
            self.dtype, self.device,
        )
        self.kv = KVManager(cache.page_size, cache.num_pages, self.pool)
        self.states: StatePool | None = None  # hybrid targets: linear-attention state slots
        if isinstance(model, HybridCausalLM):
            blank = RecurrentStates.zeros(model.config, [1] * scheduler.max_running,
                                          self.device, self.dtype)
            self.states = StatePool(blank.conv, blank.recurrent, cache.state_snapshots)
        self.scheduler = Scheduler(scheduler, self.kv, self.states, cache.state_interval)
        self.drafter = drafter
        self.block_size = 1
        self.spec = spec
        draft_layers = None
        if drafter is not None:
            dcfg = drafter.config
            self.block_size = block_size
            draft_layers = self.pool.add_layers(
                [(dcfg.num_key_value_heads, dcfg.head_dim)] * dcfg.num_hidden_layers
            )
        self.runner = ModelRunner(model, self.pool, self.kv, drafter, draft_layers,
                                  prepared.decode, prepared.draft, self.states)
        self.detokenize = detokenize
        self.eos_ids = frozenset(cfg.eos_token_ids)
        # the shape of prefill costs (measure_prefill_cost), for the counterfactual of what
        # recomputing a cached prompt would take (SeqCounters.recompute_units)
        self.prefill_cost: PrefillCost | None = None
        self.slowdown = Slowdown()  # how much slower than at load the machine runs now
        self.counters = EngineCounters()
        self.lookup_stats = LookupStats(max(self.block_size - 1, 1))
        self._ids = itertools.count()
        self._seqs: dict[int, Sequence] = {}
        self._done: dict[int, Completion] = {}
        self._decoding = 0  # requests past their prompt in the current step

    @classmethod
    def from_dir(
        cls, path: str | Path, dtype: torch.dtype | None = None, device: str = "cpu",
        draft: str | Path | None = None, **kwargs,
    ) -> Engine:
        """Load the model at `path` and, if `draft` is given, the DFlash drafter there.
        No drafter is loaded implicitly: for the one a model directory carries, pass
        `draft=bundled_drafter_dir(path)` (engine.models.dflash)."""
        model = load_model(path, dtype=dtype, device=device)
        drafter = load_drafter(draft, model) if draft is not None else None
        return cls(model, drafter=drafter, **kwargs)

    # ---- requests -------------------------------------------------------------------------

    def submit(
        self,
        prompt_ids: Seq[int],
        params: SamplingParams = SamplingParams(),
        pin: bool = False,
        speculative: bool = True,
        trace: bool = False,
        constraint: TokenConstraint | None = None,
        reuse: bool = True,
        prediction: Seq[int] | None = None,
    ) -> int:
        """Queue a request; returns its sequence id. Raises on input that can never run.

        speculative=False decodes this request without the drafter even with one loaded;
        `prediction` (Predicted Outputs: the caller's guess of the output, e.g. a file to be
        edited) is verified as drafts while the output follows it, the drafter (if any)
        proposing from where it ends or diverges; the output is the same either way;
        trace=True records every drafted block in `counters.drafts`; a `constraint` (a grammar
        matcher at its start state) restricts every generated token, drafts included;
        reuse=False computes the whole prompt even where the prefix cache holds it (a hybrid
        target reuses a prefix only up to where an earlier sequence ended: its state is kept
        there)."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise RequestError("prompt is empty")
        vocab = self.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(prompt) >= self.max_model_len:
            raise ContextLengthError(
                f"prompt has {len(prompt)} tokens; the context holds {self.max_model_len} "
                "(prompt + at least one generated token)"
            )
        if params.stop and self.detokenize is None:
            raise RequestError("stop strings need a tokenizer; this engine has none")
        drafts = speculative and self.drafter is not None
        predicted = [int(t) for t in prediction or ()]
        if any(not 0 <= t < vocab for t in predicted):
            raise RequestError(f"prediction token ids are outside the vocabulary [0, {vocab})")
        block = self.block_size if drafts else PREDICTION_BLOCK if predicted else 1
        seq = Sequence(next(self._ids), prompt, params, self.max_model_len, pin=pin,
                       reuse=reuse, block_size=block)
        seq.drafts = drafts
        if drafts and self.spec.cost is not None:
            seq.draft_rows = self._first_rows()
            seq.block_size = seq.draft_rows + 1
        seq.prediction = predicted or None
        seq.counters.prediction_tokens = len(predicted)
        seq.constraint = constraint
        seq.counters.submitted_at = time.perf_counter()
        if trace:
            seq.counters.drafts = []
        # even with its whole prompt cached and every unpinned page evicted (and idle pins
        # released, where the layer above can)
        error = self.scheduler.never_fits(seq, len(prompt))
        while error is not None:
            if self.scheduler.relieve is None or not self.scheduler.relieve():
                raise error
            error = self.scheduler.never_fits(seq, len(prompt))
        if not params.greedy:
            seq.generator = make_generator(params.seed, self.device)
        self._seqs[seq.id] = seq
        self.scheduler.add(seq)
        return seq.id

    def abort(self, seq_id: int) -> None:
        """Stop a sequence now; what it computed stays cached, never pinned."""
        seq = self._seqs.get(seq_id)
        if seq is not None and seq.status is not Status.FINISHED:
            seq.finish_reason = "abort"
            self._finish(seq)

    def result(self, seq_id: int) -> Completion | None:
        """The completion of a finished sequence (removed once read)."""
        return self._done.pop(seq_id, None)

    def unpin(self, pin: Pin) -> None:
        self.kv.unpin(pin)

    def clear_cache(self) -> int:
        """Evict every cached page no live sequence or pin holds; returns pages freed."""
        return self.kv.evict(self.kv.stats()["pages_total"])

    def share_pin(self, pin: Pin) -> Pin:
        """Another pin on `pin`'s cached prefix (for a forked session)."""
        return self.kv.share(pin)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> dict[str, int]:
        return {**self.kv.stats(), "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting)}

    # ---- the loop ---------------------------------------------------------------------------

    def step(self) -> list[SeqUpdate]:
        t_step = time.perf_counter()
        items, failed = self.scheduler.schedule()
        updates = [self._finish(seq) for seq in failed]
        if not items:
            return updates
        self._decoding = sum(not item.seq.prefilling for item in items)
        for item in [item for item in items if item.verifies
                     and (item.seq.predicting or item.seq.lookup is not None)]:
            seq = item.seq
            if seq.predicting:
                at = len(seq.output_ids)
                error = self._propose(item, seq.prediction[at:at + item.num_tokens - 1],
                                      "prediction")
            else:
                error = self._propose(item, seq.lookup[:item.num_tokens - 1], "context")
            if error is not None:
                updates.append(self._fail(seq, error))
                items.remove(item)
        verify = [item for item in items if item.verifies and item.source == "drafter"]
        if verify:
            t0 = time.perf_counter()
            logits = self.runner.draft(verify, self.block_size,
                                       max(item.num_tokens for item in verify) - 1)
            # the drafts, and the drafter's probability of each (its softmax there) where step
            # costs choose how many to verify
            drafts, confidence = top1(logits, with_prob=self.spec.cost is not None)
            t_draft = time.perf_counter() - t0
            self.counters.draft_s += t_draft
            for item in verify:
                item.seq.counters.draft_compute_s += t_draft / len(verify)
            cost = self.spec.cost_at(self._decoding, verify[0].seq.num_tokens)
            if cost is not None:  # drafts the forward made: each item's block but the anchor
                rows = max(item.num_tokens for item in verify) - 1
                self.slowdown.add(t_draft, cost.draft[rows] * cost.plain_s)
            self.counters.draft_forwards += 1
            for i, item in enumerate(verify):
                n = item.num_tokens - 1
                if confidence is not None:  # verify what the drafter is confident enough of
                    # (under a grammar, the confidence of the drafter's own choice even where
                    # the grammar will propose another token: an overestimate there)
                    cost = item.cost = self.spec.cost_at(self._decoding, item.seq.num_tokens)
                    n = confident_length(confidence[i][:n], cost) - 1
                    item.num_tokens = n + 1
                if item.seq.constraint is None:
                    item.draft = drafts[i][:n]
                    continue
                t_grammar = time.perf_counter()
                try:
                    item.draft, item.masks = propose(item.seq.constraint, logits[i, :n].float())
                    item.seq.counters.grammar_s += time.perf_counter() - t_grammar
                except RequestError as e:
                    updates.append(self._fail(item.seq, e))
                    items.remove(item)
                    continue
                item.num_tokens = len(item.draft) + 1
        if not items:
            return updates
        t0 = time.perf_counter()
        out = self.runner.forward(items)
        t_forward = time.perf_counter() - t0
        self.counters.target_s += t_forward
        quiet = self._quiet_s(items)
        if quiet is not None:
            self.slowdown.add(t_forward, quiet)
        fed = sum(item.num_tokens for item in items)
        self.counters.steps += 1
        self.counters.target_forwards += 1
        if self.drafter is not None:
            self.counters.draft_context_tokens += sum(item.num_tokens for item in items)
        logits = out.logits
        if any(item.seq.constraint is not None for item in items):
            logits = logits.clone()  # masked in place below (out.logits is an inference tensor)
        judged: list[tuple[BatchItem, Rows]] = []
        for item, (row, count) in zip(items, out.rows):
            self._count(item, t_forward * item.num_tokens / fed)
            if self.states is not None and item.start < len(item.seq.prompt_ids):
                self._snapshot_prefill(item)
            if not count:
                continue
            seq = item.seq
            if seq.constraint is not None:
                try:
                    self._mask(item, logits[row:row + count])
                except RequestError as e:  # the sequence's constraint failed; nothing committed
                    updates.append(self._fail(seq, e))
                    continue
            draft = (item.draft or []) if item.verifies else []
            judged.append((item, Rows(row, draft, seq.params, seq.generator)))
        verdicts = judge(logits, [rows for _, rows in judged]) if judged else []
        for (item, rows), verdict in zip(judged, verdicts):
            try:
                updates.append(self._commit(item, rows.drafts, verdict))
            except RequestError as e:
                updates.append(self._fail(item.seq, e))
        self.counters.step_s += time.perf_counter() - t_step
        return updates

    def _propose(self, item: BatchItem, tokens: list[int],
                 source: Literal["prediction", "context"]) -> RequestError | None:
        """Fill a verify item's drafts with `tokens`, the caller's prediction or context drafts
        (cut by its grammar)."""
        seq = item.seq
        item.source = source
        if seq.constraint is None:
            item.draft = tokens
        else:
            t_grammar = time.perf_counter()
            try:
                item.draft, item.masks = follow(seq.constraint, tokens)
            except RequestError as e:
                return e
            seq.counters.grammar_s += time.perf_counter() - t_grammar
        item.num_tokens = len(item.draft) + 1
        return None

    def _snapshot_prefill(self, item: BatchItem) -> None:
        """A hybrid prefill chunk that ended its prompt or at a multiple of state_interval:
        its tokens go into the prefix cache, the state after them onto the node ending there
        (a later prompt sharing that prefix resumes from it)."""
        seq, end = item.seq, item.start + item.num_tokens
        interval = self.scheduler.state_interval  # where it ends prefill chunks
        if end < len(seq.prompt_ids) and not (interval and end % interval == 0):
            return
        assert self.states is not None and seq.kv is not None and seq.state_slot is not None
        if self.kv.cache_running(seq.kv, seq.prompt_ids):
            assert seq.kv.node is not None
            self.states.snapshot(seq.state_slot, seq.kv.node)

    def _count(self, item: BatchItem, forward_s: float) -> None:
        seq, c, n = item.seq, item.seq.counters, item.num_tokens
        item.forward_s = forward_s
        c.target_forwards += 1
        if self.drafter is not None:
            c.draft_context_tokens += n
        if item.start < len(seq.prompt_ids):
            c.prefill_tokens += n
            c.prefill_compute_s += forward_s
            self.counters.prefill_tokens += n
            cost = self.prefill_cost
            if cost is None or c.prefill_units is None:
                c.prefill_units = c.recompute_units = None
            else:
                c.prefill_units += cost.units(n, item.start)
                if item.start + n == len(seq.prompt_ids):  # what computing all of it costs
                    c.recompute_units = cost.chunked(
                        len(seq.prompt_ids), self.scheduler.config.max_batch_tokens)
        else:
            c.decode_tokens += n
            c.decode_compute_s += forward_s
            if item.verifies:
                c.verify_compute_s += forward_s
            self.counters.decode_tokens += n

    def _mask(self, item: BatchItem, logits: torch.Tensor) -> None:
        """Apply the sequence's grammar to its rows of the step's logits, in place: row k gets
        the allowed set after the first k drafts."""
        constraint = item.seq.constraint
        assert constraint is not None
        t_grammar = time.perf_counter()
        masks = item.masks if item.verifies else [constraint.allowed()]
        for k, mask in zip(range(logits.shape[0]), masks):
            logits[k] = masked(logits[k], mask)
        item.seq.counters.grammar_s += time.perf_counter() - t_grammar

    def _commit(self, item: BatchItem, draft: list[int], verdict: Verdict) -> SeqUpdate:
        """Append a verdict's tokens to the sequence and keep the KV of what is committed."""
        seq = item.seq
        constraint = seq.constraint
        tokens = draft[: verdict.accepted] + [verdict.bonus]
        if constraint is not None:
            t_grammar = time.perf_counter()
            tokens = tokens[: settle(constraint, len(draft), tokens)]
            seq.counters.grammar_s += time.perf_counter() - t_grammar
        if not seq.output_ids:
            seq.counters.first_token_at = time.perf_counter()
        kept = seq.append(tokens, self.eos_ids, self.detokenize)
        if constraint is not None and constraint.is_terminated() and seq.finish_reason is None:
            seq.finish_reason = "stop"
        # KV stays valid for the anchor and accepted drafts only (and never past the last token)
        self.kv.truncate(seq.kv, min(seq.kv.length, seq.num_tokens - 1))
        if self.states is not None and item.verifies:  # and the linear layers' state with it
            self.runner.settle(seq.id, seq.kv.length - item.start)
        update = SeqUpdate(seq.id, seq.output_ids[len(seq.output_ids) - kept:])
        seq.follow_prediction(kept)
        if not seq.predicting and not seq.drafts:
            seq.block_size = 1
        if item.verifies and item.source == "context":
            c = seq.counters
            c.lookups += 1
            c.lookup_tokens += len(draft)
            c.lookup_accepted += verdict.accepted
            c.lookup_committed += kept
            self._count_speculated(item, kept)
            self.lookup_stats.record(seq.lookup_match, len(draft), verdict.accepted)
            update.lookup_tokens = len(draft)
            self.counters.lookups += 1
            self.counters.lookup_tokens += len(draft)
            self.counters.lookup_accepted += verdict.accepted
        elif item.verifies and item.source == "drafter":
            c = seq.counters
            self._count_speculated(item, kept)
            c.draft_forwards += 1
            c.draft_tokens += len(draft)
            c.accepted_tokens += verdict.accepted
            c.acceptance_lengths.append(kept)
            if len(c.accepted_per_position) < self.block_size - 1:
                c.accepted_per_position.extend([0] * (self.block_size - 1))
            for k in range(verdict.accepted):
                c.accepted_per_position[k] += 1
            if c.drafts is not None:
                c.drafts.append(list(draft))
            update.draft_tokens, update.accepted_tokens = len(draft), verdict.accepted
            self.counters.draft_tokens += len(draft)
            self.counters.accepted_tokens += verdict.accepted
        if seq.drafts and not seq.predicting and self.spec.cost is not None:
            self._pace(seq, item, len(draft), verdict.accepted, kept)
        if seq.finish_reason is not None:
            update = self._finish(seq, update)
        return update

    def _count_speculated(self, item: BatchItem, kept: int) -> None:
        """A drafted or context-drafted verify step's time, and what plain decode steps for
        its `kept` tokens would have taken: their time at load (its step costs, one
        sequence's share), times how much slower the machine runs now."""
        c = item.seq.counters
        c.speculated_s += item.forward_s
        cost = item.cost or self.spec.cost_at(self._decoding, item.start)
        slowdown = self.slowdown.factor
        if cost is None or slowdown is None or c.plain_equivalent_s is None:
            c.plain_equivalent_s = None
        else:
            c.plain_equivalent_s += kept * cost.plain_s / cost.batch * slowdown

    def _quiet_s(self, items: list[BatchItem]) -> float | None:
        """What a forward over `items` took at load (step and prefill costs), if known."""
        total = 0.0
        for item in items:
            if item.start < len(item.seq.prompt_ids):
                if self.prefill_cost is None:
                    return None
                total += self.prefill_cost.units(item.num_tokens, item.start)
            else:
                cost = item.cost or self.spec.cost_at(self._decoding, item.start)
                if cost is None:
                    return None
                total += cost.verify[item.num_tokens - 1] * cost.plain_s / cost.batch
        return total

    def _first_rows(self) -> int:
        """Drafts a request proposes at first, and at least after halving (SpecConfig)."""
        return min(self.spec.draft_rows, self.block_size - 1)

    def _pace(self, seq: Sequence, item: BatchItem, drafted: int, accepted: int,
              kept: int) -> None:
        """The next step of a request the drafter serves, with step costs (SpecConfig): how
        many drafts it proposes, or a plain step while it backs off."""
        spec = self.spec
        rows = seq.draft_rows  # the drafter's rows this step (if it ran)
        if item.verifies and item.source == "drafter":  # it ran (its drafts may all be cut)
            cost = item.cost or spec.cost_at(self._decoding, item.start)
            assert cost is not None
            spent = cost.draft[rows] + cost.verify[drafted]
            seq.draft_rate = (seq.draft_rate + kept / spent) / 2
            if kept < spent:  # plain steps made more
                seq.cooldown, seq.backoff = seq.backoff, min(2 * seq.backoff, spec.max_backoff)
            else:
                seq.backoff = 1
            if drafted == rows and accepted == drafted:
                seq.draft_rows = min(2 * rows + 1, self.block_size - 1)
            elif drafted < rows:
                seq.draft_rows = max(self._first_rows(), (rows - 1) // 2)
        elif seq.cooldown:
            seq.cooldown -= 1
        seq.block_size = 1 if seq.cooldown else seq.draft_rows + 1
        if spec.lookup and seq.finish_reason is None and item.start >= len(seq.prompt_ids):
            self._look_up(seq)  # (not after the prompt's last chunk: its index is built later,
            #                    out of the time to the first token)

    def _look_up(self, seq: Sequence) -> None:
        """Context drafts for the next step (engine.lookup), where the verify of those worth
        verifying is expected to commit more per unit of time than the step planned (the
        drafter's, by its recent drafted steps; or a plain one while it backs off)."""
        if seq.index is None:
            seq.index = ContextIndex(seq.tokens)
        else:
            seq.index.extend(seq.output_ids[len(seq.index.tokens) - len(seq.prompt_ids):])
        seq.lookup = None
        tokens, match = seq.index.propose(min(self.block_size, seq.budget - seq.num_tokens) - 1)
        if not tokens:
            return
        cost = self.spec.cost_at(self._decoding, seq.num_tokens)
        assert cost is not None
        drafts, rate = self.lookup_stats.plan(match, len(tokens), cost)
        if drafts and rate > (1.0 if seq.cooldown else seq.draft_rate):
            seq.lookup, seq.lookup_match = tokens[:drafts], match
            seq.block_size = drafts + 1

    def _fail(self, seq: Sequence, error: Exception) -> SeqUpdate:
        """Finish `seq` with an error, keeping (cached) only the KV of its committed tokens."""
        if seq.kv is not None:
            self.kv.truncate(seq.kv, min(seq.kv.length, seq.num_tokens - 1))
        seq.error, seq.finish_reason = error, "error"
        return self._finish(seq)

    def _finish(self, seq: Sequence, update: SeqUpdate | None = None) -> SeqUpdate:
        pin = None
        if seq.kv is not None:
            self.kv.cache(seq.kv, seq.tokens)
            ok = seq.error is None and seq.finish_reason != "abort"
            if self.states is not None and ok and seq.state_slot is not None and seq.kv.length:
                assert seq.kv.node is not None  # the state after the cached tokens, kept there
                self.states.snapshot(seq.state_slot, seq.kv.node)
            if seq.pin and ok:
                pin = self.kv.pin(seq.kv)
            self.kv.release(seq.kv)
        self.scheduler.remove(seq)
        seq.status = Status.FINISHED
        seq.counters.finished_at = time.perf_counter()
        self.counters.cached_tokens += seq.counters.cached_tokens
        del self._seqs[seq.id]
        self._done[seq.id] = Completion(
            seq.id, seq.prompt_ids, seq.output_ids, seq.finish_reason or "abort", seq.counters,
            pin, seq.error,
        )
        update = update or SeqUpdate(seq.id, [])
        update.finished, update.finish_reason, update.error = True, seq.finish_reason, seq.error
        return update

    # ---- convenience ------------------------------------------------------------------------

    def generate(
        self,
        prompts: Iterable[Seq[int]],
        params: SamplingParams | Seq[SamplingParams] = SamplingParams(),
        **submit_kwargs,
    ) -> list[Completion]:
        """Run prompts to completion (batched together); raises the first request's error.
        Keyword arguments go to `submit` (pin, speculative, trace)."""
        prompts = list(prompts)
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [self.submit(p, sp, **submit_kwargs) for p, sp in zip(prompts, plist)]
        pending = set(ids)
        while pending:
            pending -= {u.seq_id for u in self.step() if u.finished}
        results = [self.result(i) for i in ids]
        for r in results:
            if r.error is not None:
                raise r.error
        return results

    def measure_step_cost(self, context: int = 256, steps: int = 8, batch: int = 1) -> StepCost:
        """A plain decode step of `batch` requests after a `context`-token prompt each (shorter
        where the model's context is), and the cost of verifying 2, 4, 8 .. block_size tokens
        each and of the drafter forwards for them in units of it (linear in between), measured
        on synthetic requests of this engine. Call it before serving: it needs an idle engine
        and clears the prefix cache."""
        assert self.drafter is not None, "needs a speculative engine"
        lengths = [k for k in (1, 2, 4, 8) if k < self.block_size] + [self.block_size]
        context, target, draft = self._time_blocks(context, lengths, steps, batch)
        plain = target[0]
        per_k = lambda ys: tuple(float(y) / plain for y in   # noqa: E731
                                 _interpolate(lengths, ys, range(1, self.block_size + 1)))
        return StepCost(per_k(draft), per_k(target), plain, context, batch)

    def measure_prefill_cost(self, tokens: int = 256, context: int = 1024,
                             rounds: int = 3) -> PrefillCost:
        """The shape of prefill costs (PrefillCost), fitted to the median times of three
        forwards, interleaved over `rounds`: `tokens` prompt tokens and 16 computed after none
        cached, and `tokens` after `context` cached (shorter where the model's context is).
        Needs an idle engine; clears the prefix cache."""
        assert not self.has_work(), "needs an idle engine"
        page = self.kv.page_size
        room = (self.kv.max_reservable() - 2) * page  # tokens one request can hold here
        n1 = min(tokens, self.scheduler.config.max_batch_tokens, self.max_model_len // 4,
                 room // 2)
        if n1 < 2:
            raise KVPoolExhaustedError("measuring prefill needs more free KV pages")
        n2 = max(1, min(16, n1 // 4))
        context = max(0, min(context, self.max_model_len - n1 - 2, room - n1)) // page * page
        cases = [(n1, 0), (n2, 0), (n1, context)]
        times: list[list[float]] = [[] for _ in cases]
        starts = [0] * len(cases)
        for r in range(rounds):
            for i, (n, start) in enumerate(cases):
                prompt = [(13 * j + 7 * r + 5 * i + 1) % self.config.vocab_size
                          for j in range(start + n)]
                if start:  # the context, cached by a request of its own
                    self.generate([prompt[:start]], SamplingParams(max_new_tokens=1))
                seq_id = self.submit(prompt, SamplingParams(max_new_tokens=1, ignore_eos=True))
                t0 = self.counters.target_s
                while seq_id not in self._done:
                    self.step()
                times[i].append(self.counters.target_s - t0)
                starts[i] = self.result(seq_id).counters.cached_tokens
                self.clear_cache()
        # (starts[2]: the context that was cached; a hybrid target may reuse less)
        return PrefillCost.fit(n1, n2, starts[2], *(statistics.median(t) for t in times))

    def _time_blocks(
        self, context: int, blocks: list[int], steps: int, batch: int = 1
    ) -> tuple[int, list[float], list[float]]:
        """`batch` synthetic requests: a `context`-token prompt each, then `steps` rounds of one
        step at each verify length in `blocks`, longest first, the plain step (length 1) after
        an untimed plain step. Interleaved, so that a shared machine's load drift falls on
        every length alike; in that order, so that the plain step, the unit of every cost,
        is timed as plain decoding pays it: a long verify slows the next few steps (on a
        2-core Xeon plain steps after a 16-token verify took 1.59, 1.48, 1.34 ms, then a
        steady 1.15), which made verifies look 13-31% cheaper than the decode loop pays. Returns
        the context used and the median target and drafter seconds per step of each length;
        leaves the engine idle with an empty cache."""
        assert not self.has_work(), "needs an idle engine"
        budget = steps * (sum(blocks) + 1) + 1
        context = min(context, self.max_model_len - budget)  # a short model: a shorter prompt
        if context < 1:
            raise ContextLengthError(f"measuring needs more than {budget} positions")
        page = self.kv.page_size
        if batch * (-(-(context + budget) // page) + 1) > self.kv.max_reservable():
            raise KVPoolExhaustedError(f"measuring {batch} requests needs more KV pages than "
                                       "the pool can free")
        vocab = self.config.vocab_size
        spec, self.spec = self.spec, replace(self.spec, cost=None, batch_costs=(), long_cost=None)
        ids = [self.submit([(7 * i + 11 * r + 3) % vocab for i in range(context)],
                           SamplingParams(max_new_tokens=budget, ignore_eos=True),
                           reuse=False) for r in range(batch)]
        seqs = [self._seqs[i] for i in ids]
        while any(seq.prefilling for seq in seqs) or len(self.scheduler.running) < batch:
            self.step()  # admit and prefill them all
        target: list[list[float]] = [[] for _ in blocks]
        draft: list[list[float]] = [[] for _ in blocks]
        c = self.counters
        for _ in range(steps):
            for i, k in reversed(list(enumerate(blocks))):
                for seq in seqs:
                    seq.block_size = k
                if k == 1:
                    self.step()
                t0, d0 = c.target_s, c.draft_s
                self.step()
                target[i].append(c.target_s - t0)
                draft[i].append(c.draft_s - d0)
        for seq_id in ids:
            self.abort(seq_id)
            self.result(seq_id)
        self.clear_cache()
        self.spec = spec
        return (context, [statistics.median(t) for t in target],
                [statistics.median(d) for d in draft])


def _interpolate(xs: list[int], ys: list[float], at: Iterable[int]) -> list[float]:
    """Piecewise-linear y at each point of `at` through the points (xs, ys), xs increasing."""
    out = []
    for x in at:
        i = max(j for j in range(len(xs)) if xs[j] <= x)
        if xs[i] == x or i == len(xs) - 1:
            out.append(ys[i])
        else:
            t = (x - xs[i]) / (xs[i + 1] - xs[i])
            out.append(ys[i] + t * (ys[i + 1] - ys[i]))
    return out
