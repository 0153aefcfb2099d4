"""Cross-cutting concerns of every gRPC call: request ids, authentication,
undecodable messages, and the call context handed to the servicers.

Servicers never look at metadata: the interceptor resolves the request id and
the tenant and sets them as the current call (gateway/context.py) in the task
that serves the RPC.
"""

from __future__ import annotations

import logging

import grpc

from gateway.auth import AuthError, KeyStore, WorkerToken
from gateway.context import CallInfo, clean_request_id, reset_call, set_call

log = logging.getLogger(__name__)

# Methods that never need a key: generic tooling must find and probe the server.
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")


class _Undecodable:
    """Stands for a request message that failed to parse (e.g. a string field
    that is not UTF-8), so that the caller hears INVALID_ARGUMENT, not INTERNAL."""

    def __init__(self, error: Exception):
        self.error = error


def _safe(deserializer):
    if deserializer is None:
        return None

    def parse(data: bytes):
        try:
            return deserializer(data)
        except Exception as e:  # noqa: BLE001 - any parse failure is the caller's malformed message
            return _Undecodable(e)
    return parse


def _refuse(code: grpc.StatusCode, message: str, streaming: bool):
    async def unary(request, context):
        await context.abort(code, message)

    async def stream(request, context):
        await context.abort(code, message)
        yield  # pragma: no cover - abort raises

    if streaming:
        return grpc.unary_stream_rpc_method_handler(stream)
    return grpc.unary_unary_rpc_method_handler(unary)


def _with_call(handler, info: CallInfo):
    """The same handler, run with `info` as the current call and the request id
    sent back: in the trailing metadata of unary calls, in the initial metadata
    of streams (their clients want it before the first chunk)."""
    bad_message = f"request: not a valid message ({{}}); string fields must be UTF-8 (request {info.request_id})"

    def wrap_unary(fn):
        async def call(request, context):
            token = set_call(info)
            try:
                context.set_trailing_metadata((("x-request-id", info.request_id),))
                if isinstance(request, _Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bad_message.format(
                        type(request.error).__name__))
                return await fn(request, context)
            finally:
                reset_call(token)
        return call

    def wrap_stream(fn):
        async def call(request, context):
            token = set_call(info)
            try:
                await context.send_initial_metadata((("x-request-id", info.request_id),))
                if isinstance(request, _Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bad_message.format(
                        type(request.error).__name__))
                async for item in fn(request, context):
                    yield item
            finally:
                reset_call(token)
        return call

    deserialize = _safe(handler.request_deserializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(wrap_unary(handler.unary_unary), deserialize,
                                                   handler.response_serializer)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(wrap_stream(handler.unary_stream), deserialize,
                                                    handler.response_serializer)
    return handler  # streaming requests: the reflection service, which needs neither


class GatewayInterceptor(grpc.aio.ServerInterceptor):
    """Request id (from `x-request-id` metadata, else generated); then the API
    key, when keys are configured."""

    def __init__(self, keys: KeyStore):
        self.keys = keys

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        short = method.rsplit("/", 1)[-1]
        meta = dict(details.invocation_metadata or ())
        rid = clean_request_id(str(meta.get("x-request-id") or ""))
        tenant = ""
        if self.keys.enabled and not method.startswith(OPEN_SERVICES):
            try:
                tenant = self.keys.authenticate(str(meta.get("authorization", "")), short, rid)
            except AuthError as e:
                if e.status == 401 and "unknown" in e.message:
                    log.info("rejected an unknown API key for %s (request %s)", short, rid)
                code = grpc.StatusCode.UNAUTHENTICATED if e.status == 401 else grpc.StatusCode.PERMISSION_DENIED
                return _refuse(code, e.message, handler.response_streaming)
        carrier = tuple((k, str(meta[k])) for k in ("traceparent", "tracestate") if k in meta)
        return _with_call(handler, CallInfo(rid, tenant, short, carrier))


class WorkerInterceptor(grpc.aio.ServerInterceptor):
    """An engine worker: the gateway's worker token, when one is configured."""

    def __init__(self, token: WorkerToken):
        self.token = token

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        meta = dict(details.invocation_metadata or ())
        rid = clean_request_id(str(meta.get("x-request-id") or ""))
        if self.token.enabled and not details.method.startswith(OPEN_SERVICES):
            if not self.token.accepts(str(meta.get("authorization", ""))):
                return _refuse(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong worker token",
                               handler.response_streaming)
        return _with_call(handler, CallInfo(rid, "", details.method.rsplit("/", 1)[-1]))
