"""gRPC servicers: one method per RPC, translating protobuf <-> domain
(gateway/pbconv.py) and domain errors -> status codes. No logic of their own."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from engines.errors import Cancelled, EngineUnavailable, InvalidRequest, Overloaded
from gateway.context import current_call
from gateway.endpoints.local import LocalEndpoint
from gateway.pb import specgate_pb2 as pb
from gateway.pb import specgate_pb2_grpc as pb_grpc
from gateway.pbconv import (
    decision_pb,
    engine_request_from_pb,
    engine_status_pb,
    features_pb,
    response_pb,
    result_pb,
    to_domain,
)
from gateway.service import GatewayService, Served

log = logging.getLogger(__name__)


async def abort_for(context, e: BaseException, request_id: str):
    """Map an error to its status code. Unexpected errors say INTERNAL with the
    request id (the traceback goes to the log, never to the client)."""
    if isinstance(e, InvalidRequest):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{e.field}: {e.message}")
    if isinstance(e, Overloaded):
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"overloaded: {e} (request {request_id})")
    if isinstance(e, Cancelled):
        await context.abort(grpc.StatusCode.CANCELLED, f"cancelled (request {request_id})")
    if isinstance(e, EngineUnavailable):
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"{e} (request {request_id})")
    if isinstance(e, TimeoutError):
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"{e} (request {request_id})")
    log.error("request %s failed", request_id, exc_info=e)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error (request {request_id})")


def _served_pb(rid: str, s: Served) -> pb.GenerateResponse:
    return response_pb(rid, s.result, s.decision, s.engine, s.queue_s, s.ttft_s, s.total_s)


class GatewayServicer(pb_grpc.GatewayServicer):
    def __init__(self, service: GatewayService, max_prompt_chars: int = 1_000_000):
        self.service = service
        self.max_prompt_chars = max_prompt_chars

    def _admit(self, request):
        """Validate and take a generation slot (raises before anything runs)."""
        req = to_domain(request, current_call(), self.max_prompt_chars)
        self.service.admit()
        return req

    async def Generate(self, request, context):
        rid, arrived = current_call().request_id, time.perf_counter()
        error, resp = None, None
        try:
            req = self._admit(request)
        except Exception as e:  # noqa: BLE001 - mapped to a status below
            await abort_for(context, e, rid)
        try:
            events = self.service.generate(req, arrived)
            try:
                async for ev in events:
                    if isinstance(ev, Served):
                        resp = _served_pb(rid, ev)
            finally:
                await events.aclose()  # the request's span ends here, not when the generator is collected
        except Exception as e:  # noqa: BLE001
            error = e
        finally:
            self.service.release()
        if error is not None:
            await abort_for(context, error, rid)
        if resp is None:
            await abort_for(context, EngineUnavailable("generation ended without a result"), rid)
        return resp

    async def GenerateStream(self, request, context):
        rid, arrived = current_call().request_id, time.perf_counter()
        error = None
        try:
            req = self._admit(request)
        except Exception as e:  # noqa: BLE001
            await abort_for(context, e, rid)
        try:
            events = self.service.generate(req, arrived)
            try:
                async for ev in events:
                    if isinstance(ev, Served):
                        yield pb.GenerateStreamResponse(request_id=rid, final=_served_pb(rid, ev))
                    elif isinstance(ev, str) and ev:
                        yield pb.GenerateStreamResponse(request_id=rid, text=ev)
            finally:
                await events.aclose()
        except Exception as e:  # noqa: BLE001
            error = e
        finally:
            self.service.release()
        if error is not None:
            await abort_for(context, error, rid)

    async def Decide(self, request, context):
        rid = current_call().request_id
        try:
            d, f = self.service.decide(to_domain(request, current_call(), self.max_prompt_chars))
        except Exception as e:  # noqa: BLE001
            await abort_for(context, e, rid)
        return pb.DecideResponse(request_id=rid, decision=decision_pb(d), features=features_pb(f))

    async def GetStatus(self, request, context):
        engines = [engine_status_pb(e.id, e.address, e.healthy, e.arms(), e.load(), e.max_context())
                   for e in self.service.router.endpoints]
        p = self.service.policy
        return pb.GetStatusResponse(engines=engines, policy_version=p.model.version, rules_version=p.rules.digest)


class EngineServicer(pb_grpc.EngineServicer):
    """The internal API of an engine worker: one built-in engine behind it."""

    def __init__(self, engine, id: str = "engine"):
        self.engine, self.id = engine, id
        self._local = LocalEndpoint(engine, id)

    async def Generate(self, request, context):
        rid = request.request_id or current_call().request_id
        error, handle, finished = None, None, False
        try:
            handle = await self._local.submit(engine_request_from_pb(request))
            async for delta in handle:
                yield pb.EngineEvent(text=delta.text)
            result = await handle.result()
            finished = True
            yield pb.EngineEvent(result=result_pb(result))
        except Exception as e:  # noqa: BLE001 - mapped to a status below
            error = e
        finally:
            if handle is not None and not finished:
                handle.cancel()  # the gateway went away: free the slot
        if error is not None:
            await abort_for(context, error, rid)

    async def Status(self, request, context):
        return engine_status_pb(self.id, "", not self.engine.closed, self.engine.arms(), self.engine.load(),
                                self.engine.max_context)

    async def CountTokens(self, request, context):
        if len(request.text) > 1_000_000:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "text: longer than 1000000 characters")
        return pb.CountTokensResponse(tokens=await asyncio.to_thread(self.engine.count_tokens, request.text))
