"""The built-in engine: torch models in this process, one decode loop.

Requests are validated and tokenized on the caller's thread (so bad input fails
fast and never reaches the loop), queued FIFO, and decoded together by the loop
with continuous batching (engines/scheduler.py), which streams deltas back
through each request's handle.

Where the loop runs matters on CPU: oneDNN's OpenMP matmuls ran ~1.6x slower
when called from a secondary Python thread than from the process's main thread
(SmolLM2 decode step 88 ms vs 52 ms on the 2-core machine; the dense BLAS path
is ~80 ms on either). Servers therefore run `serve_forever()` on the main thread
and do their I/O on other threads; `start_worker=True` (tests, scripts) runs the
loop on a thread of its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import torch

from engines import budget
from engines.api import GenerationRequest, GenerationResult, LoadSnapshot, SamplingParams, TokenDelta
from engines.arms import Arm, ArmMenu
from engines.attention import attention_kernel
from engines.config import EngineConfig
from engines.drafts import ProposerFactory, build_drafts, may_pack
from engines.errors import EngineError, InvalidRequest, Overloaded
from engines.fused import fused_ops
from engines.greedy_head import CALIBRATION_TEXT, choose_greedy_head
from engines.layouts import drop_dense_copies
from engines.llama import LlamaModel
from engines.loading import LoadedModel, default_cache_dir, default_target_path, load_model
from engines.profile import Profile, fit_cost
from engines.profile_cache import cpu_profile
from engines.sampling import validate_sampling
from engines.scheduler import Scheduler
from engines.stepcost import StepCost
from engines.text import encode_prompt

log = logging.getLogger(__name__)

# what the drafts draft from at warm-up: text that repeats, so that prompt lookup finds matches too
WARM_UP_PROMPT = "one two three four five six seven eight, one two three four five six seven eight, one two three"


class BuiltinHandle:
    """A queued or running request. The decode loop pushes deltas and finishes it
    from its thread; consumers read it synchronously (`for delta in handle`,
    `handle.wait()`) or from an event loop (`async for`, `await handle.result()`)."""

    def __init__(self, request: GenerationRequest, prompt_ids: list[int]):
        self.request_id = request.request_id
        self.request = request
        self.prompt_ids = prompt_ids
        self.enqueued_at = time.perf_counter()
        self._deltas: list[TokenDelta] = []
        self._cond = threading.Condition()
        self._wakers: list[Callable[[], None]] = []  # event-loop consumers to wake
        self._cancelled = threading.Event()
        self._result: GenerationResult | None = None
        self._error: BaseException | None = None
        self._done = False

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def done(self) -> bool:
        return self._done

    # the decode loop's side
    def push(self, delta: TokenDelta) -> None:
        with self._cond:
            self._deltas.append(delta)
            self._cond.notify_all()
            wakers = list(self._wakers)
        for wake in wakers:
            wake()

    def finish(self, result: GenerationResult | None, error: BaseException | None = None) -> None:
        with self._cond:
            self._result, self._error, self._done = result, error, True
            self._cond.notify_all()
            wakers = list(self._wakers)
        for wake in wakers:
            wake()

    # synchronous consumers (scripts, benchmarks, the CLI)
    def __iter__(self) -> Iterator[TokenDelta]:
        i = 0
        while True:
            with self._cond:
                while i == len(self._deltas) and not self._done:
                    self._cond.wait()
                new, done = self._deltas[i:], self._done
            i += len(new)
            yield from new
            if done and i == len(self._deltas):
                break
        if self._error is not None:
            raise self._error

    def wait(self, timeout: float | None = None) -> GenerationResult:
        with self._cond:
            if not self._cond.wait_for(lambda: self._done, timeout):
                raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    # event-loop consumers (the gateway)
    async def __aiter__(self) -> AsyncIterator[TokenDelta]:
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()

        def wake():
            loop.call_soon_threadsafe(ready.set)

        with self._cond:
            self._wakers.append(wake)
        try:
            i = 0
            while True:
                ready.clear()  # before reading: a push after the read sets it again
                with self._cond:
                    new, done = self._deltas[i:], self._done
                i += len(new)
                for delta in new:
                    yield delta
                if done and i == len(self._deltas):
                    break
                if not new:
                    await ready.wait()
        finally:
            with self._cond:
                self._wakers.remove(wake)
        if self._error is not None:
            raise self._error

    async def result(self, timeout: float | None = None) -> GenerationResult:
        async def drain():
            async for _ in self:
                pass

        try:
            await asyncio.wait_for(drain(), timeout)
        except asyncio.TimeoutError:
            self.cancel()
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s") from None
        assert self._result is not None
        return self._result


class BuiltinEngine:
    def __init__(self, target: LoadedModel, drafts: dict[str, ProposerFactory], config: EngineConfig,
                 start_worker: bool = True, cost: StepCost | None = None, profile: Profile | None = None,
                 decoders: tuple[LlamaModel, ...] = ()):
        self.target = target
        self.model = target.model
        self.decoders = decoders or (target.model,)  # every decoder it runs, the drafts' too
        self.tokenizer = target.tokenizer
        self.config = config
        self.drafts = drafts  # name -> proposer factory
        self._arms = config.arm_menu(tuple(drafts))
        self.max_context = min(config.target.max_context, target.model.cfg.max_positions)
        self.eos_ids = frozenset(_eos_ids(target))
        self._queue: queue.Queue[BuiltinHandle | None] = queue.Queue()
        self.profile = profile
        self._sched = Scheduler(self.model, self.tokenizer, self.eos_ids, drafts, config.gamma_max,
                                config.kv_budget_tokens, config.max_batch, config.prefill_chunk, cost,
                                adaptive=config.adaptive, max_stretch=config.max_step_stretch,
                                coupled=config.coupled_sampling)
        self._publish_load()  # the profile's prices, before the first step
        self._closed = False
        self._worker: threading.Thread | None = None
        self._loop_guard, self._looping = threading.Lock(), False  # one decode loop per engine
        if start_worker:
            self.start()

    def start(self) -> None:
        """Run the decode loop on a thread of its own (servers run `serve_forever` on the main thread)."""
        self._worker = threading.Thread(target=self.serve_forever, name="specgate-engine", daemon=True)
        self._worker.start()

    # construction
    @classmethod
    def from_config(cls, config: EngineConfig, start_worker: bool = True) -> BuiltinEngine:
        """Load the target and its drafts, then measure this machine (engines/profile.py)."""
        t = config.target
        cache_dir = Path(t.cache_dir) if t.cache_dir else default_cache_dir()
        t0 = time.perf_counter()
        target = load_model(t.path or default_target_path(), getattr(torch, t.dtype), t.device, cache_dir)
        log.info("target %s loaded in %.1f s (%s, %s)", target.source, time.perf_counter() - t0, t.dtype, t.device)
        drafts = build_drafts(config, target, cache_dir)
        if t.device == "cpu":
            attend_by = attention_kernel() if t.attention_kernel and t.dtype == "float32" else None
            fused = fused_ops() if t.fused_ops and t.dtype == "float32" else None
            for m in (target.model, *drafts.models):  # before the profile: it prices forwards so run
                m.attention_kernel, m.fused = attend_by, fused
            weights = [target.model.weights] + drafts.weights
            prof = cpu_profile(target.model, weights, t.pack_weights if may_pack(t) else False, t.threads,
                               t.bf16_matmuls, cache_dir if t.profile_cache else None, routes=t.matmul_routes)
            drafts.route_columns(prof.layers_upto, prof.head_upto, prof.panels)
            target.model.greedy_head = choose_greedy_head(target.model, t.greedy_head,
                                                          target.tokenizer(CALIBRATION_TEXT)["input_ids"])
            freed = sum(drop_dense_copies(w) for w in weights)  # the routes are final: MKL's copies unread
            if freed:
                log.info("dense copies the panels made unread: %.0f MB freed", freed / 2**20)
        else:
            if t.threads:
                torch.set_num_threads(t.threads)
            prof = Profile(torch.get_num_threads(), "dense", cost=fit_cost(target.model))
        log.info("start-up profile: %s", prof.describe())
        engine = cls(target, drafts.factories, config, start_worker=False, cost=prof.cost, profile=prof,
                     decoders=(target.model, *drafts.models))
        engine.warm_up()
        if start_worker:
            engine.start()
        return engine

    def warm_up(self, tokens: int = 8) -> None:
        """Serve a short request under each draft, twice, before the decode loop
        starts. The first pass pays for lazy initialisation, so that no user request
        does; the second times each model draft's drafting alone, so that the budget
        prices drafting from a request's first round (a draft not yet timed is priced
        as free) and the engine reports what each draft costs on this machine. What
        the passes taught the engine-wide calibration is dropped: a made-up prompt
        says nothing of how drafts fare on real ones."""
        if self._looping or self._worker is not None:
            raise RuntimeError("warm_up drives the scheduler itself: call it before the decode loop starts")
        sched, t0 = self._sched, time.perf_counter()
        ids = self.tokenizer(WARM_UP_PROMPT)["input_ids"]
        for second in (False, True):
            if second:
                sched.drafting_s.clear()  # the untimed pass's first calls paid for initialisation
            for draft in self.drafts:
                request = GenerationRequest(f"warm-up-{draft}", SamplingParams(max_tokens=tokens, ignore_eos=True,
                                                                               seed=0),
                                            arm=Arm(draft, self._arms.gamma_max), fixed_gamma=True)
                handle = BuiltinHandle(request, list(ids))
                sched.waiting.append(handle)
                while sched.waiting or sched.running:
                    sched.admit()
                    sched.step()
                try:
                    handle.wait(timeout=0)
                except Exception as e:  # noqa: BLE001 - the first user request under it would fail alike
                    log.error("warm-up under %s failed: %s", draft, e)
        sched.calibration = budget.Calibration()
        self._publish_load()
        timed = ", ".join(f"{d} {s * 1e3:.2f} ms" for d, s in sorted(sched.drafting_s.items()))
        log.info("warm-up in %.1f s; drafting per token: %s", time.perf_counter() - t0, timed or "no model draft")

    # Engine protocol
    @property
    def closed(self) -> bool:
        return self._closed

    def arms(self) -> ArmMenu:
        return self._arms

    def load(self) -> LoadSnapshot:
        s = self._load  # replaced whole after every step; no lock held across a step
        return dataclasses.replace(s, waiting=s.waiting + self._queue.qsize())

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text)["input_ids"])

    def set_max_step_stretch(self, value: float | None) -> None:
        """Retune `max_step_stretch` while serving (read by the next step; a float
        assignment is atomic across threads)."""
        if value is not None and value < 0:
            raise ValueError(f"max_step_stretch must be >= 0 or None, got {value}")
        self._sched.max_stretch = value

    def submit(self, request: GenerationRequest) -> BuiltinHandle:
        if self._closed:
            raise EngineError("engine is shut down")
        prompt_ids = encode_prompt(self.tokenizer, request)
        room = self.max_context - len(prompt_ids)
        if room <= 0:
            raise InvalidRequest("prompt", f"{len(prompt_ids)} tokens leave no room in the "
                                           f"{self.max_context}-token context window")
        validate_sampling(request.sampling, room)
        self._arms.check(request.arm)
        need = len(prompt_ids) + request.sampling.max_tokens + self.config.gamma_max + 1
        if need > self.config.kv_budget_tokens:
            raise InvalidRequest("max_tokens", f"prompt plus max_tokens needs {need} KV positions; this engine's "
                                               f"budget is {self.config.kv_budget_tokens}")
        if self._queue.qsize() + len(self._sched.waiting) >= self.config.max_queue:
            raise Overloaded(f"engine queue is full ({self.config.max_queue} waiting); retry later")
        handle = BuiltinHandle(request, prompt_ids)
        self._queue.put(handle)
        return handle

    def generate(self, request: GenerationRequest) -> GenerationResult:
        """Submit and wait: the convenient form for scripts and tests."""
        return self.submit(request).wait()

    def close(self) -> None:
        """Stop taking requests; the loop finishes what is queued, then returns."""
        self._closed = True
        self._queue.put(None)
        if self._worker is not None and self._worker is not threading.current_thread():
            self._worker.join(timeout=30)

    # the decode loop
    def serve_forever(self) -> None:
        """Run the batching loop on the calling thread until close(); what is queued
        at close is still served."""
        with self._loop_guard:
            if self._looping:
                raise RuntimeError("the decode loop is already running (the engine was built with start_worker=True)")
            self._looping = True
        sched, closing = self._sched, False
        while True:
            idle = not sched.running and not sched.waiting
            try:
                item = self._queue.get(timeout=0.5) if idle else self._queue.get_nowait()
                while True:
                    if item is None:
                        closing = True
                    else:
                        sched.waiting.append(item)
                    item = self._queue.get_nowait()
            except queue.Empty:
                pass
            sched.admit()
            if sched.running:
                try:
                    sched.step()
                except Exception as e:  # beyond one row's own failures: fails the batch, not the engine
                    log.exception("engine step failed")
                    sched.fail_all(EngineError(f"internal error: {type(e).__name__}"))
            self._publish_load()
            if closing and not sched.running and not sched.waiting and self._queue.empty():
                return

    def _publish_load(self) -> None:
        s = self._sched
        # one attribute assignment: readers never see a half-updated snapshot
        self._load = LoadSnapshot(running=len(s.running), waiting=len(s.waiting), tokens_per_step=s.last_step_tokens,
                                  kv_used_tokens=s.kv_used, kv_limit_tokens=s.kv_budget, recent_step_s=s.step_s,
                                  lone_step_s=s.cost.lone_prices(s.gamma_max + 1),
                                  drafting_s=tuple(sorted(s.drafting_s.items())))


def drive_from_side_thread(engine: BuiltinEngine, fn: Callable[[], object]) -> object:
    """Run `fn` on a second thread while the engine's decode loop runs on this
    (main) thread; close the engine when `fn` ends and return its result."""
    outcome: dict = {}

    def drive():
        try:
            outcome["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
            outcome["error"] = e
        finally:
            engine.close()

    driver = threading.Thread(target=drive, name="specgate-driver")
    driver.start()
    engine.serve_forever()
    driver.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _eos_ids(target: LoadedModel) -> set[int]:
    ids = set()
    for src in (getattr(target.hf_config, "eos_token_id", None), target.tokenizer.eos_token_id):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(i) for i in src)
    return ids
