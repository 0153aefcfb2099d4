"""Iteration-level (continuous) batching of plain and speculative requests.

Every step runs ONE target forward over all running sequences: a plain row
feeds its last token, a speculative one its last token plus the drafts the
step's budget admits (engines/budget.py: each row its own number, ragged), and
a row still in prefill feeds a chunk of its prompt (bounded per step, so a
long prompt never stalls the others). Requests join and leave between steps.
Drafts that share a model draft together (one batched forward per draft
position). Drafts that read the target's hidden states get them after every
forward, for exactly the positions the target committed.

Admission: a request is admitted (FIFO, the head first: no starvation) when its
KV reservation (prompt + max_tokens + γ_max + 1 positions) fits the budget.

Failure: a row whose drafting raises decodes on without drafts (the output is the
target's whatever was drafted); what goes wrong in one row's layout, forward or
verification fails that request alone (a shared forward that fails is rerun in halves:
engines/forwards.py).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections import deque

import torch

from engines import budget
from engines.api import GenerationResult, GenerationStats, TokenDelta
from engines.decode import draft_budget, record_round, rollback, sample_token, settle, verification_input, verify
from engines.errors import Cancelled, EngineError
from engines.forwards import forward_rows, rerun_in_halves
from engines.llama import KVCache, LlamaModel
from engines.proposers import Proposal
from engines.running import Plan, Running, calibration_key
from engines.sampling import DraftPicks, Draws
from engines.stepcost import StepCost
from engines.text import IncrementalText

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, model: LlamaModel, tokenizer, eos_ids: frozenset[int], drafts: dict, gamma_max: int,
                 kv_budget_tokens: int, max_batch: int, prefill_chunk: int, cost: StepCost | None = None,
                 adaptive: bool = True, max_stretch: float | None = None, coupled: bool = False):
        self.model, self.tokenizer, self.eos_ids = model, tokenizer, eos_ids
        self.drafts, self.gamma_max = drafts, gamma_max
        self.kv_budget, self.max_batch, self.prefill_chunk = kv_budget_tokens, max_batch, prefill_chunk
        self.cost = cost or StepCost()
        self.adaptive = adaptive  # False: verify every drafted token (fixed γ, the pre-budget behaviour)
        self.max_stretch = max_stretch  # bound on what others' speculation may cost a request (None: none)
        self.coupled = coupled  # sampled tokens by coupled picks (EngineConfig.coupled_sampling)
        self.calibration = budget.Calibration()
        self.waiting: deque = deque()  # handles, FIFO
        self.running: list[Running] = []
        self.kv_used = 0
        self.last_step_tokens = 0
        self.step_s = 0.0
        self._load = (0, 0, 0)  # this step's decoding (tokens, rows, emitted) before drafts: what drafting aims at
        self._room: float | None = None  # seconds drafting and verification may add to this step (None: unbounded)
        self._base = (0.0, 0.0)  # this step's seconds without drafting or verification, and as a decode step
        self.drafting_s: dict[str, float] = {}  # per draft: measured seconds per drafted token

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
                                queue_s=now - handle.enqueued_at, speculation_s=0.0)
        cache = self.model.new_cache(reserved)
        proposer = self.drafts[req.arm.draft](reserved) if not req.arm.is_plain else None
        fixed = req.fixed_gamma or not self.adaptive
        priced = None
        for name, part in proposer.parts(req.arm.draft) if proposer is not None else ():
            key = calibration_key(name, sp)
            self.calibration.start(key, part.calibration_prior)
            if not fixed:  # a model draft stops on calibrated estimates, not raw confidence
                part.calibrate = functools.partial(self.calibration.value, key)
            priced = name if part.drafting_costs else priced
        return Running(handle, sp, req.arm.gamma, req.arm.draft, list(handle.prompt_ids), len(handle.prompt_ids),
                       cache, proposer, Draws(seed, self.model.device, self.coupled), stats,
                       IncrementalText(self.tokenizer, sp.stop), now, reserved, req.min_confidence, fixed, priced)

    # one step
    def step(self) -> None:
        """One batched target forward over every running sequence."""
        t0 = time.perf_counter()
        for r in self.running:
            if r.handle.cancelled:
                r.finish = "cancelled"
        self._retire()
        decoding = [r for r in self.running if r.prefilled == r.prompt_len and r.finish is None]
        # drafting is judged against the step about to run, as a decode step: a prefill chunk in
        # it (or in the last one) makes every draft look cheap against a long, low-yield step,
        # while what an accepted token saves is a row's share of a decode step
        self._load = (len(decoding), sum(r.finish is None for r in self.running), len(decoding))
        self._room = budget.room(self.max_stretch, [r.slowdown.balance for r in self.running if r.finish is None],
                                 self.cost.step(*self._load[:2]))
        tp = time.perf_counter()
        proposals = self._propose(decoding)
        t1 = time.perf_counter()
        drafting_s = t1 - tp
        laid = []
        for p in self._plan(proposals, drafting_s):
            try:
                laid.append((p, self._item(p)))
            except Exception as e:  # noqa: BLE001 - a row that cannot be laid out fails alone, before the forward
                self._fail(p.row, e)
        if not laid:
            return
        plans, items = [p for p, _ in laid], [it for _, it in laid]
        layers = {p.row.proposer.needs_states for p in plans if p.row.proposer is not None
                  and p.row.proposer.needs_states}
        if len(layers) > 1:
            raise ValueError(f"drafts reading different target layers in one engine: {sorted(layers)}")
        layer = layers.pop() if layers else None
        lengths = [it[1].lengths[0] for it in items]  # what a failed forward is rerun from
        try:
            outs, states = forward_rows(self.model, items, layer)
            batched = True
        except Exception as e:  # noqa: BLE001 - see rerun_in_halves
            ran, outs, states = rerun_in_halves(self.model, items, lengths, layer, e,
                                                lambda i, err: self._fail(plans[i].row, err))
            plans, items, batched = [plans[i] for i in ran], [items[i] for i in ran], False
            if not plans:
                self._retire()
                return
        t2 = time.perf_counter()
        sizes = [it[0].shape[0] for it in items]
        tokens, rows, multi = sum(sizes), len(items), sum(n > 1 for n in sizes)
        priced_s = self.cost.step(tokens, rows, multi)  # this forward, as the step-cost model prices it
        judging_s = 0.0  # judging verified drafts (sampling, calibration): every row waits for it too
        for plan, logits, st in zip(plans, outs, states):
            ta = time.perf_counter()
            try:
                self._apply(plan, logits, st, t0, t1, t2)
            except Exception as e:  # noqa: BLE001 - one row's sampling or bookkeeping fails its own request only
                self._fail(plan.row, e)
            if plan.kind == "verify":
                judged = time.perf_counter() - ta
                judging_s += judged
                # its own verification's share of the forward, priced (never more than the forward
                # took: the model is a fit), and its judging, timed
                extra = priced_s - self.cost.step(tokens - plan.take, rows, multi - 1)
                plan.row.stats.speculation_s += judged + min(max(extra, 0.0), t2 - t1)
        if self._room is not None:
            # what drafting and judging (timed) and verification (priced) added to a step every row waited for
            added = max(priced_s - self._base[0], 0.0) + drafting_s + judging_s
            for p in plans:
                p.row.slowdown.settle(self.max_stretch, *self._base, p.accepted, added)
        if batched:  # a batch run in parts says nothing of one step's cost
            self.cost.observe(tokens, rows, t2 - t1, multi)
        self.last_step_tokens = tokens
        self.step_s = 0.8 * self.step_s + 0.2 * (time.perf_counter() - t0) if self.step_s else time.perf_counter() - t0
        self._retire()

    def _plan(self, proposals: dict[int, Proposal], drafting_s: float) -> list[Plan]:
        """Prefill chunks, then the verification budget over the decoding rows
        (within what is left of the step's room once drafting took `drafting_s`)."""
        plans: list[Plan] = []
        prefill_left = self.prefill_chunk
        base_tokens = prefill = chunks = 0  # decoding rows' tokens; prefill chunks' tokens and rows
        spec: list[Plan] = []
        for r in self.running:
            if r.finish is not None:
                continue
            if r.prefilled < r.prompt_len:
                take = min(prefill_left, r.prompt_len - r.prefilled)
                if take > 0:  # else its turn comes next step
                    prefill_left -= take
                    plans.append(Plan("prefill", r, take))
                    prefill += take
                    chunks += take > 1
                continue
            p = proposals.get(id(r))
            plan = Plan("decode", r, 0, p, 0 if p is None else int(p.token_ids.numel()))
            plans.append(plan)
            base_tokens += 1
            if plan.drafted:
                spec.append(plan)
        emitted = len(plans) - sum(p.kind == "prefill" for p in plans)
        self._base = (self.cost.step(base_tokens + prefill, len(plans), chunks),
                      self.cost.step(base_tokens, len(plans)))
        fixed = [p for p in spec if p.row.fixed]  # verified whole, whatever the load
        adapt = [p for p in spec if not p.row.fixed]
        for p in fixed:
            p.kind, p.take = "verify", p.drafted
            base_tokens += p.drafted
            emitted += sum(self._survival(p))
        if adapt:
            room = None if self._room is None else max(self._room - drafting_s, 0.0)
            # under a bound the poorest rows go first: a row whose drafts are never verified never
            # earns, and its balance would hold the whole batch's room down for good
            first = None if room is None else [p.row.slowdown.balance for p in adapt]
            takes = budget.admit([self._survival(p) for p in adapt], base_tokens, round(emitted), self.cost,
                                 len(plans), room, prefill, chunks, len(fixed), first)
            for p, k in zip(adapt, takes):
                if k > 0:
                    p.kind, p.take, p.proposal = "verify", k, p.proposal.truncate(k)
        return plans

    def _survival(self, p: Plan) -> list[float]:
        """Expected tokens added by verifying each prefix of a row's drafts."""
        prop = p.proposal
        if prop.confidence is not None:
            key = calibration_key(p.row.part(prop), p.row.sampling)
            est = p.row.bias_of(prop).apply(self.calibration.estimate(key, prop.confidence))
        else:
            est = torch.full((p.drafted,), p.row.acceptance.value)
        return budget.survival(est)

    def _item(self, p: Plan) -> tuple[torch.Tensor, KVCache, bool, bool]:
        """The row's forward_many item; a greedy row reads only the argmax of its logits."""
        r, device = p.row, self.model.device
        greedy = r.sampling.temperature == 0
        if p.kind == "prefill":
            return torch.tensor(r.tokens[r.prefilled:r.prefilled + p.take], device=device), r.cache, False, greedy
        if p.kind == "verify":
            return verification_input(r.tokens[-1], p.proposal.token_ids), r.cache, True, greedy
        return torch.tensor([r.tokens[-1]], device=device), r.cache, False, greedy

    def _apply(self, p: Plan, logits: torch.Tensor, states: torch.Tensor | None, t0, t1, t2) -> None:
        r = p.row
        wants_states = r.proposer is not None and r.proposer.needs_states
        if p.kind == "prefill":
            r.prefilled += p.take
            if wants_states:
                r.proposer.observe_states(states)
            if r.prefilled == r.prompt_len:
                r.stats.prefill_s = t2 - r.started
                self._emit(r, [sample_token(logits, r.sampling, r.draws, r.produced)], t2)
            return
        if p.kind == "verify":
            k = p.take
            n, emitted = verify(logits, p.proposal, r.sampling, r.draws, r.produced)
            p.accepted = n
            rollback(r.cache, k, n)
            if wants_states:
                r.proposer.observe_states(states[: n + 1])  # the last token and the accepted drafts
            if p.proposal.confidence is not None:
                key = calibration_key(r.part(p.proposal), r.sampling)
                r.bias_of(p.proposal).observe(self.calibration.estimate(key, p.proposal.confidence), n)
                self.calibration.observe(key, p.proposal.confidence, n)
        else:
            k, n = 0, 0
            emitted = [sample_token(logits, r.sampling, r.draws, r.produced)]
            if wants_states:
                r.proposer.observe_states(states)
        if r.proposer is not None:
            gates = r.gates(p.proposal)  # a hybrid's lookup rounds leave its model part's acceptance alone
            if gates and k == 0 and p.drafted and r.proposer.drafting_costs:
                # drafted, not worth verifying: nothing learned about the target, so the row's estimate moves
                # to what the draft's first token was believed worth (a draft judged weak round after round
                # stops being drafted; a plausible one that did not pay this round keeps its chance)
                r.acceptance.settle(self._survival(p)[0])
            elif gates:
                r.acceptance.observe(k, n)
            r.stats.verified_per_round.append(k)
        record_round(r.stats, None if r.proposer is None else p.drafted, n, t1 - t0, t2 - t1)
        self._emit(r, emitted, t2)

    def _propose(self, decoding: list[Running]) -> dict[int, Proposal]:
        """Drafts for every speculative row; proposers sharing a batch key draft together."""
        out: dict[int, Proposal] = {}
        groups: dict[int, list] = {}
        for r in decoding:
            if r.proposer is None:
                continue
            k = draft_budget(r.gamma, r.produced, r.sampling.max_tokens, r.cache)
            if k <= 0:
                continue
            if not r.fixed:
                # the least survival worth drafting and verifying at the last step's load
                drafting = self.drafting_s.get(r.priced, 0.0)
                k = budget.stretch_room(self.cost, *self._load[:2], self._room, drafting, k)
                if k <= 0:
                    continue  # the bound leaves no room to verify anything: a plain round
                least = budget.threshold(self.cost, *self._load, drafting, span=k)
                worth = not r.proposer.drafting_costs or budget.worth_drafting(r.acceptance.value, k, self.cost,
                                                                               *self._load, drafting)
                if not worth and not r.proposer.lookup_first:
                    continue  # too unlikely to pay at this load: a plain round (its estimate drifts back)
                if r.proposer.lookup_first:  # a lookup costs nothing to try; the model runs only where it may pay
                    r.proposer.model_on = worth
                # a model draft drafts one more token while the prefix's survival times the row's
                # acceptance (what the next token is expected to keep) still clears the threshold
                r.proposer.min_confidence = max(r.min_confidence, least / max(r.acceptance.value, 1e-3))
            else:
                r.proposer.min_confidence = r.min_confidence
            key = r.proposer.batch_key
            if key is None:
                t0 = time.perf_counter()
                try:
                    out[id(r)] = r.proposer.propose(r.tokens, k, r.sampling, DraftPicks(r.draws, r.produced))
                except Exception as e:  # noqa: BLE001 - see _drop_draft
                    self._drop_draft([r], e)
                    continue
                dt = time.perf_counter() - t0
                r.stats.speculation_s += dt
                self._time_drafting(r, dt, [out[id(r)]])
                continue
            groups.setdefault(id(key), []).append((r, k))
        for group in groups.values():
            proposer = group[0][0].proposer
            t0 = time.perf_counter()
            try:
                props = type(proposer).propose_batch([(r.proposer, r.tokens, k, r.sampling,
                                                       DraftPicks(r.draws, r.produced))
                                                      for r, k in group])
            except Exception as e:  # noqa: BLE001 - see _drop_draft
                self._drop_draft([r for r, _ in group], e)
                continue
            dt = time.perf_counter() - t0
            for r, _ in group:  # drafted together: each row's share
                r.stats.speculation_s += dt / len(group)
            self._time_drafting(group[0][0], dt, props)
            out.update((id(r), p) for (r, _), p in zip(group, props))
        return {i: p for i, p in out.items() if p.token_ids.numel()}

    def _time_drafting(self, r: Running, seconds: float, props: list[Proposal]) -> None:
        """Seconds per drafted token of a model draft (a moving average): the
        drafting price in the step budget. From the proposals' own clocks where
        they keep them (catching up left out: engines/proposers/base.py
        DraftingClock), else the whole call's `seconds`. Prompt lookup's is left
        at zero (a hybrid's lookup tokens are not counted: the model draft took the time)."""
        mine = [p for p in props if r.part(p) == r.priced]
        if all(p.cost is not None for p in mine):
            seconds, n = sum(p.cost[0] for p in mine), sum(p.cost[1] for p in mine)
        else:
            n = sum(int(p.token_ids.numel()) for p in mine)
        if r.priced is None or n == 0:
            return
        old = self.drafting_s.get(r.priced)
        self.drafting_s[r.priced] = budget.drafting_price(old, seconds, n)

    def _drop_draft(self, rows: list[Running], e: BaseException) -> None:
        """Rows whose drafting raised decode on without drafts (a batch of them together:
        the culprit is unknown, the draft's state half updated); a draft only proposes."""
        log.error("drafting with %s failed for %s: decoding on without drafts", rows[0].draft,
                  ", ".join(r.handle.request_id for r in rows), exc_info=e)
        for r in rows:
            r.proposer = None
            r.stats.draft_error = f"drafting with {r.draft} failed ({type(e).__name__}): decoded on without drafts"

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

