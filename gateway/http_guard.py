"""What the HTTP API checks before any request body is read (pure ASGI, in
front of the FastAPI app): the request id, the API key (no key, no body read),
the route, the content type, and a bound on the body whatever Content-Length
says (a chunked or lying body is cut off at the bound)."""

from __future__ import annotations

import json

from gateway.auth import AuthError, KeyStore
from gateway.context import clean_request_id

MAX_BODY = 8 << 20
POST_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions"})


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error JSON."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class BodyTooLarge(Exception):
    """Raised from `receive` when a body outgrows the bound mid-stream (the API
    turns it into a 413 and closes the connection)."""


class RequestGuard:
    def __init__(self, app, keys: KeyStore, max_body: int = MAX_BODY, protected_get: set[str] = frozenset()):
        self.app, self.keys, self.max_body, self.protected_get = app, keys, max_body, protected_get

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers: dict[str, str] = {}
        for k, v in scope.get("headers") or ():
            headers[k.decode("latin-1").lower()] = v.decode("latin-1")
        rid = clean_request_id(headers.get("x-request-id"))
        scope["specgate.request_id"] = rid
        method, path = scope["method"], scope["path"].rstrip("/") or "/"
        if method == "POST":
            if path not in POST_ROUTES:
                return await _refuse(send, rid, 404, error_body(f"no route {path}", code="not_found"))
            try:
                scope["specgate.tenant"] = self.keys.authenticate(headers.get("authorization"), None, rid)
            except AuthError as e:
                return await _refuse(send, rid, e.status, error_body(
                    e.message, "authentication_error" if e.status == 401 else "permission_error",
                    code="invalid_api_key" if e.status == 401 else None))
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            if ctype != "application/json":
                return await _refuse(send, rid, 415, error_body(
                    f"Content-Type must be application/json, got {ctype[:60]!r}", param="Content-Type"))
            length = headers.get("content-length")
            if length is not None:
                if not (length.isascii() and length.isdigit()):
                    return await _refuse(send, rid, 400, error_body("Content-Length must be a non-negative integer",
                                                                    param="Content-Length"))
                if int(length) > self.max_body:
                    return await _refuse(send, rid, 413, error_body(f"body larger than {self.max_body} bytes"))
            receive = _bounded(receive, self.max_body)
        elif method == "GET" and path in self.protected_get and self.keys.enabled:
            try:
                self.keys.authenticate(headers.get("authorization"), None, rid)
            except AuthError as e:
                return await _refuse(send, rid, e.status, error_body(e.message, "authentication_error",
                                                                     code="invalid_api_key"))
        await self.app(scope, receive, send)  # the API answers BodyTooLarge with 413 itself


def _bounded(receive, limit: int):
    seen = 0

    async def bounded():
        nonlocal seen
        msg = await receive()
        if msg["type"] == "http.request":
            seen += len(msg.get("body", b""))
            if seen > limit:
                raise BodyTooLarge()
        return msg
    return bounded


async def _refuse(send, rid: str, status: int, body: dict) -> None:
    """A response sent without reading the body: the connection closes after it,
    so unread bytes are never taken for the next request."""
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            (b"x-request-id", rid.encode("latin-1", "replace")), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": data})
