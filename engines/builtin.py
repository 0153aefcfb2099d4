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

import logging
import queue
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

from engines.api import (
    ArmInfo, EngineError, GenerationRequest, GenerationResult, InvalidRequest, LoadSnapshot, Overloaded, TokenDelta,
)
from engines.config import EngineConfig, LayerDraftConfig, ModelDraftConfig, NgramDraftConfig
from engines.scheduler import Scheduler
from engines.llama import LlamaModel, pack_for_cpu
from engines.loading import (
    LoadedModel, check_tokenizers_match, default_cache_dir, default_target_path, load_model,
)
from engines.proposers import ModelDraftProposer, NgramProposer, Proposer
from engines.sampling import validate_sampling
from engines.text import encode_prompt

log = logging.getLogger(__name__)

ProposerFactory = Callable[[int], Proposer]  # KV capacity -> a fresh proposer for one request
_DONE = object()


class BuiltinHandle:
    """A queued or running request. Iterate for deltas, or call result()."""

    def __init__(self, request: GenerationRequest, prompt_ids: list[int]):
        self.request_id = request.request_id
        self.request = request
        self.prompt_ids = prompt_ids
        self.enqueued_at = time.perf_counter()
        self._events: queue.Queue = queue.Queue()
        self._cancelled = threading.Event()
        self._result: GenerationResult | None = None
        self._error: BaseException | None = None
        self._finished = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def __iter__(self) -> Iterator[TokenDelta]:
        while True:
            item = self._events.get()
            if item is _DONE:
                break
            yield item
        if self._error is not None:
            raise self._error

    def result(self, timeout: float | None = None) -> GenerationResult:
        if not self._finished.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    # worker side
    def _emit(self, delta: TokenDelta) -> None:
        self._events.put(delta)

    def _finish(self, result: GenerationResult | None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._finished.set()
        self._events.put(_DONE)


class BuiltinEngine:
    def __init__(self, target: LoadedModel, drafts: dict[str, ProposerFactory], config: EngineConfig,
                 start_worker: bool = True):
        self.target = target
        self.model = target.model
        self.tokenizer = target.tokenizer
        self.config = config
        self._drafts = drafts
        self._arms = ArmInfo(tuple(drafts), config.gamma_min, config.gamma_max)
        self.max_context = min(config.target.max_context, target.model.cfg.max_positions)
        self.eos_ids = frozenset(_eos_ids(target))
        self._queue: queue.Queue[BuiltinHandle | None] = queue.Queue()
        self._sched = Scheduler(self.model, self.tokenizer, self.eos_ids, drafts, config.gamma_max,
                                config.kv_budget_tokens, config.max_batch, config.prefill_chunk)
        self._load = LoadSnapshot(kv_limit_tokens=config.kv_budget_tokens)
        self._closed = False
        self._worker: threading.Thread | None = None
        if start_worker:
            self._worker = threading.Thread(target=self.serve_forever, name="specgate-engine", daemon=True)
            self._worker.start()

    # construction
    @classmethod
    def from_config(cls, config: EngineConfig, start_worker: bool = True) -> "BuiltinEngine":
        t = config.target
        if t.threads:
            torch.set_num_threads(t.threads)
        cache_dir = Path(t.cache_dir) if t.cache_dir else default_cache_dir()
        dtype = getattr(torch, t.dtype)
        t0 = time.perf_counter()
        target = load_model(t.path or default_target_path(), dtype, t.device, cache_dir)
        log.info("target %s loaded in %.1f s (%s, %s)", target.source, time.perf_counter() - t0, t.dtype, t.device)
        drafts = build_drafts(config, target, cache_dir)
        if _should_pack(t):
            pack_for_cpu(target.model.weights)  # layer drafts share this LlamaWeights object
        return cls(target, drafts, config, start_worker)

    # Engine protocol
    def arms(self) -> ArmInfo:
        return self._arms

    def load(self) -> LoadSnapshot:
        l = self._load  # replaced whole after every step; no lock held across a step
        return LoadSnapshot(l.running, l.waiting + self._queue.qsize(), l.tokens_per_step, l.kv_used_tokens,
                            l.kv_limit_tokens, l.recent_step_s)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text)["input_ids"])

    def submit(self, request: GenerationRequest) -> BuiltinHandle:
        if self._closed:
            raise EngineError("engine is shut down")
        prompt_ids = encode_prompt(self.tokenizer, request)
        room = self.max_context - len(prompt_ids)
        if room <= 0:
            raise InvalidRequest("prompt", f"{len(prompt_ids)} tokens leave no room in the "
                                           f"{self.max_context}-token context window")
        validate_sampling(request.sampling, room)
        arm = request.arm
        if not arm.is_plain:
            if arm.draft not in self._drafts:
                raise InvalidRequest("arm.draft", f"unknown draft {arm.draft!r}; this engine serves {sorted(self._drafts)}")
            if not self.config.gamma_min <= arm.gamma <= self.config.gamma_max:
                raise InvalidRequest("arm.gamma", f"must be in [{self.config.gamma_min}, "
                                                  f"{self.config.gamma_max}], got {arm.gamma}")
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
        return self.submit(request).result()

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
                except Exception as e:  # a failed batched forward fails that batch, not the engine
                    log.exception("engine step failed")
                    sched.fail_all(EngineError(f"internal error: {type(e).__name__}"))
            self._publish_load()
            if closing and not sched.running and not sched.waiting and self._queue.empty():
                return

    def _publish_load(self) -> None:
        s = self._sched
        # one attribute assignment: readers never see a half-updated snapshot
        self._load = LoadSnapshot(running=len(s.running), waiting=len(s.waiting), tokens_per_step=s.last_step_tokens,
                                  kv_used_tokens=s.kv_used, kv_limit_tokens=s.kv_budget, recent_step_s=s.step_s)


def drive_from_side_thread(engine: BuiltinEngine, fn: Callable[[], object]) -> object:
    """Run `fn` on a second thread while the engine's decode loop runs on this
    (main) thread; close the engine when `fn` ends and return its result."""
    outcome: dict = {}

    def drive():
        try:
            outcome["value"] = fn()
        except BaseException as e:  # re-raised on the calling thread
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


def _should_pack(t) -> bool:
    return t.pack_weights and t.device == "cpu" and t.dtype == "float32" and torch.backends.mkldnn.is_available()


def _eos_ids(target: LoadedModel) -> set[int]:
    ids = set()
    for src in (getattr(target.hf_config, "eos_token_id", None), target.tokenizer.eos_token_id):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(i) for i in src)
    return ids


def build_drafts(config: EngineConfig, target: LoadedModel, cache_dir: Path) -> dict[str, ProposerFactory]:
    """One proposer factory per configured draft. Refuses a draft whose tokenizer
    differs from the target's."""
    t = config.target
    drafts: dict[str, ProposerFactory] = {}
    for d in config.drafts:
        if isinstance(d, NgramDraftConfig):
            drafts[d.name] = (lambda cap, d=d: NgramProposer(d.min_n, d.max_n, t.device))
        elif isinstance(d, LayerDraftConfig):
            sub = LlamaModel(target.model.cfg, target.model.weights, d.layer_ids(target.model.cfg.num_layers))
            drafts[d.name] = (lambda cap, sub=sub: ModelDraftProposer(sub, cap))
        elif isinstance(d, ModelDraftConfig):
            loaded = load_model(d.path, getattr(torch, t.dtype), t.device, cache_dir)
            check_tokenizers_match(target.tokenizer, loaded.tokenizer, d.name)
            if _should_pack(t):
                pack_for_cpu(loaded.model.weights)
            drafts[d.name] = (lambda cap, m=loaded.model: ModelDraftProposer(m, cap))
    return drafts
