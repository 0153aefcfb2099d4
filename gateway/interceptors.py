"""Cross-cutting concerns of every RPC: request ids, authentication, logging.

Servicers never look at metadata: the interceptor resolves the request id and
the tenant and hands them over through a context variable set in the thread
that runs the handler.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import logging
import os
import uuid
from dataclasses import dataclass

import grpc

from gateway.config import AuthConfig

log = logging.getLogger(__name__)

# Methods that never need a key: generic tooling must find and probe the server.
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")
MAX_REQUEST_ID = 128


@dataclass(frozen=True)
class CallInfo:
    request_id: str
    tenant: str
    method: str  # short name, e.g. "Generate"
    trace_carrier: tuple[tuple[str, str], ...] = ()  # W3C traceparent / tracestate from metadata


_current: contextvars.ContextVar[CallInfo | None] = contextvars.ContextVar("specgate_call", default=None)


def current_call() -> CallInfo:
    info = _current.get()
    return info if info is not None else CallInfo(new_request_id(), "", "")


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


class RequestIdFilter(logging.Filter):
    """Adds `request_id` to every log record emitted while an RPC is handled."""

    def filter(self, record: logging.LogRecord) -> bool:
        info = _current.get()
        record.request_id = info.request_id if info else "-"
        return True


class KeyStore:
    """Tenant API keys, compared by SHA-256 digest in constant time."""

    def __init__(self, auth: AuthConfig, env: str | None = None):
        self._keys: list[tuple[bytes, str, frozenset[str] | None]] = []
        for k in auth.keys:
            self._keys.append((bytes.fromhex(k.key_sha256), k.tenant,
                               frozenset(k.methods) if k.methods is not None else None))
        for item in filter(None, (env if env is not None else os.environ.get("SPECGATE_API_KEYS", "")).split(",")):
            tenant, sep, key = item.strip().partition(":")
            if not sep or not tenant or not key:
                raise ValueError("SPECGATE_API_KEYS must look like 'tenant:key,tenant:key'")
            self._keys.append((hashlib.sha256(key.encode()).digest(), tenant, None))

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def lookup(self, key: str) -> tuple[str, frozenset[str] | None] | None:
        digest = hashlib.sha256(key.encode()).digest()
        found = None
        for stored, tenant, methods in self._keys:  # no early exit: timing does not reveal which key
            if hmac.compare_digest(stored, digest):
                found = (tenant, methods)
        return found


def _abort_handler(code: grpc.StatusCode, message: str, streaming: bool):
    def unary(request, context):
        context.abort(code, message)

    def stream(request, context):
        context.abort(code, message)
        yield  # pragma: no cover - abort raises

    if streaming:
        return grpc.unary_stream_rpc_method_handler(stream)
    return grpc.unary_unary_rpc_method_handler(unary)


class GatewayInterceptor(grpc.ServerInterceptor):
    """Request id (from `x-request-id` metadata, else generated), echoed back in
    the initial metadata; then the API key, when keys are configured."""

    def __init__(self, keys: KeyStore):
        self.keys = keys

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None:
            return None
        method = details.method
        short = method.rsplit("/", 1)[-1]
        meta = {k: v for k, v in (details.invocation_metadata or ())}
        rid = str(meta.get("x-request-id") or "")[:MAX_REQUEST_ID] or new_request_id()
        if not rid.isprintable():
            rid = new_request_id()
        tenant = ""
        if self.keys.enabled and not method.startswith(OPEN_SERVICES):
            auth = str(meta.get("authorization", ""))
            scheme, _, key = auth.partition(" ")
            if scheme.lower() != "bearer" or not key:
                return _abort_handler(grpc.StatusCode.UNAUTHENTICATED,
                                      f"missing API key: send 'authorization: Bearer <key>' (request {rid})",
                                      handler.response_streaming)
            found = self.keys.lookup(key.strip())
            if found is None:
                log.info("rejected an unknown API key for %s (request %s)", short, rid)
                return _abort_handler(grpc.StatusCode.UNAUTHENTICATED, f"unknown API key (request {rid})",
                                      handler.response_streaming)
            tenant, methods = found
            if methods is not None and short not in methods:
                return _abort_handler(grpc.StatusCode.PERMISSION_DENIED,
                                      f"tenant {tenant!r} may not call {short} (request {rid})",
                                      handler.response_streaming)
        carrier = tuple((k, str(meta[k])) for k in ("traceparent", "tracestate") if k in meta)
        return _with_call_info(handler, CallInfo(rid, tenant, short, carrier))


def _with_call_info(handler, info: CallInfo):
    """The same handler, run with `info` as the current call and the request id
    sent back: in the trailing metadata of unary calls (sending initial metadata
    on its own costs an extra write per call), in the initial metadata of streams
    (their clients want it before the first chunk)."""

    def wrap_unary(fn):
        def call(request, context):
            token = _current.set(info)
            try:
                context.set_trailing_metadata((("x-request-id", info.request_id),))
                return fn(request, context)
            finally:
                _current.reset(token)
        return call

    def wrap_stream(fn):
        def call(request, context):
            token = _current.set(info)
            try:
                context.send_initial_metadata((("x-request-id", info.request_id),))
                yield from fn(request, context)
            finally:
                try:
                    _current.reset(token)
                except ValueError:  # resumed in another context: nothing of ours to undo
                    pass
        return call

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(wrap_unary(handler.unary_unary), handler.request_deserializer,
                                                   handler.response_serializer)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(wrap_stream(handler.unary_stream), handler.request_deserializer,
                                                    handler.response_serializer)
    return handler  # client-streaming methods: none in this API
