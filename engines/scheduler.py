"""Iteration-level (continuous) batching of plain and speculative requests.

Every step runs ONE target forward over all running sequences: a plain
sequence feeds its last token, a speculative one its last token plus its
drafts (each row its own γ and, after verification, its own number of accepted
tokens, ragged), and a sequence still in prefill feeds a chunk of its prompt
(bounded per step, so a long prompt never stalls the others). Requests join and
leave between steps. Model drafts that share a model draft together, one
batched forward per draft position.

Admission: a request is admitted (FIFO, the head first: no starvation) when its
KV reservation (prompt + max_tokens + γ_max + 1 positions) fits the budget.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from engines.api import GenerationResult, GenerationStats, SamplingParams, TokenDelta
from engines.decode import draft_budget, record_round, rollback, sample_token, settle, verification_input, verify
from engines.errors import Cancelled, EngineError
from engines.llama import KVCache, LlamaModel
from engines.proposers import ModelDraftProposer, Proposal
from engines.proposers.model_draft import propose_many
from engines.text import IncrementalText

log = logging.getLogger(__name__)


@dataclass
class Running:
    """One admitted request's decoding state."""

    handle: object  # BuiltinHandle
    sampling: SamplingParams
    gamma: int
    tokens: list[int]  # prompt + output so far
    prompt_len: int
    cache: KVCache
    proposer: object | None
    generator: torch.Generator
    stats: GenerationStats
    text: IncrementalText
    started: float
    reserved: int  # KV positions reserved at admission
    prefilled: int = 0
    out_ids: list[int] = field(default_factory=list)
    finish: str | None = None  # stop, length, cancelled, error
    error: BaseException | None = None

    @property
    def produced(self) -> int:
        return len(self.out_ids)


class Scheduler:
    def __init__(self, model: LlamaModel, tokenizer, eos_ids: frozenset[int], drafts: dict, gamma_max: int,
                 kv_budget_tokens: int, max_batch: int, prefill_chunk: int):
        self.model, self.tokenizer, self.eos_ids = model, tokenizer, eos_ids
        self.drafts, self.gamma_max = drafts, gamma_max
        self.kv_budget, self.max_batch, self.prefill_chunk = kv_budget_tokens, max_batch, prefill_chunk
        self.waiting: deque = deque()  # handles, FIFO
        self.running: list[Running] = []
        self.kv_used = 0
        self.last_step_tokens = 0
        self.step_s = 0.0

    # admission
    def reservation(self, handle) -> int:
        return len(handle.prompt_ids) + handle.request.sampling.max_tokens + self.gamma_max + 1

    def admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            handle = self.waiting[0]
            if handle.cancelled:
                self.waiting.popleft()
                handle.finish(None, Cancelled(f"request {handle.request_id} cancelled while queued"))
                continue
            need = self.reservation(handle)
            if self.running and self.kv_used + need > self.kv_budget:
                return  # the head waits for room; nobody overtakes it
            self.waiting.popleft()
            self.running.append(self._start(handle, need))
            self.kv_used += need

    def _start(self, handle, reserved: int) -> Running:
        req, sp = handle.request, handle.request.sampling
        seed = sp.seed if sp.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        now = time.perf_counter()
        stats = GenerationStats(arm=req.arm.name, seed=seed, prompt_tokens=len(handle.prompt_ids),
                                queue_s=now - handle.enqueued_at)
        cache = self.model.new_cache(reserved)
        proposer = self.drafts[req.arm.draft](reserved) if not req.arm.is_plain else None
        return Running(handle, sp, req.arm.gamma, list(handle.prompt_ids), len(handle.prompt_ids), cache, proposer,
                       torch.Generator(device=self.model.device).manual_seed(seed), stats,
                       IncrementalText(self.tokenizer, sp.stop), now, reserved)

    # one step
    def step(self) -> None:
        """One batched target forward over every running sequence."""
        t0 = time.perf_counter()
        for r in self.running:
            if r.handle.cancelled:
                r.finish = "cancelled"
        self._retire()
        plans, items = [], []
        prefill_left = self.prefill_chunk
        decoding = [r for r in self.running if r.prefilled == r.prompt_len]
        proposals = self._propose(decoding)
        t1 = time.perf_counter()
        for r in self.running:
            if r.finish is not None:
                continue
            if r.prefilled < r.prompt_len:
                take = min(prefill_left, r.prompt_len - r.prefilled)
                if take <= 0:
                    continue  # its turn comes next step
                prefill_left -= take
                ids = torch.tensor(r.tokens[r.prefilled:r.prefilled + take], device=self.model.device)
                plans.append(("prefill", r, take))
                items.append((ids, r.cache, False))
            elif (p := proposals.get(id(r))) is not None and p.token_ids.numel():
                plans.append(("verify", r, p))
                items.append((verification_input(r.tokens[-1], p.token_ids), r.cache, True))
            else:
                plans.append(("decode", r, None))
                items.append((torch.tensor([r.tokens[-1]], device=self.model.device), r.cache, False))
        if not items:
            return
        outs = self.model.forward_many(items)
        t2 = time.perf_counter()
        for (kind, r, extra), logits in zip(plans, outs):
            if kind == "prefill":
                r.prefilled += extra
                if r.prefilled == r.prompt_len:
                    r.stats.prefill_s = t2 - r.started
                    self._emit(r, [sample_token(logits, r.sampling, r.generator)], t2)
                continue
            if kind == "verify":
                k = int(extra.token_ids.numel())
                n, emitted = verify(logits, extra, r.sampling, r.generator)
                rollback(r.cache, k, n)
                r.proposer.observe(n)
                record_round(r.stats, k, n, t1 - t0, t2 - t1)
            else:
                emitted = [sample_token(logits, r.sampling, r.generator)]
                record_round(r.stats, None if r.proposer is None else 0, 0, t1 - t0, t2 - t1)
            self._emit(r, emitted, t2)
        self.last_step_tokens = sum(it[0].shape[0] for it in items)
        self.step_s = 0.8 * self.step_s + 0.2 * (time.perf_counter() - t0) if self.step_s else time.perf_counter() - t0
        self._retire()

    def _propose(self, decoding: list[Running]) -> dict[int, Proposal]:
        """Drafts for every speculative sequence; model drafts sharing a model batch."""
        out: dict[int, Proposal] = {}
        by_model: dict[int, list] = {}
        for r in decoding:
            if r.proposer is None:
                continue
            k = draft_budget(r.gamma, r.produced, r.sampling.max_tokens, r.cache)
            if k <= 0:
                continue
            if isinstance(r.proposer, ModelDraftProposer):
                by_model.setdefault(id(r.proposer.model), []).append((r, k))
                continue
            try:
                out[id(r)] = r.proposer.propose(r.tokens, k, r.sampling, r.generator)
            except Exception as e:  # noqa: BLE001 - one broken proposer fails its own request only
                self._fail(r, e)
        for group in by_model.values():
            model = group[0][0].proposer.model
            try:
                props = propose_many(model, [(r.proposer, r.tokens, k, r.sampling, r.generator) for r, k in group])
            except Exception as e:  # noqa: BLE001
                for r, _ in group:
                    self._fail(r, e)
                continue
            out.update((id(r), p) for (r, _), p in zip(group, props))
        return out

    def _fail(self, r: Running, e: BaseException) -> None:
        log.error("request %s failed: %s", r.handle.request_id, e, exc_info=e)
        r.finish = "error"
        r.error = EngineError(f"internal error in request {r.handle.request_id}: {type(e).__name__}")

    def _emit(self, r: Running, emitted: list[int], now: float) -> None:
        emitted, eos = settle(emitted, r.produced, r.sampling, self.eos_ids)
        if not r.out_ids:
            r.stats.ttft_s = now - r.started
        r.tokens.extend(emitted)
        r.out_ids.extend(emitted)
        delta = r.text.push(emitted)
        if delta:
            r.handle.push(TokenDelta(delta, tuple(emitted)))
        if r.text.stopped or eos:
            r.finish = "stop"
        elif r.produced >= r.sampling.max_tokens:
            r.finish = "length"

    def _retire(self) -> None:
        keep = []
        for r in self.running:
            if r.finish is None:
                keep.append(r)
                continue
            self.kv_used -= r.reserved
            if r.finish == "error":
                r.handle.finish(None, r.error)
                continue
            tail = r.text.finish()
            if tail:
                r.handle.push(TokenDelta(tail, ()))
            st = r.stats
            st.total_s = time.perf_counter() - r.started
            st.output_tokens = r.produced
            st.finish_reason = r.finish
            r.cache = None  # free the KV memory now, not when the handle is collected
            r.handle.finish(GenerationResult(r.handle.request_id, r.text.text, tuple(r.out_ids), st))
        self.running = keep

    def fail_all(self, error: BaseException) -> None:
        for r in self.running:
            self.kv_used -= r.reserved
            r.handle.finish(None, error)
        self.running = []
