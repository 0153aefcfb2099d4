"""The gateway's domain logic: admit, decide, route, generate, record.

Knows nothing of protobuf or HTTP: the gRPC servicer and the HTTP API translate.
Errors are engine error types (InvalidRequest, Overloaded, EngineUnavailable);
the front ends map them to status codes. Runs on the gateway's event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from engines.api import GenerationRequest, GenerationResult
from engines.arms import Arm
from engines.errors import EngineError, EngineUnavailable, Overloaded
from gateway.policy_state import PolicyState
from gateway.router import Router
from gateway.validation import GatewayRequest
from policy.decide import Decision, decide
from policy.features import RequestFeatures, build_features, estimate_prompt_tokens
from telemetry.otel import Instrumentation, decision_attributes, extract_context, now_refs, ns, outcome_attributes
from telemetry.outcomes import MemoryOutcomeSink
from telemetry.record import OutcomeRecord

log = logging.getLogger(__name__)


@dataclass
class Served:
    """The end of a generation, for the front ends."""

    result: GenerationResult
    decision: Decision
    engine: str
    queue_s: float
    ttft_s: float
    total_s: float


class GatewayService:
    def __init__(self, router: Router, policy: PolicyState, sink=None, instrumentation: Instrumentation | None = None,
                 acceptance=None, max_concurrent: int = 256, include_prompt: bool = False,
                 rng: random.Random | None = None):
        self.router = router
        self.policy = policy
        self.sink = sink if sink is not None else MemoryOutcomeSink()  # anything with emit(OutcomeRecord)
        self.instr = instrumentation or Instrumentation()
        self.acceptance = acceptance  # telemetry.acceptance.RollingAcceptance, or None
        self.max_concurrent = max_concurrent
        self.include_prompt = include_prompt
        self._rng = rng or random.Random()
        self.active = 0  # generations in flight (gRPC and HTTP)
        self._attrs: dict[tuple, tuple[dict, dict, dict]] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    # ------------------------------------------------------------------ decision
    def features(self, req: GatewayRequest, admitted: bool = False) -> RequestFeatures:
        """What the policy knows of `req` (admitted: it is one of this gateway's
        generations in flight, not a dry run)."""
        load = self.router.least_loaded_load()
        # An engine reports its load once per step, a worker once per health check: a burst decided
        # between two reports would all see the load from before it. This gateway's other generations in
        # flight, spread over the healthy engines, are a floor on it (waiting, where the report falls short).
        others = self.active - (1 if admitted else 0)
        floor = -(-others // max(len(self.router.healthy()), 1))
        waiting = load.waiting + max(0, floor - load.running - load.waiting)
        text = req.text
        f = build_features(
            text, prompt_tokens=estimate_prompt_tokens(text), temperature=req.sampling.temperature,
            top_p=req.sampling.top_p, max_tokens=req.sampling.max_tokens, classifier=self.policy.classifier,
            model=self.policy.model, category_hint=req.hints.category,
            expected_length_hint=req.hints.expected_output_tokens, running=load.running, waiting=waiting,
            tokens_per_step=load.tokens_per_step, tenant=req.tenant, requested_arm=req.hints.requested_arm,
            turns=max(1, len(req.messages)))
        if self.acceptance is not None:  # the category is known only after classification
            f = dataclasses.replace(f, rolling_acceptance=self.acceptance.lookup(req.tenant, f.category))
        return f

    def decide(self, req: GatewayRequest, admitted: bool = False) -> tuple[Decision, RequestFeatures]:
        t0 = time.perf_counter()
        arms = self.router.arms()
        if req.hints.requested_arm:
            arms.check(Arm.parse(req.hints.requested_arm))  # a requested arm nobody serves is a bad field
        f = self.features(req, admitted)
        # decide() runs on the event loop, one at a time: the gateway's rng needs no lock
        d = decide(f, self.policy.rules, self.policy.model, self._rng, arms)
        self.instr.decision_latency.record(time.perf_counter() - t0)
        return d, f

    # ------------------------------------------------------------------ admission
    def admit(self) -> None:
        """One more generation, or Overloaded at once beyond the configured limit."""
        if self.active >= self.max_concurrent:
            raise Overloaded(f"{self.active} generations in flight (max_concurrent_streams); retry later")
        self.active += 1
        self._idle.clear()

    def release(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True when every generation in flight has ended within `timeout`."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    # ------------------------------------------------------------------ generation
    async def generate(self, req: GatewayRequest, arrived: float | None = None
                       ) -> AsyncIterator[Decision | str | Served]:
        """Yield the Decision, then text chunks, then one Served. The caller admits
        first and closes the generator when done (a cancelled caller frees the
        engine slot at once). Traced as one span with children for the
        decision, the queue wait and the generation."""
        arrived = arrived or time.perf_counter()
        tracer = self.instr.tracer
        span = tracer.start_span("specgate.generate_request", context=extract_context(dict(req.trace_carrier)),
                                 kind=SpanKind.SERVER,
                                 attributes={"gen_ai.operation.name": "chat" if req.messages else "text_completion",
                                             "gen_ai.request.max_tokens": req.sampling.max_tokens,
                                             "specgate.request_id": req.request_id})
        parent = trace.set_span_in_context(span)
        try:
            dspan = tracer.start_span("specgate.decide", context=parent)
            try:
                decision, features = self.decide(req, admitted=True)
                dspan.set_attributes(decision_attributes(features, decision))
            finally:
                dspan.end()
            span.set_attributes(decision_attributes(features, decision))
            yield decision  # first event: lets HTTP streaming send the decision in its headers
            async for ev in self._serve(req, decision, features, arrived, span, parent):
                yield ev
        except EngineError as e:
            span.set_status(Status(StatusCode.ERROR, type(e).__name__))
            raise
        except asyncio.CancelledError:
            span.set_status(Status(StatusCode.ERROR, "cancelled"))
            raise
        finally:
            span.end()

    async def _serve(self, req, decision, features, arrived, span, parent) -> AsyncIterator[str | Served]:
        tracer = self.instr.tracer
        tried: set[str] = set()
        while True:
            route = self.router.route(decision.arm, exclude=tried)
            if route is None:
                raise EngineUnavailable("no healthy engine is available")
            if route.fallback:
                decision = dataclasses.replace(decision, arm=route.arm, source="fallback", propensity=1.0,
                                               explored=False, reason=f"{decision.arm.name} is served by no healthy "
                                                                      f"engine: {route.arm.name}")
            ep = route.endpoint
            engine_req = GenerationRequest(request_id=req.request_id, sampling=req.sampling, prompt=req.prompt,
                                           messages=req.messages, arm=route.arm,
                                           min_confidence=decision.min_confidence)
            perf0, wall0 = now_refs()
            self.router.track(ep.id, +1)
            gspan = tracer.start_span("specgate.engine_generation", context=parent,
                                      attributes={"specgate.engine": ep.id})
            ttft, handle, result = None, None, None
            try:
                handle = await ep.submit(engine_req)
                async for delta in handle:
                    if ttft is None:
                        ttft = time.perf_counter() - arrived
                    yield delta.text
                result = await handle.result()
                gspan.set_attributes(outcome_attributes(result.stats, ttft or 0.0))
            except EngineUnavailable as e:
                ep.mark_failed()
                if not e.retryable or ttft is not None:
                    raise
                log.warning("engine %s failed before any output (%s); retrying elsewhere", ep.id, e)
                tried.add(ep.id)
                continue
            finally:
                gspan.end()
                self.router.track(ep.id, -1)
                if handle is not None and result is None:
                    handle.cancel()  # the caller went away (or it failed): free the engine slot now
            total = time.perf_counter() - arrived
            served = Served(result, decision, ep.id, result.stats.queue_s, ttft if ttft is not None else total, total)
            # the queue wait is known only now: its span is placed after the fact
            tracer.start_span("specgate.queue", context=parent, start_time=ns(perf0, perf0, wall0),
                              attributes={"specgate.queue_s": result.stats.queue_s}).end(
                end_time=ns(perf0 + result.stats.queue_s, perf0, wall0))
            span.set_attributes(outcome_attributes(result.stats, served.ttft_s))
            self._observe(served)
            self._record(req, features, served)
            yield served
            return

    def _observe(self, s: Served) -> None:
        st, arm = s.result.stats, s.decision.arm
        key = (arm, s.decision.source)
        attrs = self._attrs.get(key)
        if attrs is None:  # one set of attribute dicts per (arm, source): built once, not per request
            attrs = self._attrs[key] = ({"arm": arm.name, "source": s.decision.source}, {"draft": arm.draft or ""},
                                        {"arm": arm.name})
        self.instr.requests.add(1, attrs[0])
        if st.drafted:
            self.instr.acceptance.record(st.acceptance_rate, attrs[1])
        if st.draft_error:
            self.instr.draft_errors.add(1, attrs[1])
        if st.total_s > 0:
            self.instr.tokens_per_s.record(st.tokens_per_s, attrs[2])
        self.instr.ttft.record(s.ttft_s)

    def _record(self, req: GatewayRequest, f: RequestFeatures, s: Served) -> None:
        try:
            # a hinted category is cross-checked: the guard's statistics follow the classifier
            classified = self.policy.classifier.predict(req.text) if req.hints.category else None
            self.sink.emit(OutcomeRecord.of(req.request_id, req.tenant, s.engine, f, s.decision, s.result.stats,
                                            s.ttft_s, classified, req.text if self.include_prompt else None))
        except Exception:  # noqa: BLE001 - recording must never fail a request
            log.exception("could not record the outcome of %s", req.request_id)

