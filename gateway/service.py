"""The gateway's domain logic: validate, decide, route, generate, record.

Knows nothing of protobuf: the servicer translates. Errors are engine error
types (InvalidRequest, Overloaded, EngineUnavailable); the servicer maps them to
gRPC status codes.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from engines.api import (
    Arm, ChatMessage, EngineError, GenerationRequest, GenerationResult, InvalidRequest, SamplingParams,
)
from gateway.router import EngineUnavailable, Router
from policy.classifier import CATEGORIES, CategoryClassifier
from policy.decide import Decision, decide
from policy.features import RequestFeatures, build_features
from policy.model import PolicyModel, prior_model
from policy.rules import RuleSet, RulesError, load_rules
from opentelemetry.trace import SpanKind, Status, StatusCode
from telemetry.otel import Instrumentation, decision_attributes, extract_context, now_refs, ns, outcome_attributes

log = logging.getLogger(__name__)

MAX_MESSAGES = 256
MAX_STOP = 16
DEFAULT_MAX_TOKENS = 128


@dataclass(frozen=True)
class Hints:
    category: str | None = None
    expected_output_tokens: int | None = None
    requested_arm: str | None = None


@dataclass(frozen=True)
class GatewayRequest:
    """A validated request: what the engine needs plus the policy's hints."""

    request_id: str
    tenant: str
    prompt: str | None
    messages: tuple[ChatMessage, ...]
    sampling: SamplingParams
    hints: Hints
    trace_carrier: tuple[tuple[str, str], ...] = ()

    @property
    def text(self) -> str:
        """The prompt's text, for the classifier and the copy signal."""
        return self.prompt if self.prompt is not None else "\n".join(m.content for m in self.messages)


def validate(request_id: str, tenant: str, prompt: str, messages: list[tuple[str, str]], *,
             max_tokens: int | None, temperature: float | None, top_p: float | None, top_k: int | None,
             seed: int | None, stop: list[str], category: str, expected_output_tokens: int | None, arm: str,
             max_prompt_chars: int) -> GatewayRequest:
    """Field checks that do not need an engine (the engine checks the context window)."""
    if prompt and messages:
        raise InvalidRequest("prompt", "give either prompt or messages, not both")
    if not prompt and not messages:
        raise InvalidRequest("prompt", "must not be empty (give prompt or messages)")
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequest("messages", f"at most {MAX_MESSAGES} messages")
    size = len(prompt) + sum(len(c) for _, c in messages)
    if size > max_prompt_chars:
        raise InvalidRequest("prompt" if prompt else "messages", f"longer than {max_prompt_chars} characters")
    for text, name in [(prompt, "prompt")] + [(c, f"messages[{i}].content") for i, (_, c) in enumerate(messages)]:
        if "\x00" in text:
            raise InvalidRequest(name, "must not contain NUL characters")
    if max_tokens is not None and max_tokens <= 0:
        raise InvalidRequest("max_tokens", f"must be positive, got {max_tokens}")
    for name, v in (("temperature", temperature), ("top_p", top_p)):
        if v is not None and not math.isfinite(v):
            raise InvalidRequest(name, f"must be a finite number, got {v}")
    if len(stop) > MAX_STOP or any(not s or len(s) > 256 for s in stop):
        raise InvalidRequest("stop", f"at most {MAX_STOP} non-empty stop strings of at most 256 characters")
    if category and category not in CATEGORIES:
        raise InvalidRequest("category", f"unknown category {category!r}; known: {list(CATEGORIES)}")
    if expected_output_tokens is not None and expected_output_tokens <= 0:
        raise InvalidRequest("expected_output_tokens", f"must be positive, got {expected_output_tokens}")
    if arm:
        Arm.parse(arm)  # raises InvalidRequest("arm", ...)
    sampling = SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else DEFAULT_MAX_TOKENS,
        temperature=temperature if temperature is not None else 0.0,
        top_p=top_p if top_p is not None else 1.0,
        top_k=top_k if top_k is not None else 0,
        seed=seed, stop=tuple(stop),
    )
    from engines.sampling import validate_sampling

    validate_sampling(sampling, max_new_tokens_allowed=1 << 30)  # the context window is the engine's check
    return GatewayRequest(request_id, tenant, prompt or None,
                          tuple(ChatMessage(r, c) for r, c in messages), sampling,
                          Hints(category or None, expected_output_tokens, arm or None))


def _check_served(arm: Arm, arms) -> None:
    """A requested arm no engine serves is a bad field; one the rules forbid is
    merely not honoured (the decision's reason says so)."""
    if arm.is_plain:
        return
    if arms.only is not None and not arms.allows(arm):  # an explicit menu says it best
        raise InvalidRequest("arm", f"no engine serves {arm.name}; served: {[a.name for a in arms.all_arms()]}")
    if arm.draft not in arms.drafts:
        raise InvalidRequest("arm.draft", f"no engine serves draft {arm.draft!r}; served: {list(arms.drafts)}")
    if not arms.gamma_min <= arm.gamma <= arms.gamma_max:
        raise InvalidRequest("arm.gamma", f"must be in [{arms.gamma_min}, {arms.gamma_max}], got {arm.gamma}")


class PolicyState:
    """The live model, rules and classifier. Swapped atomically (one attribute
    assignment), so a request sees one consistent version throughout."""

    def __init__(self, rules: RuleSet, model: PolicyModel | None = None,
                 classifier: CategoryClassifier | None = None, rules_path: str | None = None):
        self.rules = rules
        self.model = model or prior_model()
        self.classifier = classifier or CategoryClassifier.load()
        self.rules_path = rules_path
        self._rules_mtime = Path(rules_path).stat().st_mtime_ns if rules_path else None
        self._stop = threading.Event()

    def set_model(self, model: PolicyModel) -> None:
        self.model = model
        log.info("policy model now %s", model.version)

    def reload_rules(self) -> bool:
        """Re-read the rules file; an invalid file is refused and the old rules stay."""
        if not self.rules_path:
            return False
        try:
            rules = load_rules(self.rules_path)
        except RulesError as e:
            log.error("rules reload refused, keeping version %s: %s", self.rules.digest, e)
            return False
        if rules.digest != self.rules.digest:
            log.info("rules reloaded from %s: version %s -> %s", self.rules_path, self.rules.digest, rules.digest)
        self.rules = rules
        return True

    def watch_rules(self, interval: float) -> None:
        if not self.rules_path:
            return

        def loop():
            while not self._stop.wait(interval):
                try:
                    mtime = Path(self.rules_path).stat().st_mtime_ns
                except OSError:
                    continue
                if mtime != self._rules_mtime:
                    self._rules_mtime = mtime
                    self.reload_rules()

        threading.Thread(target=loop, name="specgate-rules", daemon=True).start()

    def close(self) -> None:
        self._stop.set()


@dataclass
class Outcome:
    """What one finished request teaches the policy (the telemetry record's core)."""

    request_id: str
    tenant: str
    features: dict
    decision: dict
    engine: str
    result: dict
    time: float = field(default_factory=time.time)


class OutcomeLog:
    """Default sink: the latest outcomes in memory (learning is off without Redis)."""

    def __init__(self, maxlen: int = 10_000):
        self.items: deque[Outcome] = deque(maxlen=maxlen)

    def emit(self, outcome: Outcome) -> None:
        self.items.append(outcome)


@dataclass
class Served:
    """The end of a generation, for the servicer."""

    result: GenerationResult
    decision: Decision
    engine: str
    queue_s: float
    ttft_s: float
    total_s: float


class GatewayService:
    def __init__(self, router: Router, policy: PolicyState, outcomes=None, rng: random.Random | None = None,
                 instrumentation: Instrumentation | None = None, acceptance=None):
        self.router = router
        self.policy = policy
        self.outcomes = outcomes or OutcomeLog()  # anything with emit(Outcome)
        self.instr = instrumentation or Instrumentation()
        self.acceptance = acceptance  # RollingAcceptance (shared through Redis) or None
        self._rng = rng or random.Random()
        self._rng_lock = threading.Lock()

    def features(self, req: GatewayRequest) -> RequestFeatures:
        load = self.router.least_loaded_load()
        text = req.text
        return build_features(
            text, prompt_tokens=max(1, len(text) // 4), temperature=req.sampling.temperature,
            top_p=req.sampling.top_p, max_tokens=req.sampling.max_tokens, classifier=self.policy.classifier,
            model=self.policy.model, category_hint=req.hints.category,
            expected_length_hint=req.hints.expected_output_tokens, running=load.running, waiting=load.waiting,
            tokens_per_step=load.tokens_per_step, tenant=req.tenant, requested_arm=req.hints.requested_arm,
        )

    def decide(self, req: GatewayRequest) -> tuple[Decision, RequestFeatures]:
        t0 = time.perf_counter()
        arms = self.router.arms()
        if req.hints.requested_arm:
            _check_served(Arm.parse(req.hints.requested_arm), arms)
        f = self.features(req)
        if self.acceptance is not None:  # the category is known only after classification
            f = dataclasses.replace(f, rolling_acceptance=self.acceptance.for_category(f.category))
        with self._rng_lock:  # one seed draw; decide() itself runs unlocked
            rng = random.Random(self._rng.getrandbits(64))
        d = decide(f, self.policy.rules, self.policy.model, rng, arms)
        self.instr.decision_latency.record(time.perf_counter() - t0)
        return d, f

    def generate(self, req: GatewayRequest, on_cancel: Callable[[Callable[[], None]], None],
                 arrived: float | None = None) -> Iterator[Decision | str | Served]:
        """Yield the Decision, then text chunks, then one Served. `on_cancel` registers what to call if
        the client goes away (the engine slot is freed at once). Traced as one span
        with children for the decision, the queue wait and the generation."""
        arrived = arrived or time.perf_counter()
        tracer = self.instr.tracer
        ctx = extract_context(dict(req.trace_carrier))
        with tracer.start_as_current_span("specgate.generate_request", context=ctx, kind=SpanKind.SERVER,
                                          attributes={"gen_ai.operation.name": "chat" if req.messages
                                                      else "text_completion",
                                                      "gen_ai.request.max_tokens": req.sampling.max_tokens,
                                                      "specgate.request_id": req.request_id}) as span:
            try:
                yield from self._generate(req, on_cancel, arrived, span)
            except EngineError as e:
                span.set_status(Status(StatusCode.ERROR, type(e).__name__))
                raise

    def _generate(self, req, on_cancel, arrived, span) -> Iterator[Decision | str | Served]:
        tracer = self.instr.tracer
        with tracer.start_as_current_span("specgate.decide") as dspan:
            decision, features = self.decide(req)
            dspan.set_attributes(decision_attributes(features, decision))
        span.set_attributes(decision_attributes(features, decision))
        yield decision  # first event: lets HTTP streaming send the decision in its headers
        tried: set[str] = set()
        while True:
            route = self.router.route(decision.arm, exclude=tried)
            if route is None:
                raise EngineUnavailable("no healthy engine is available")
            if route.fallback:
                decision = Decision(route.arm, "fallback", decision.rule, decision.policy_version,
                                    decision.rules_version, decision.predicted_speedup, 1.0, False,
                                    f"{decision.arm.name} is served by no healthy engine: {route.arm.name}")
            ep = route.endpoint
            engine_req = GenerationRequest(request_id=req.request_id, sampling=req.sampling, prompt=req.prompt,
                                           messages=req.messages, arm=route.arm)
            perf0, wall0 = now_refs()
            handle = ep.submit(engine_req)
            on_cancel(handle.cancel)
            self.router.track(ep.id, +1)
            ttft = None
            try:
                with tracer.start_as_current_span("specgate.engine_generation",
                                                  attributes={"specgate.engine": ep.id}) as gspan:
                    for delta in handle:
                        if ttft is None:
                            ttft = time.perf_counter() - arrived
                        yield delta.text
                    result = handle.result()
                    gspan.set_attributes(outcome_attributes(result.stats, ttft or 0.0))
            except EngineUnavailable as e:
                if hasattr(ep, "mark_failed"):
                    ep.mark_failed()
                if not e.retryable or ttft is not None:
                    raise
                log.warning("engine %s failed before any output (%s); retrying elsewhere", ep.id, e)
                tried.add(ep.id)
                continue
            finally:
                self.router.track(ep.id, -1)
            total = time.perf_counter() - arrived
            served = Served(result, decision, ep.id, result.stats.queue_s, ttft if ttft is not None else total, total)
            # the queue wait is known only now: its span is placed after the fact
            tracer.start_span("specgate.queue", start_time=ns(perf0, perf0, wall0),
                              attributes={"specgate.queue_s": result.stats.queue_s}).end(
                end_time=ns(perf0 + result.stats.queue_s, perf0, wall0))
            span.set_attributes(outcome_attributes(result.stats, served.ttft_s))
            self._observe(served)
            self._record(req, features, served)
            yield served
            return

    def _observe(self, s: Served) -> None:
        st = s.result.stats
        self.instr.requests.add(1, {"arm": s.decision.arm.name, "source": s.decision.source})
        if st.drafted:
            self.instr.acceptance.record(st.acceptance_rate, {"draft": s.decision.arm.draft or ""})
        if st.total_s > 0:
            self.instr.tokens_per_s.record(st.tokens_per_s, {"arm": s.decision.arm.name})
        self.instr.ttft.record(s.ttft_s)

    def _record(self, req: GatewayRequest, f: RequestFeatures, s: Served) -> None:
        st = s.result.stats
        try:
            self.outcomes.emit(Outcome(
                request_id=req.request_id, tenant=req.tenant, features=f.to_dict(), decision=s.decision.to_dict(),
                engine=s.engine,
                result=dict(arm=st.arm, output_tokens=st.output_tokens, prompt_tokens=st.prompt_tokens,
                            rounds=st.rounds, drafted=st.drafted, accepted=st.accepted,
                            drafted_per_round=st.drafted_per_round, accepted_per_round=st.accepted_per_round,
                            prefill_s=st.prefill_s, decode_s=max(st.total_s - st.prefill_s, 0.0),
                            total_s=st.total_s, queue_s=st.queue_s, ttft_s=s.ttft_s,
                            finish_reason=st.finish_reason, acceptance_source=st.acceptance_source),
            ))
        except Exception:  # recording must never fail a request
            log.exception("could not record the outcome of %s", req.request_id)


__all__ = ["GatewayService", "GatewayRequest", "PolicyState", "OutcomeLog", "Outcome", "Served", "validate",
           "EngineError"]
