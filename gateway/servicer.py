"""Servicers: translate protobuf <-> domain, and domain errors -> gRPC status codes.
No logic of their own."""

from __future__ import annotations

import dataclasses
import logging
import time

import grpc

from engines.api import Arm, Cancelled, ChatMessage, EngineError, GenerationRequest, InvalidRequest, Overloaded, SamplingParams
from gateway.interceptors import current_call
from gateway.pb import specgate_pb2 as pb
from gateway.pb import specgate_pb2_grpc as pb_grpc
from gateway.router import EngineUnavailable, result_to_pb
from gateway.service import GatewayRequest, GatewayService, Served, validate
from policy.decide import Decision

log = logging.getLogger(__name__)


def _opt(msg, name):
    return getattr(msg, name) if msg.HasField(name) else None


def to_domain(req: pb.GenerateRequest, max_prompt_chars: int) -> GatewayRequest:
    call = current_call()
    r = validate(
        call.request_id, call.tenant, req.prompt, [(m.role, m.content) for m in req.messages],
        max_tokens=_opt(req, "max_tokens"), temperature=_opt(req, "temperature"), top_p=_opt(req, "top_p"),
        top_k=_opt(req, "top_k"), seed=_opt(req, "seed"), stop=list(req.stop), category=req.category,
        expected_output_tokens=_opt(req, "expected_output_tokens"), arm=req.arm, max_prompt_chars=max_prompt_chars,
    )
    return dataclasses.replace(r, trace_carrier=call.trace_carrier) if call.trace_carrier else r


def decision_pb(d: Decision) -> pb.Decision:
    return pb.Decision(
        arm=d.arm.name, speculative=not d.arm.is_plain, draft=d.arm.draft or "", gamma=d.arm.gamma,
        source=d.source, rule=d.rule or "", policy_version=d.policy_version, rules_version=d.rules_version,
        predicted_speedup=d.predicted_speedup.get(d.arm.name, 1.0), predicted_speedups=d.predicted_speedup,
        propensity=d.propensity, explored=d.explored, reason=d.reason)


def response_pb(request_id: str, s: Served) -> pb.GenerateResponse:
    st = s.result.stats
    return pb.GenerateResponse(
        request_id=request_id, text=s.result.text, finish_reason=st.finish_reason,
        usage=pb.Usage(prompt_tokens=st.prompt_tokens, output_tokens=st.output_tokens),
        decision=decision_pb(s.decision),
        spec=pb.SpecStats(drafted=st.drafted, accepted=st.accepted, acceptance_rate=st.acceptance_rate,
                          mean_accepted_length=st.mean_accepted_length, rounds=st.rounds,
                          acceptance_source=st.acceptance_source),
        timings=pb.Timings(queue_s=s.queue_s, ttft_s=s.ttft_s, total_s=s.total_s), engine=s.engine, seed=st.seed)


def engine_status_pb(id: str, address: str, healthy: bool, arms, load, max_context: int) -> pb.EngineStatus:
    return pb.EngineStatus(
        id=id, address=address, healthy=healthy, drafts=list(arms.drafts), gamma_min=arms.gamma_min,
        gamma_max=arms.gamma_max, max_context=max_context,
        arms=[a.name for a in arms.all_arms()] if arms.only is not None else [],
        load=pb.Load(running=load.running, waiting=load.waiting, tokens_per_step=load.tokens_per_step,
                     kv_used_tokens=load.kv_used_tokens, kv_limit_tokens=load.kv_limit_tokens,
                     recent_step_s=load.recent_step_s))


def abort_for(context, e: Exception, request_id: str):
    """Map an error to its status code. Unexpected errors say INTERNAL with the
    request id (the traceback goes to the log, never to the client)."""
    if isinstance(e, InvalidRequest):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{e.field}: {e.message}")
    if isinstance(e, Overloaded):
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"overloaded: {e} (request {request_id})")
    if isinstance(e, Cancelled):
        context.abort(grpc.StatusCode.CANCELLED, f"cancelled (request {request_id})")
    if isinstance(e, EngineUnavailable):
        context.abort(grpc.StatusCode.UNAVAILABLE, f"{e} (request {request_id})")
    log.error("request %s failed", request_id, exc_info=e)
    context.abort(grpc.StatusCode.INTERNAL, f"internal error (request {request_id})")


class GatewayServicer(pb_grpc.GatewayServicer):
    def __init__(self, service: GatewayService, max_prompt_chars: int = 1_000_000):
        self.service = service
        self.max_prompt_chars = max_prompt_chars

    def _run(self, request, context):
        arrived = time.perf_counter()
        req = to_domain(request, self.max_prompt_chars)
        return req, self.service.generate(req, lambda fn: context.add_callback(fn), arrived)

    def Generate(self, request, context):
        rid = current_call().request_id
        try:
            req, events = self._run(request, context)
            for ev in events:
                if isinstance(ev, Served):
                    return response_pb(rid, ev)
        except Exception as e:  # noqa: BLE001 - mapped to a status below
            abort_for(context, e, rid)
        abort_for(context, EngineUnavailable("generation ended without a result"), rid)

    def GenerateStream(self, request, context):
        rid = current_call().request_id
        try:
            req, events = self._run(request, context)
            for ev in events:
                if isinstance(ev, Served):
                    yield pb.GenerateStreamResponse(request_id=rid, final=response_pb(rid, ev))
                elif isinstance(ev, str) and ev:
                    yield pb.GenerateStreamResponse(request_id=rid, text=ev)
        except Exception as e:  # noqa: BLE001
            abort_for(context, e, rid)

    def Decide(self, request, context):
        rid = current_call().request_id
        try:
            req = to_domain(request, self.max_prompt_chars)
            d, f = self.service.decide(req)
        except Exception as e:  # noqa: BLE001
            abort_for(context, e, rid)
        return pb.DecideResponse(request_id=rid, decision=decision_pb(d), features=pb.Features(
            category=f.category, temperature=f.temperature, top_p=f.top_p, prompt_tokens=f.prompt_tokens,
            expected_output_tokens=f.expected_output_tokens, copy_signal=f.copy_signal, running=f.running,
            waiting=f.waiting, tenant=f.tenant))

    def GetStatus(self, request, context):
        engines = [engine_status_pb(e.id, e.address, e.healthy, e.arms(), e.load(), e.max_context())
                   for e in self.service.router.endpoints]
        p = self.service.policy
        return pb.GetStatusResponse(engines=engines, policy_version=p.model.version, rules_version=p.rules.digest)


class EngineServicer(pb_grpc.EngineServicer):
    """The internal API of an engine worker: one built-in engine behind it."""

    def __init__(self, engine, id: str = "engine"):
        self.engine, self.id = engine, id

    def Generate(self, request, context):
        r = request.request
        try:
            req = GenerationRequest(
                request_id=request.request_id, prompt=r.prompt or None,
                messages=tuple(ChatMessage(m.role, m.content) for m in r.messages), arm=Arm.parse(request.arm),
                sampling=SamplingParams(max_tokens=r.max_tokens, temperature=r.temperature, top_p=r.top_p,
                                        top_k=r.top_k, seed=r.seed if r.HasField("seed") else None,
                                        stop=tuple(r.stop)))
            handle = self.engine.submit(req)
            context.add_callback(handle.cancel)  # client gone: free the slot
            for delta in handle:
                yield pb.EngineEvent(text=delta.text)
            yield pb.EngineEvent(result=result_to_pb(handle.result()))
        except EngineError as e:
            abort_for(context, e, request.request_id)

    def Status(self, request, context):
        return engine_status_pb(self.id, "", True, self.engine.arms(), self.engine.load(), self.engine.max_context)

    def CountTokens(self, request, context):
        return pb.CountTokensResponse(tokens=self.engine.count_tokens(request.text))
