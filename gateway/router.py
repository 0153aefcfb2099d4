"""The engines behind a gateway and how a request finds one.

An endpoint is the embedded built-in engine, a remote worker (`specgate
engine --listen`), or an OpenAI-compatible server (vLLM, SGLang, llama.cpp;
engines/openai_server.py) configured with the arms it serves. A request goes
to a healthy endpoint that serves its arm, least loaded first; an endpoint that
fails its health checks leaves the rotation until it passes again.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterator, Protocol

import grpc

from engines.api import (
    Arm, ArmInfo, EngineError, EngineUnavailable, GenerationRequest, GenerationResult, GenerationStats,
    InvalidRequest, LoadSnapshot, Overloaded, TokenDelta,
)
from engines.health import HealthState
from gateway.pb import specgate_pb2 as pb
from gateway.pb import specgate_pb2_grpc as pb_grpc


class Endpoint(Protocol):
    id: str
    address: str

    @property
    def healthy(self) -> bool: ...

    def arms(self) -> ArmInfo: ...

    def load(self) -> LoadSnapshot: ...

    def max_context(self) -> int: ...

    def submit(self, request: GenerationRequest): ...

    def close(self) -> None: ...


class LocalEndpoint:
    """The in-process built-in engine."""

    address = "in-process"

    def __init__(self, engine, id: str = "local"):
        self.engine, self.id = engine, id

    @property
    def healthy(self) -> bool:
        return not self.engine._closed

    def arms(self) -> ArmInfo:
        return self.engine.arms()

    def load(self) -> LoadSnapshot:
        return self.engine.load()

    def max_context(self) -> int:
        return self.engine.max_context

    def submit(self, request: GenerationRequest):
        return self.engine.submit(request)

    def close(self) -> None:
        self.engine.close()


def request_to_pb(r: GenerationRequest) -> pb.EngineGenerateRequest:
    s = r.sampling
    inner = pb.GenerateRequest(prompt=r.prompt or "", messages=[pb.ChatMessage(role=m.role, content=m.content)
                                                                for m in r.messages],
                               max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                               stop=list(s.stop))
    if s.seed is not None:
        inner.seed = s.seed
    return pb.EngineGenerateRequest(request_id=r.request_id, request=inner, arm=r.arm.name)


def result_to_pb(res: GenerationResult) -> pb.EngineResult:
    s = res.stats
    return pb.EngineResult(
        text=res.text, token_ids=list(res.token_ids), finish_reason=s.finish_reason, prompt_tokens=s.prompt_tokens,
        output_tokens=s.output_tokens, drafted_per_round=s.drafted_per_round, accepted_per_round=s.accepted_per_round,
        rounds=s.rounds, queue_s=s.queue_s, prefill_s=s.prefill_s, draft_s=s.draft_s, verify_s=s.verify_s,
        ttft_s=s.ttft_s, total_s=s.total_s, seed=s.seed, arm=s.arm, acceptance_source=s.acceptance_source)


def result_from_pb(request_id: str, r: pb.EngineResult) -> GenerationResult:
    stats = GenerationStats(
        arm=r.arm, seed=r.seed, prompt_tokens=r.prompt_tokens, output_tokens=r.output_tokens,
        finish_reason=r.finish_reason, rounds=r.rounds, drafted_per_round=list(r.drafted_per_round),
        accepted_per_round=list(r.accepted_per_round), queue_s=r.queue_s, prefill_s=r.prefill_s,
        draft_s=r.draft_s, verify_s=r.verify_s, ttft_s=r.ttft_s, total_s=r.total_s,
        acceptance_source=r.acceptance_source or "measured")
    return GenerationResult(request_id, r.text, tuple(r.token_ids), stats)


class RemoteHandle:
    """A request running on a remote worker: the same shape as a local handle."""

    def __init__(self, call, request_id: str, endpoint_id: str):
        self._call, self.request_id, self._endpoint = call, request_id, endpoint_id
        self._result: GenerationResult | None = None
        self._streamed = False

    def __iter__(self) -> Iterator[TokenDelta]:
        try:
            for ev in self._call:
                if ev.HasField("result"):
                    self._result = result_from_pb(self.request_id, ev.result)
                else:
                    self._streamed = True
                    yield TokenDelta(ev.text, ())
        except grpc.RpcError as e:
            raise _map_remote_error(e, self._endpoint, self._streamed) from None

    def result(self, timeout: float | None = None) -> GenerationResult:
        if self._result is None:
            for _ in self:
                pass
        if self._result is None:
            raise EngineUnavailable(f"engine {self._endpoint} ended the stream without a result", self._streamed)
        return self._result

    def cancel(self) -> None:
        self._call.cancel()


def _map_remote_error(e: grpc.RpcError, endpoint: str, streamed: bool) -> EngineError:
    code, details = e.code(), e.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field, _, msg = details.partition(": ")
        return InvalidRequest(field, msg)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Overloaded(details)
    if code == grpc.StatusCode.CANCELLED:
        from engines.api import Cancelled
        return Cancelled(details)
    return EngineUnavailable(f"engine {endpoint}: {code.name} {details}", streamed)


class RemoteEndpoint:
    """A `specgate engine` worker over the internal gRPC API."""

    def __init__(self, address: str, id: str | None = None, timeout_s: float = 2.0):
        self.address, self.id = address, id or address
        # Short reconnect backoff: gRPC's default grows to minutes, and a worker that
        # comes back should be in rotation at the next health check.
        self._channel = grpc.insecure_channel(address, options=[("grpc.initial_reconnect_backoff_ms", 200),
                                                                ("grpc.min_reconnect_backoff_ms", 200),
                                                                ("grpc.max_reconnect_backoff_ms", 1000)])
        self._stub = pb_grpc.EngineStub(self._channel)
        self._timeout = timeout_s
        self._status: pb.EngineStatus | None = None
        self._health = HealthState(f"engine {self.id} at {address}")

    @property
    def healthy(self) -> bool:
        return self._health.healthy

    def check(self) -> bool:
        """One health check: refreshes arms and load (rotation rules: engines/health.py)."""
        try:
            # wait_for_ready: a channel in reconnect backoff would otherwise fail at once
            self._status = self._stub.Status(pb.GetStatusRequest(), timeout=self._timeout, wait_for_ready=True)
            self._health.passed()
        except grpc.RpcError as e:
            self._health.failed(e.code().name)
        return self._health.healthy

    def mark_failed(self) -> None:
        self._health.mark_failed()

    def arms(self) -> ArmInfo:
        s = self._status
        return ArmInfo(tuple(s.drafts), s.gamma_min, s.gamma_max) if s else ArmInfo((), 1, 1)

    def load(self) -> LoadSnapshot:
        s = self._status
        if s is None:
            return LoadSnapshot()
        l = s.load
        return LoadSnapshot(l.running, l.waiting, l.tokens_per_step, l.kv_used_tokens, l.kv_limit_tokens,
                            l.recent_step_s)

    def max_context(self) -> int:
        return self._status.max_context if self._status else 0

    def submit(self, request: GenerationRequest) -> RemoteHandle:
        call = self._stub.Generate(request_to_pb(request))
        return RemoteHandle(call, request.request_id, self.id)

    def close(self) -> None:
        self._channel.close()


@dataclass
class Route:
    endpoint: Endpoint
    arm: Arm
    fallback: bool  # the chosen arm was not served: plain instead


class Router:
    def __init__(self, endpoints: list[Endpoint], health_check_s: float = 2.0):
        self.endpoints = endpoints
        self._stop = threading.Event()
        self._inflight: dict[str, int] = {e.id: 0 for e in endpoints}
        self._lock = threading.Lock()
        remotes = [e for e in endpoints if hasattr(e, "check")]  # anything out of process is health-checked
        for e in remotes:
            e.check()
        self._checker = None
        if remotes:
            self._checker = threading.Thread(target=self._check_loop, args=(remotes, health_check_s),
                                             name="specgate-health", daemon=True)
            self._checker.start()

    def _check_loop(self, remotes, interval: float) -> None:
        while not self._stop.wait(interval):
            for e in remotes:
                e.check()

    def healthy(self) -> list[Endpoint]:
        return [e for e in self.endpoints if e.healthy]

    def arms(self) -> ArmInfo:
        """Everything any healthy endpoint serves (the policy's menu)."""
        live = self.healthy()
        if not live:
            return ArmInfo((), 1, 1)
        menus = [e.arms() for e in live]
        if any(m.only is not None for m in menus):  # servers configured per arm: the union of their menus
            return ArmInfo.of(a for m in menus for a in m.all_arms())
        drafts = tuple(sorted({d for m in menus for d in m.drafts}))
        return ArmInfo(drafts, min(m.gamma_min for m in menus), max(m.gamma_max for m in menus))

    def _score(self, e: Endpoint) -> int:
        l = e.load()
        return l.running + l.waiting + self._inflight.get(e.id, 0)

    def least_loaded_load(self) -> LoadSnapshot:
        live = self.healthy()
        return min((e.load() for e in live), key=lambda l: l.running + l.waiting, default=LoadSnapshot())

    def route(self, arm: Arm, exclude: set[str] = frozenset()) -> Route | None:
        live = [e for e in self.healthy() if e.id not in exclude]
        serving = [e for e in live if e.arms().allows(arm)]
        if serving:
            return Route(min(serving, key=self._score), arm, False)
        plain = [e for e in live if e.arms().allows(Arm())]
        if plain:  # nobody serves that arm right now: plain where it is served
            return Route(min(plain, key=self._score), Arm(), True)
        if live:  # only speculative servers left: the least loaded one, with its own arm
            e = min(live, key=self._score)
            return Route(e, e.arms().all_arms()[0], True)
        return None

    def track(self, endpoint_id: str, delta: int) -> None:
        """Requests this gateway has in flight per endpoint: counts between two
        load reports, so a burst does not all land on one worker."""
        with self._lock:
            self._inflight[endpoint_id] = self._inflight.get(endpoint_id, 0) + delta

    def close(self) -> None:
        self._stop.set()
        for e in self.endpoints:
            if not isinstance(e, LocalEndpoint):  # the embedded engine is closed by its owner
                e.close()
