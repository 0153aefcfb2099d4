"""Protobuf <-> domain, in one place: the public API's messages (servicer) and
the internal engine API's (engine worker and its client)."""

from __future__ import annotations

import math
from dataclasses import replace

from engines.api import (
    ChatMessage,
    GenerationRequest,
    GenerationResult,
    GenerationStats,
    LoadSnapshot,
    SamplingParams,
)
from engines.arms import Arm, ArmMenu, DraftKind
from gateway.context import CallInfo
from gateway.pb import specgate_pb2 as pb
from gateway.validation import GatewayRequest, validate
from policy.decide import Decision
from policy.features import RequestFeatures


def _opt(msg, name):
    return getattr(msg, name) if msg.HasField(name) else None


# --------------------------------------------------------------------- public API
def to_domain(req: pb.GenerateRequest, call: CallInfo, max_prompt_chars: int) -> GatewayRequest:
    return validate(
        call.request_id, call.tenant, req.prompt, [(m.role, m.content) for m in req.messages],
        max_tokens=_opt(req, "max_tokens"), temperature=_opt(req, "temperature"), top_p=_opt(req, "top_p"),
        top_k=_opt(req, "top_k"), seed=_opt(req, "seed"), stop=list(req.stop), category=req.category,
        expected_output_tokens=_opt(req, "expected_output_tokens"), arm=req.arm, max_prompt_chars=max_prompt_chars,
        trace_carrier=call.trace_carrier)


def decision_pb(d: Decision) -> pb.Decision:
    return pb.Decision(
        arm=d.arm.name, speculative=not d.arm.is_plain, draft=d.arm.draft or "", gamma=d.arm.gamma,
        source=d.source, rule=d.rule or "", policy_version=d.policy_version, rules_version=d.rules_version,
        predicted_speedup=d.predicted_speedup.get(d.arm.name, 1.0), predicted_speedups=d.predicted_speedup,
        propensity=d.propensity, explored=d.explored, reason=d.reason, min_confidence=d.min_confidence)


def response_pb(request_id: str, result: GenerationResult, decision: Decision, engine: str, queue_s: float,
                ttft_s: float, total_s: float) -> pb.GenerateResponse:
    st = result.stats
    return pb.GenerateResponse(
        request_id=request_id, text=result.text, finish_reason=st.finish_reason,
        usage=pb.Usage(prompt_tokens=st.prompt_tokens, output_tokens=st.output_tokens),
        decision=decision_pb(decision),
        spec=pb.SpecStats(drafted=st.drafted, accepted=st.accepted, acceptance_rate=st.acceptance_rate,
                          mean_accepted_length=st.mean_accepted_length, rounds=st.rounds,
                          acceptance_source=st.acceptance_source, draft_error=st.draft_error),
        timings=pb.Timings(queue_s=queue_s, ttft_s=ttft_s, total_s=total_s), engine=engine, seed=st.seed)


def features_pb(f: RequestFeatures) -> pb.Features:
    return pb.Features(category=f.category, temperature=f.temperature, top_p=f.top_p, prompt_tokens=f.prompt_tokens,
                       expected_output_tokens=f.expected_output_tokens, copy_signal=f.copy_signal, running=f.running,
                       waiting=f.waiting, tenant=f.tenant)


def engine_status_pb(id: str, address: str, healthy: bool, arms: ArmMenu, load, max_context: int) -> pb.EngineStatus:
    return pb.EngineStatus(
        id=id, address=address, healthy=healthy, drafts=list(arms.drafts), gamma_min=arms.gamma_min,
        gamma_max=arms.gamma_max, max_context=max_context, adaptive_gamma=arms.adaptive,
        arms=[a.name for a in arms.all_arms()] if arms.only is not None else [],
        draft_kinds=[pb.DraftKind(draft=d, kind=k.kind, model=k.model or "") for d, k in arms.kinds],
        load=pb.Load(running=load.running, waiting=load.waiting, tokens_per_step=load.tokens_per_step,
                     kv_used_tokens=load.kv_used_tokens, kv_limit_tokens=load.kv_limit_tokens,
                     recent_step_s=load.recent_step_s, lone_step_s=load.lone_step_s,
                     drafting_s=dict(load.drafting_s)))


# --------------------------------------------------------------------- engine API
def engine_request_pb(r: GenerationRequest) -> pb.EngineGenerateRequest:
    s = r.sampling
    inner = pb.GenerateRequest(prompt=r.prompt or "", messages=[pb.ChatMessage(role=m.role, content=m.content)
                                                                for m in r.messages],
                               max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                               stop=list(s.stop))
    if s.seed is not None:
        inner.seed = s.seed
    return pb.EngineGenerateRequest(request_id=r.request_id, request=inner, arm=r.arm.name,
                                    min_confidence=r.min_confidence)


def engine_request_from_pb(request: pb.EngineGenerateRequest) -> GenerationRequest:
    r = request.request
    return GenerationRequest(
        request_id=request.request_id, prompt=r.prompt or None,
        messages=tuple(ChatMessage(m.role, m.content) for m in r.messages), arm=Arm.parse(request.arm),
        min_confidence=min(max(request.min_confidence, 0.0), 1.0) if math.isfinite(request.min_confidence) else 0.0,
        sampling=SamplingParams(max_tokens=r.max_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                seed=_opt(r, "seed"), stop=tuple(r.stop)))


def result_pb(res: GenerationResult) -> pb.EngineResult:
    s = res.stats
    return pb.EngineResult(
        text=res.text, token_ids=list(res.token_ids), finish_reason=s.finish_reason, prompt_tokens=s.prompt_tokens,
        output_tokens=s.output_tokens, drafted_per_round=s.drafted_per_round, accepted_per_round=s.accepted_per_round,
        verified_per_round=s.verified_per_round, rounds=s.rounds, queue_s=s.queue_s, prefill_s=s.prefill_s,
        draft_s=s.draft_s, verify_s=s.verify_s, ttft_s=s.ttft_s, total_s=s.total_s, seed=s.seed, arm=s.arm,
        acceptance_source=s.acceptance_source, speculation_s=s.speculation_s, draft_error=s.draft_error)


def result_from_pb(request_id: str, r: pb.EngineResult) -> GenerationResult:
    stats = GenerationStats(
        arm=r.arm, seed=r.seed, prompt_tokens=r.prompt_tokens, output_tokens=r.output_tokens,
        finish_reason=r.finish_reason, rounds=r.rounds, drafted_per_round=list(r.drafted_per_round),
        verified_per_round=list(r.verified_per_round), accepted_per_round=list(r.accepted_per_round),
        queue_s=r.queue_s, prefill_s=r.prefill_s, draft_s=r.draft_s, verify_s=r.verify_s, ttft_s=r.ttft_s,
        total_s=r.total_s, acceptance_source=r.acceptance_source or "measured",
        speculation_s=r.speculation_s if r.HasField("speculation_s") else None, draft_error=r.draft_error)
    return GenerationResult(request_id, r.text, tuple(r.token_ids), stats)


def load_from_pb(ld: pb.Load) -> LoadSnapshot:
    return LoadSnapshot(ld.running, ld.waiting, ld.tokens_per_step, ld.kv_used_tokens, ld.kv_limit_tokens,
                        ld.recent_step_s, tuple(ld.lone_step_s), tuple(sorted(ld.drafting_s.items())))


def menu_from_status(s: pb.EngineStatus | None) -> ArmMenu:
    if s is None:
        return ArmMenu((), 1, 1, frozenset())
    kinds = tuple((k.draft, DraftKind(k.kind, k.model or None)) for k in s.draft_kinds)
    if s.arms:
        return replace(ArmMenu.of(Arm.parse(a) for a in s.arms), adaptive=s.adaptive_gamma, kinds=kinds)
    return ArmMenu(tuple(s.drafts), s.gamma_min, s.gamma_max, adaptive=s.adaptive_gamma, kinds=kinds)
