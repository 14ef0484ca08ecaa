"""Runtime: loads a model (and its drafter), owns the engine on one background thread, and
bridges the engine's synchronous step loop to async code (asyncio or trio, through anyio).

The engine thread is the only code that touches the engine. Everything else talks to it through
`_call` (run a function on the engine thread and wait for its result) and `Generation` (one
request: submitted on the engine thread, its per-step updates pushed back to the event loop that
waits for them). Any number of agents share one runtime; their requests are batched together.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, TypeVar

import anyio
import anyio.lowlevel
import torch

from agentflash.engine.config import CacheConfig, SchedulerConfig, SpecConfig
from agentflash.engine.constraint import TokenConstraint
from agentflash.engine.device import resolve_device, resolve_dtype
from agentflash.engine.engine import Completion, Engine, SeqUpdate
from agentflash.engine.kv.manager import Pin
from agentflash.engine.models.dflash import load_drafter
from agentflash.engine.models.loader import load_model
from agentflash.engine.policy import Speculation
from agentflash.engine.sampler import SamplingParams

from .chat import ChatFormat
from .embedded import model_drafter_dir, resolve_model
from .errors import AgentClosedError, CheckpointError
from .history import ReplyMemory
from .remote import RemoteRuntime
from .structured import GrammarCompiler
from .telemetry import RunLog
from .tokenizer import load_tokenizer
from .usage import Pricing

T = TypeVar("T")

class _Waker:
    """Wakes one task of the event loop it was made in, from any thread, without blocking."""

    def __init__(self) -> None:
        # anyio's token holds the running loop: an asyncio loop, or a TrioToken under trio
        loop = anyio.lowlevel.current_token().native_token
        if isinstance(loop, asyncio.AbstractEventLoop):
            self._call_soon = loop.call_soon_threadsafe
        else:
            self._call_soon = loop.run_sync_soon  # type: ignore[attr-defined]
        self._event = anyio.Event()

    def notify(self) -> None:
        try:
            self._call_soon(self._set)
        except RuntimeError:  # the event loop is gone: nobody is waiting any more
            pass

    def _set(self) -> None:
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()
        self._event = anyio.Event()


class Generation:
    """One request in flight: iterate it for `SeqUpdate`s; `completion` once it finished.

    Made by `Runtime.generate` inside a task; `cancel()` (also called when the iterating task
    is cancelled) aborts the sequence on the engine thread, releasing what it held."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self._waker = _Waker()
        self._updates: collections.deque[SeqUpdate] = collections.deque()
        self.seq_id: int | None = None
        self.error: BaseException | None = None    # submit failed (raised by iteration)
        self.completion: Completion | None = None
        self._done = False

    # engine thread -------------------------------------------------------------------------
    def _push(self, update: SeqUpdate | None, completion: Completion | None = None,
              error: BaseException | None = None) -> None:
        if update is not None:
            self._updates.append(update)
        if completion is not None or error is not None:
            self.completion, self.error, self._done = completion, error, True
        self._waker.notify()

    # event loop ------------------------------------------------------------------------------
    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> SeqUpdate:
        while True:
            if self._updates:
                return self._updates.popleft()
            if self._done:
                if self.error is not None:
                    raise self.error
                raise StopAsyncIteration
            try:
                await self._waker.wait()
            except BaseException:
                self.cancel()
                raise

    def cancel(self) -> None:
        """Abort the request (no-op once finished)."""
        if not self._done and not self._runtime._closed:
            self._runtime._post(lambda: self._runtime._abort(self))


def _off_this_thread(fn: Callable[[], T]) -> T:
    """fn() run on a new thread, which exits before this returns; its exception is re-raised.

    Why: torch's CPU ops run in parallel on libgomp (OpenMP), which gives every thread that runs
    a parallel op a team of worker threads. While more than one team exists, the workers of all
    of them stop spin-waiting between ops and sleep instead, and every op pays a wake-up: the
    embedded model's decode step took 10-12 ms on the engine thread instead of 6.8 (2 cores)
    once the main thread had run one matmul. A team goes away with its thread, so work done
    here leaves the engine thread's team the only one. (Torch work the application itself runs
    on another thread brings the slowdown back while that thread lives.)"""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as e:
            error.append(e)

    thread = threading.Thread(target=run, name="agentflash-load")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


class Runtime:
    """A loaded model + drafter served by one engine thread. Use `Runtime.load(...)`."""

    clock: Callable[[], float] = staticmethod(time.monotonic)
    """What session TTLs are measured with (a test sets a fake one)."""

    def __init__(self, engine: Engine, tokenizer: Any, model_dir: Path | None = None,
                 drafter_dir: Path | None = None, session_ttl: float | None = None,
                 pricing: Pricing | None = None, log: str | Path | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.drafter_dir = drafter_dir
        self.model_name = model_dir.name if model_dir is not None else "model"
        self.session_ttl = session_ttl
        self.eos_ids = frozenset(engine.config.eos_token_ids)
        eos = tokenizer.eos_token_id
        self.chat = ChatFormat(tokenizer, eos if eos is not None else min(self.eos_ids))
        self.eos_ids |= {self.chat.eos_token_id}
        # the exact tokens of every reply, for clients that resend whole histories
        self.replies = ReplyMemory(self.chat)
        self.grammars = GrammarCompiler(tokenizer, engine.config.vocab_size, sorted(self.eos_ids))
        self.target_params = sum(p.numel() for p in engine.model.parameters())
        self.draft_params = (sum(p.numel() for p in engine.drafter.parameters())
                             if engine.drafter is not None else 0)
        self.pricing = pricing
        self.log = RunLog(log) if log is not None else None
        self._inbox: collections.deque[Callable[[], None]] = collections.deque()
        self._wake = threading.Condition()
        self._live: dict[int, Generation] = {}
        # pins with a TTL: id(pin) -> (pin, expires at, last used); released when they expire,
        # and the longest idle first when a request needs their pages
        self._pins: dict[int, tuple[Pin, float, float]] = {}
        self._closed = False
        engine.scheduler.relieve = self._release_idlest  # idle sessions give way to requests
        self._thread = threading.Thread(target=self._loop, name="agentflash-engine", daemon=True)
        self._thread.start()

    @classmethod
    def load(
        cls,
        model: str | Path | None = None,
        draft: str | Path | bool | None = None,
        device: str = "auto",
        dtype: str | torch.dtype | None = None,
        *,
        cache: CacheConfig | None = None,
        scheduler: SchedulerConfig = SchedulerConfig(),
        block_size: int | None = None,
        session_ttl: float | None = None,
        pricing: Pricing | None = None,
        log: str | Path | None = None,
        speculation: Speculation = "auto",
        quantize: str | None = None,
        compile: bool | None = None,
        graphs: bool = False,
    ) -> Runtime:
        """Load a model directory (None: the embedded default) and its drafter.

        draft=None: the model's own drafter/ if it has one; False: no speculation; a path: that
        DFlash checkpoint. cache=None sizes the KV pool for 16 full contexts. session_ttl
        (seconds): an idle agent's pinned KV becomes evictable after that long. pricing: what
        compute or tokens cost (`Usage.cost`); log: a JSONL run log every agent writes to.
        speculation="auto": each step verifies as many drafts as commit the most tokens per unit
        of time given the drafter's confidence in them and the step costs measured at load,
        and a request whose drafted steps do not pay decodes token by token for a while,
        longer each time (same output either way); "always": every step verifies a full
        block. quantize="int8": int8 weights for
        the target's layers (CPU, bfloat16; engine.cpu.fastpath). compile: the decode
        step and the drafter compiled ahead of time on CPU in bfloat16 (engine.cpu.compiled; the
        first load on a machine compiles, ~1 min at 11m, later ones load from the disk cache;
        None: unless $AGENTFLASH_COMPILE=0). graphs: on CUDA, decode and verify steps replayed
        from CUDA graphs captured per bucket (engine.graphs; not yet run on a GPU).

        Loading and the step-cost measurements run on a thread of their own that then exits
        (`_off_this_thread`), so the calling thread (usually the event loop's) never runs a
        parallel torch op."""
        return _off_this_thread(lambda: cls._load(
            model, draft, device, dtype, cache, scheduler, block_size, session_ttl, pricing, log,
            speculation, quantize, compile, graphs))

    @staticmethod
    def connect(base_url: str, model: str | None = None, api_key: str | None = None,
                **options: Any) -> RemoteRuntime:
        """The Agent-facing surface of `load`, over an OpenAI-compatible server (vLLM, SGLang,
        `agentflash serve`): an `Agent` takes the returned `RemoteRuntime` in place of a local
        runtime. `options`: those of `RemoteRuntime.connect` (server, call_format, timeout_s,
        retries, backoff_s, session_ttl, pricing, log)."""
        return RemoteRuntime.connect(base_url, model, api_key, **options)

    @classmethod
    def _load(
        cls, model: str | Path | None, draft: str | Path | bool | None, device: str,
        dtype: str | torch.dtype | None, cache: CacheConfig | None, scheduler: SchedulerConfig,
        block_size: int | None, session_ttl: float | None, pricing: Pricing | None,
        log: str | Path | None, speculation: Speculation, quantize: str | None, compile: bool | None,
        graphs: bool = False,
    ) -> Runtime:
        model_dir = resolve_model(model)
        dev = resolve_device(device)
        target = load_model(model_dir, dtype=resolve_dtype(dtype, dev), device=dev)
        tokenizer = load_tokenizer(model_dir)
        if tokenizer is None:
            raise CheckpointError(f"{model_dir} has no tokenizer files; agents need one")
        drafter_dir = model_drafter_dir(model_dir) if draft is None or draft is True else (
            None if draft is False else Path(draft))
        if draft is True and drafter_dir is None:
            raise CheckpointError(f"{model_dir} carries no drafter/ subdirectory")
        drafter = load_drafter(drafter_dir, target) if drafter_dir is not None else None
        cfg = target.config
        if cache is None:
            page_size = 16
            cache = CacheConfig(page_size, 16 * -(-cfg.max_position_embeddings // page_size))
        engine = Engine(target, cache, scheduler, drafter=drafter,
                        spec=SpecConfig(block_size), speculation=speculation,
                        detokenize=tokenizer.decode, quantize=quantize, compile=compile,
                        measure_prefill=True, graphs=graphs)
        return cls(engine, tokenizer, model_dir, drafter_dir, session_ttl, pricing, log)

    # ---- public ---------------------------------------------------------------------------

    @property
    def speculative(self) -> bool:
        return self.engine.drafter is not None

    def stats(self) -> dict[str, int]:
        """KV pool occupancy: pages_total, pages_free, pages_pinned (held for live sessions),
        pages_referenced (held by running sequences), pages_cached (evictable), and the
        number of running and waiting requests."""
        return self._call(self.engine.stats)

    def clear_cache(self) -> int:
        """Evict the prefix cache that no agent pins (e.g. between benchmark runs)."""
        return self._call(self.engine.clear_cache)

    def close(self) -> None:
        """Stop the engine thread; requests still running fail with AgentClosedError."""
        if self._closed:
            return
        self._post(self._shutdown)
        self._thread.join()
        if self.log is not None:
            self.log.close()

    async def aclose(self) -> None:
        await anyio.to_thread.run_sync(self.close)

    async def __aenter__(self) -> Runtime:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ---- used by agents ---------------------------------------------------------------------

    def generate(self, prompt_ids: list[int], params: SamplingParams, *, pin: bool = False,
                 speculative: bool = True, constraint: TokenConstraint | None = None,
                 reuse: bool = True, prediction: list[int] | None = None) -> Generation:
        """Submit a request (from a task); iterate the returned Generation for its updates.
        `prediction`: token ids the output is expected to follow (engine.Engine.submit)."""
        gen = Generation(self)

        def submit() -> None:
            try:
                gen.seq_id = self.engine.submit(prompt_ids, params, pin=pin,
                                                speculative=speculative, constraint=constraint,
                                                reuse=reuse, prediction=prediction)
            except Exception as e:  # a typed EngineError: bad input, context overflow, ...
                gen._push(None, error=e)
                return
            self._live[gen.seq_id] = gen

        self._post(submit)
        return gen

    def keep(self, pin: Pin | None, ttl: float | None = None) -> None:
        """Track a session's pin for a TTL (`ttl` seconds, else the runtime's session_ttl;
        refreshing its deadline). A tracked pin is released when it expires, or earlier, the
        longest idle first, when a request needs its pages."""
        ttl = self.session_ttl if ttl is None else ttl
        if pin is not None and ttl is not None:
            now = self.clock()  # the TTL runs from the call, not from when the engine gets it

            def track() -> None:
                self._pins[id(pin)] = (pin, now + ttl, now)
            self._post(track)

    def unpin(self, pin: Pin | None) -> None:
        """Release a session's pinned KV (thread-safe, asynchronous; no-op after close)."""
        if pin is not None and not self._closed:
            self._post(lambda: self._release(pin))

    def share_pin(self, pin: Pin | None) -> Pin | None:
        """A second pin on the same cached prefix (for a forked agent)."""
        if pin is None or not pin.active:
            return None
        return self._call(lambda: self.engine.share_pin(pin))

    # ---- engine thread --------------------------------------------------------------------

    def _post(self, fn: Callable[[], None]) -> None:
        if self._closed:
            raise AgentClosedError("the runtime is closed")
        with self._wake:
            self._inbox.append(fn)
            self._wake.notify()

    def _call(self, fn: Callable[[], T]) -> T:
        """Run fn on the engine thread and return its result (blocks the caller briefly)."""
        if threading.current_thread() is self._thread:
            return fn()
        future: Future[T] = Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except BaseException as e:
                future.set_exception(e)

        self._post(run)
        return future.result()

    def _loop(self) -> None:
        self.engine.own_thread()
        while True:
            with self._wake:
                while not self._inbox and not self.engine.has_work():
                    self._wake.wait(timeout=self._next_expiry())
                    self._expire_pins()
                commands = list(self._inbox)
                self._inbox.clear()
            self._expire_pins()  # first: what a command reads (stats) is current
            for command in commands:
                command()
            if self._closed:
                return
            if self.engine.has_work():
                self._step()

    def _step(self) -> None:
        try:
            updates = self.engine.step()
        except Exception as e:  # a bug: fail every request rather than hang their waiters
            for gen in list(self._live.values()):
                self._abort(gen, error=e)
            return
        for update in updates:
            gen = self._live.get(update.seq_id)
            if gen is None:
                continue
            if update.finished:
                del self._live[update.seq_id]
                gen._push(update, completion=self.engine.result(update.seq_id))
            else:
                gen._push(update)

    def _abort(self, gen: Generation, error: BaseException | None = None) -> None:
        if gen.seq_id is None or gen.seq_id not in self._live:
            return
        del self._live[gen.seq_id]
        self.engine.abort(gen.seq_id)
        gen._push(None, completion=self.engine.result(gen.seq_id), error=error)

    def _release(self, pin: Pin) -> None:
        self._pins.pop(id(pin), None)
        self.engine.unpin(pin)

    def _next_expiry(self) -> float | None:
        if not self._pins:
            return None
        return max(0.0, min(t for _, t, _ in self._pins.values()) - self.clock())

    def _expire_pins(self) -> None:
        now = self.clock()
        for pin, deadline, _ in list(self._pins.values()):
            if deadline <= now:
                self._release(pin)

    def _release_idlest(self) -> bool:
        """Release the tracked pin idle longest; False when there is none."""
        if not self._pins:
            return False
        pin, _, _ = min(self._pins.values(), key=lambda entry: entry[2])
        self._release(pin)
        return True

    def _shutdown(self) -> None:
        closed = AgentClosedError("the runtime was closed")
        for gen in list(self._live.values()):
            self._abort(gen, error=closed)
        self._closed = True

