"""The call being served: request id, tenant, method and trace context, set by
the gRPC interceptor or the HTTP middleware and read by everything below them
(log lines say which request they belong to)."""

from __future__ import annotations

import contextvars
import logging
import uuid
from dataclasses import dataclass

MAX_REQUEST_ID = 128


@dataclass(frozen=True)
class CallInfo:
    request_id: str
    tenant: str
    method: str  # short name, e.g. "Generate"
    trace_carrier: tuple[tuple[str, str], ...] = ()  # W3C traceparent / tracestate from metadata or headers


_current: contextvars.ContextVar[CallInfo | None] = contextvars.ContextVar("specgate_call", default=None)


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


def clean_request_id(value: str | None) -> str:
    """The caller's request id if it is short and printable, else a fresh one."""
    rid = (value or "")[:MAX_REQUEST_ID]
    return rid if rid and rid.isprintable() else new_request_id()


def current_call() -> CallInfo:
    info = _current.get()
    return info if info is not None else CallInfo(new_request_id(), "", "")


def set_call(info: CallInfo) -> contextvars.Token:
    return _current.set(info)


def reset_call(token: contextvars.Token) -> None:
    try:
        _current.reset(token)
    except ValueError:  # resumed in another context: nothing of ours to undo
        pass


class RequestIdFilter(logging.Filter):
    """Adds `request_id` to every log record emitted while a call is served."""

    def filter(self, record: logging.LogRecord) -> bool:
        info = _current.get()
        record.request_id = info.request_id if info else "-"
        return True
