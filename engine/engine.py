"""The synchronous engine loop: submit / abort / step, one owner thread.

Each `step()` reads as schedule -> propose -> forward -> judge -> commit: the scheduler picks a
batch (decode tokens, verify blocks and prefill chunks together); the draft sources
(engine.drafts) fill the verify items' drafts, as the speculation policy (engine.policy)
assigned them; the runner runs one target forward; engine.spec judges every item's rows; the
accepted tokens are appended, the KV (and a hybrid target's state, engine.states) kept up to
them, and engine.accounting counts it all. A finished sequence's prompt AND generated tokens
go into the radix prefix cache, optionally pinned for a live session, so the next turn of a
conversation prefills only what is new.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence as Seq

import torch

from agentflash.kernels import cpu_ops
from .accounting import Accounting, Completion, EngineCounters, SeqUpdate
from .batch import BatchItem
from .calibration import measure_prefill_cost, step_costs
from .config import CacheConfig, PrefillCost, SchedulerConfig, SpecConfig
from .constraint import TokenConstraint, mask_rows_, nothing_allowed, settle, settle_greedy
from .cpu.fastpath import Prepared, prepare
from .drafter_runner import DrafterRunner, NoDrafter
from .drafts import ContextDrafts, DraftSource, DrafterDrafts, PredictionDrafts
from .errors import ContextLengthError, KVPoolExhaustedError, RequestError
from .graphs import GraphBuckets, graph_forwards
from .kv.manager import KVManager, Pin
from .kv.pool import KVPool
from .kv.state_pool import StatePool
from .models.dflash import DFlashDraftModel, load_drafter
from .models.gated_deltanet import RecurrentStates
from .models.loader import load_model
from .models.qwen3 import CausalLM
from .models.qwen3_5 import HybridCausalLM
from .policy import Speculation, SpeculationPolicy
from .runner import ModelRunner, RunnerOutput
from .sampler import SamplingParams, make_generator
from .scheduler import Scheduler
from .sequence import Sequence, Status
from .spec import Rows, Verdict, judge
from .states import LinearStates, NoStates, SequenceStates

__all__ = ["Completion", "Engine", "EngineCounters", "SeqUpdate"]


class Engine:
    """Requests in, tokens out, one step at a time, on one target model (and optional drafter).
    A hybrid target (`HybridCausalLM`, Qwen3.5) runs eager (engine.cpu.fastpath leaves it as
    loaded), its linear-attention states kept by engine.states.LinearStates."""

    def __init__(
        self,
        model: CausalLM | HybridCausalLM,
        cache: CacheConfig = CacheConfig(),
        scheduler: SchedulerConfig = SchedulerConfig(),
        max_model_len: int | None = None,
        detokenize: Callable[[list[int]], str] | None = None,
        drafter: DFlashDraftModel | None = None,
        spec: SpecConfig = SpecConfig(),
        speculation: Speculation = "auto",
        fast_path: bool = True,
        quantize: str | None = None,
        compile: bool | None = None,
        measure_prefill: bool = False,
        graphs: bool | GraphBuckets = False,
    ):
        """speculation (with a drafter): "auto" verifies what pays by step costs (`spec`'s, or
        measured here when it has none: engine.calibration, a few seconds); "always" verifies
        full blocks (engine.policy). fast_path: prepare the models for inference on this
        machine, in place (engine.cpu.fastpath: faster; the models stay usable for inference
        only); False keeps them as given. compile: with the fast path on CPU in bfloat16,
        compile the decode/verify forward ahead of time (engine.cpu.compiled; cached on disk;
        None: unless $AGENTFLASH_COMPILE=0). quantize="int8": int8 weights for the target's
        layers (CPU, bfloat16; other numbers than the checkpoint's, so only when asked for).
        measure_prefill: measure the shape of prefill costs, which prices the prefix cache's
        savings (SeqCounters.recompute_units; agentflash.usage). graphs (a dense target): run
        decode rows and verify blocks from graphs captured per bucket (engine.graphs: CUDA
        graphs on CUDA; on CPU the same bookkeeping replayed eagerly); True takes buckets up
        to the scheduler's batch and the model's length."""
        cfg = model.config
        if quantize is not None and not fast_path:
            raise ValueError("quantize needs the fast path (fast_path=True)")
        if speculation not in ("auto", "always"):
            raise ValueError(f"speculation must be 'auto' or 'always', got {speculation!r}")
        if speculation == "always" and spec.cost is not None:
            raise ValueError("step costs are for speculation='auto'; 'always' verifies full "
                             "blocks")
        t0 = time.perf_counter()
        block_size = 1
        if drafter is not None:
            block_size = spec.block_size or drafter.config.block_size
            SpecConfig(block_size)  # validates a checkpoint's own block size too
        prepared = (prepare(model, drafter, quantize, compile, block_size, cache.page_size,
                            scheduler.max_batch_tokens) if fast_path else Prepared([]))
        self.fast_paths = prepared.applied
        self.fast_path_seconds = prepared.seconds
        self.fast_path_s = time.perf_counter() - t0  # preparing the models (once, at start)
        self.model = model
        self.config = cfg
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings,
                                 cfg.max_position_embeddings)
        decode, draft = prepared.decode, prepared.draft
        if graphs:
            if decode is not None:
                raise ValueError(f"graphs replace the decode forward the fast path made "
                                 f"({decode.kind}); pass fast_path=False with graphs")
            decode, draft = graph_forwards(model, drafter, graphs, block_size, cache,
                                           scheduler.max_running, self.max_model_len)
        self.pool = KVPool(
            cache.page_size, cache.num_pages + (1 if graphs else 0),  # + the graphs' scratch
            [(cfg.num_key_value_heads, cfg.head_dim)] * cfg.num_kv_layers,
            self.dtype, self.device,
        )
        self.kv = KVManager(cache.page_size, cache.num_pages, self.pool)
        self.states: SequenceStates = NoStates()
        if isinstance(model, HybridCausalLM):  # linear-attention states, in slots of a pool
            blank = RecurrentStates.zeros(model.config, [1] * scheduler.max_running,
                                          self.device, self.dtype)
            self.states = LinearStates(
                StatePool(blank.conv, blank.recurrent, cache.state_snapshots), self.kv,
                cache.state_interval, scheduler.max_running)
        self.scheduler = Scheduler(scheduler, self.kv, self.states)
        self.drafter = drafter
        self.block_size = block_size
        drafts: DrafterRunner | None = None
        if drafter is not None:  # its context K/V in layers of the same pool
            drafts = DrafterRunner(drafter, model, self.pool, self.kv, draft)
        self.runner = ModelRunner(model, self.pool, self.kv, decode,
                                  drafts or NoDrafter(), self.states)
        # every forward a compiled program on the CPU kernels (prefill chunks too, whose fused
        # code is serial): torch's own ops are left the step's small ones (own_thread)
        self._kernels_only = (
            decode is not None and decode.kind == "compiled" and decode.takes_prefill
            and self.states.chunks_apart
            and (drafts is None or (drafts.forward is not None
                                    and drafts.forward.kind == "compiled")))
        self.detokenize = detokenize
        self.eos_ids = frozenset(cfg.eos_token_ids)
        self.policy = SpeculationPolicy(spec, block_size)
        self.accounting = Accounting(self.policy, drafter is not None,
                                     scheduler.max_batch_tokens)
        self.counters: EngineCounters = self.accounting.counters
        # in the order a step asks them: a prediction's and context drafts cost no forward
        self.sources: dict[str, DraftSource] = {
            "prediction": PredictionDrafts(self.policy),
            "context": ContextDrafts(self.policy, self.accounting),
        }
        if drafts is not None:
            self.sources["drafter"] = DrafterDrafts(drafts, self.policy, self.accounting)
        self._ids = itertools.count()
        self._seqs: dict[int, Sequence] = {}
        self._done: dict[int, Completion] = {}
        if drafter is not None and speculation == "auto" and spec.cost is None:
            self.policy.spec = step_costs(self, spec)
        if measure_prefill:
            try:
                self.accounting.prefill_cost = measure_prefill_cost(self)
            except KVPoolExhaustedError:  # a pool too small to measure in: savings unknown
                pass

    @property
    def prefill_cost(self) -> PrefillCost | None:
        """The shape of prefill costs, if measured (`measure_prefill`)."""
        return self.accounting.prefill_cost

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
        predicted = [int(t) for t in prediction or ()]
        if any(not 0 <= t < vocab for t in predicted):
            raise RequestError(f"prediction token ids are outside the vocabulary [0, {vocab})")
        seq = Sequence(next(self._ids), prompt, params, self.max_model_len, pin=pin,
                       reuse=reuse, prediction=predicted or None)
        self.policy.start(seq, drafts=speculative and "drafter" in self.sources)
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

    def own_thread(self) -> None:
        """Called on the thread that steps this engine from now on (the runtime's). Where every
        forward is a compiled program on the CPU kernels, their calls split work over torch's
        thread count by claiming chunks, and torch's own ops (the step's small ones) run on
        this thread alone (kernels.cpu_ops.set_engine_thread): on a busy machine a forward
        slows in proportion to the cores taken from it, not by the OS's time slices."""
        if self._kernels_only:
            cpu_ops.set_engine_thread(torch.get_num_threads())

    def stats(self) -> dict[str, int]:
        return {**self.kv.stats(), "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting)}

    def sequence(self, seq_id: int) -> Sequence:
        """A running or waiting sequence."""
        return self._seqs[seq_id]

    # ---- the loop ---------------------------------------------------------------------------

    def step(self) -> list[SeqUpdate]:
        """Schedule a batch; let the draft sources propose for its verify items; run one
        target forward over it; judge each item's rows; commit what they accept."""
        t_step = time.perf_counter()
        items, failed = self.scheduler.schedule()
        updates = [self._finish(seq) for seq in failed]
        decoding = sum(not item.seq.prefilling for item in items)
        items = self._propose(items, decoding, updates)
        if not items:
            return updates
        t0 = time.perf_counter()
        out = self.runner.forward(items)
        self.accounting.forward(items, time.perf_counter() - t0, decoding)
        self._share_prefilled(items)
        logits, judged = self._rows(items, out, updates)
        verdicts = judge(logits, [rows for _, rows in judged]) if judged else []
        for (item, rows), verdict in zip(judged, verdicts):
            try:
                updates.append(self._commit(item, rows, verdict, logits, decoding))
            except RequestError as e:
                updates.append(self._fail(item.seq, e))
        self.counters.step_s += time.perf_counter() - t_step
        return updates

    def _share_prefilled(self, items: list[BatchItem]) -> None:
        """Offer the prompt computed so far by each prefill chunk of the step to the prefix
        cache at once, not when its sequence finishes: a request sharing the prefix, admitted
        from now on (the scheduler holds one back while its prefix is being prefilled), reuses
        it. Not for hybrid targets, which resume only where a state snapshot was taken."""
        if self.states.snapshots_only:
            return
        for item in items:
            seq = item.seq
            if item.start < len(seq.prompt_ids) and seq.kv is not None:
                self.kv.cache_running(seq.kv, seq.tokens)

    def _propose(self, items: list[BatchItem], decoding: int,
                 updates: list[SeqUpdate]) -> list[BatchItem]:
        """Each draft source fills the drafts of the verify items the policy gives it; a
        request whose grammar fails there finishes with the error. Returns the items to run."""
        verify = [item for item in items if item.verifies]
        if not verify:
            return items
        for item in verify:
            item.source = self.policy.source(item.seq)
        for source in self.sources.values():
            mine = [item for item in verify if item.source == source.name]
            for item, error in source.propose(mine, decoding) if mine else ():
                updates.append(self._fail(item.seq, error))
                items.remove(item)
        return items

    def _rows(self, items: list[BatchItem], out: RunnerOutput, updates: list[SeqUpdate]
              ) -> tuple[torch.Tensor, list[tuple[BatchItem, Rows]]]:
        """The step's logits (a sampling request's rows masked by its grammar; greedy ones are
        checked at commit, engine.constraint.settle_greedy) and the rows each sampling item is
        judged by."""
        logits = out.logits
        if any(item.seq.constraint is not None and not item.seq.params.greedy
               for item in items):
            logits = logits.clone()  # masked in place below (out.logits is an inference tensor)
        judged: list[tuple[BatchItem, Rows]] = []
        masked: list[tuple[BatchItem, int, list[torch.Tensor]]] = []
        for item, (row, count) in zip(items, out.rows):
            seq = item.seq
            if item.start < len(seq.prompt_ids):
                self.states.prefilled(item)
            if not count:
                continue
            if seq.constraint is not None and not seq.params.greedy:
                masks = item.masks if item.verifies else None
                if masks is None:
                    t_grammar = time.perf_counter()
                    masks = [seq.constraint.allowed()]
                    seq.counters.grammar_s += time.perf_counter() - t_grammar
                filled = [m for m in masks[:count] if m is not None]
                assert len(filled) == count  # a sampled row's drafts were walked with masks
                masked.append((item, row, filled))
            draft = (item.draft or []) if item.verifies else []
            judged.append((item, Rows(row, draft, seq.params, seq.generator,
                                      item.q if item.verifies else None)))
        if masked:
            failed = {id(masked[b][0]) for b in self._mask(logits, masked)}
            for item, _ in judged:
                if id(item) in failed:  # its grammar failed; nothing committed
                    updates.append(self._fail(item.seq, nothing_allowed()))
            judged = [(item, rows) for item, rows in judged if id(item) not in failed]
        return logits, judged

    @staticmethod
    def _mask(logits: torch.Tensor, masked: list[tuple[BatchItem, int, list[torch.Tensor]]]
              ) -> list[int]:
        """Apply the grammars to their rows of the step's logits, in place (a verify item's row
        k gets the allowed set after its first k drafts), in one call; each request's grammar
        time is its share by rows. Returns the indices into `masked` whose grammar failed."""
        t_grammar = time.perf_counter()
        failed = mask_rows_(logits, [(row, masks) for _, row, masks in masked])
        share = (time.perf_counter() - t_grammar) / sum(len(m) for _, _, m in masked)
        for item, _, masks in masked:
            item.seq.counters.grammar_s += share * len(masks)
        return failed

    def _commit(self, item: BatchItem, rows: Rows, verdict: Verdict, logits: torch.Tensor,
                decoding: int) -> SeqUpdate:
        """Append a verdict's tokens to the sequence (under a grammar, as it settles them),
        keep the KV of what is committed, count it, and plan the sequence's next step."""
        seq, draft = item.seq, rows.drafts
        constraint = seq.constraint
        tokens = draft[: verdict.accepted] + [verdict.bonus]
        if constraint is not None:
            t_grammar = time.perf_counter()
            if seq.params.greedy:
                accepted, tokens = settle_greedy(
                    constraint, draft, verdict.accepted, verdict.bonus,
                    logits[rows.start:rows.start + len(draft) + 1],
                    item.masks if item.verifies else None)
                verdict = verdict._replace(accepted=accepted)
            else:
                tokens = tokens[: settle(constraint, len(draft), tokens)]
            seq.counters.grammar_s += time.perf_counter() - t_grammar
        if not seq.output_ids:
            seq.counters.first_token_at = time.perf_counter()
        kept = seq.append(tokens, self.eos_ids, self.detokenize)
        if constraint is not None and constraint.is_terminated() and seq.finish_reason is None:
            seq.finish_reason = "stop"
        # KV stays valid for the anchor and accepted drafts only (and never past the last token)
        self.kv.truncate(seq.kv, min(seq.kv.length, seq.num_tokens - 1))
        if item.verifies:  # and a hybrid's linear-attention state with it
            self.states.settle(seq.id, seq.kv.length - item.start)
        update = SeqUpdate(seq.id, seq.output_ids[len(seq.output_ids) - kept:])
        seq.follow_prediction(kept)
        if item.verifies:
            self.sources[item.source].record(item, verdict, kept, update)
        self.policy.after(item, len(draft), verdict.accepted, kept, decoding)
        if seq.finish_reason is not None:
            update = self._finish(seq, update)
        return update

    def _fail(self, seq: Sequence, error: Exception) -> SeqUpdate:
        """Finish `seq` with an error."""
        seq.error, seq.finish_reason = error, "error"
        return self._finish(seq)

    def _finish(self, seq: Sequence, update: SeqUpdate | None = None) -> SeqUpdate:
        """End `seq`, keeping (cached) only the KV of its committed tokens: a step that failed
        midway (a forward that raised) may have extended it past them."""
        pin = None
        if seq.kv is not None:
            self.kv.truncate(seq.kv, min(seq.kv.length, seq.num_tokens - 1))
            self.kv.cache(seq.kv, seq.tokens)
            ok = seq.error is None and seq.finish_reason != "abort"
            if ok:
                self.states.finished(seq)
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
