"""OpenAI-compatible HTTP endpoint: /v1/completions, /v1/chat/completions,
/v1/models, and a Prometheus /metrics, backed by the same GatewayService (same
decision, engines, telemetry and traces) as the gRPC API.

Point an OpenAI SDK's base_url at http://HOST:PORT/v1 and every request gets the
adaptive decoding policy. The decision and acceptance stats come back in a
`specgate` object and in `usage` (num_draft_tokens / num_accepted_draft_tokens),
and as X-Specgate-* response headers for streaming clients.
"""

from __future__ import annotations

import json
import logging
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from engines.api import Cancelled, InvalidRequest, Overloaded
from gateway.interceptors import CallInfo, KeyStore, _current, new_request_id
from gateway.router import EngineUnavailable
from gateway.service import GatewayService, Served, validate
from policy.decide import Decision

log = logging.getLogger(__name__)

MAX_BODY = 8 << 20
MODEL_ID = "specgate"


class HTTPError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> bytes:
        return json.dumps({"error": {"message": self.message, "type": self.type, "param": self.param,
                                     "code": self.code}}).encode()


def _error_for(e: Exception, rid: str) -> HTTPError:
    if isinstance(e, HTTPError):
        return e
    if isinstance(e, InvalidRequest):
        return HTTPError(400, f"{e.field}: {e.message}", param=e.field)
    if isinstance(e, Overloaded):
        return HTTPError(429, f"overloaded: {e} (request {rid})", "rate_limit_error", code="overloaded")
    if isinstance(e, EngineUnavailable):
        return HTTPError(503, f"{e} (request {rid})", "service_unavailable", code="engine_unavailable")
    if isinstance(e, Cancelled):
        return HTTPError(499, f"cancelled (request {rid})", "cancelled")
    log.error("request %s failed", rid, exc_info=e)
    return HTTPError(500, f"internal error (request {rid})", "server_error")


def _num(body: dict, name: str, kind):
    v = body.get(name)
    if v is None:
        return None
    if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise HTTPError(400, f"{name}: must be an integer", param=name)
    if kind is float and (isinstance(v, bool) or not isinstance(v, (int, float))):
        raise HTTPError(400, f"{name}: must be a number", param=name)
    return kind(v)


def parse_body(body: dict, chat: bool, rid: str, tenant: str, max_prompt_chars: int):
    """OpenAI request fields -> a validated GatewayRequest (InvalidRequest/HTTPError name the field)."""
    if not isinstance(body, dict):
        raise HTTPError(400, "the body must be a JSON object")
    model = body.get("model", MODEL_ID)
    if not isinstance(model, str):
        raise HTTPError(400, "model: must be a string", param="model")
    n = body.get("n", 1)
    if n != 1:
        raise HTTPError(400, "n: only n=1 is supported (one completion per request)", param="n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise HTTPError(400, "stream: must be true or false", param="stream")
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise HTTPError(400, "stop: must be a string or a list of strings", param="stop")
    prompt, messages = "", []
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise HTTPError(400, "messages: must be a non-empty list", param="messages")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise HTTPError(400, f"messages[{i}]: needs a string role and a string content",
                                param=f"messages[{i}]")
            messages.append((m["role"], m["content"]))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise HTTPError(400, "prompt: must be a string", param="prompt")
    ext = body.get("specgate") or {}
    if not isinstance(ext, dict):
        raise HTTPError(400, "specgate: must be an object", param="specgate")
    max_tokens = _num(body, "max_completion_tokens", int) if chat and "max_completion_tokens" in body \
        else _num(body, "max_tokens", int)
    seed = _num(body, "seed", int)
    if seed is not None and seed < 0:
        raise HTTPError(400, "seed: must be >= 0", param="seed")
    req = validate(rid, tenant, prompt, messages, max_tokens=max_tokens,
                   temperature=_num(body, "temperature", float), top_p=_num(body, "top_p", float),
                   top_k=_num(body, "top_k", int), seed=seed, stop=stop,
                   category=str(ext.get("category") or ""), expected_output_tokens=_num(ext, "expected_output_tokens", int),
                   arm=str(ext.get("arm") or ""), max_prompt_chars=max_prompt_chars)
    return req, stream, model


def decision_json(d: Decision) -> dict:
    return {"arm": d.arm.name, "speculative": not d.arm.is_plain, "draft": d.arm.draft, "gamma": d.arm.gamma,
            "source": d.source, "rule": d.rule, "policy_version": d.policy_version, "rules_version": d.rules_version,
            "predicted_speedup": d.predicted_speedup.get(d.arm.name, 1.0), "explored": d.explored,
            "reason": d.reason}


def outcome_json(s: Served) -> tuple[dict, dict]:
    st = s.result.stats
    usage = {"prompt_tokens": st.prompt_tokens, "completion_tokens": st.output_tokens,
             "total_tokens": st.prompt_tokens + st.output_tokens,
             "num_draft_tokens": st.drafted, "num_accepted_draft_tokens": st.accepted}
    ext = {"decision": decision_json(s.decision), "engine": s.engine, "seed": st.seed,
           "spec": {"drafted": st.drafted, "accepted": st.accepted, "acceptance_rate": st.acceptance_rate,
                    "mean_accepted_length": st.mean_accepted_length, "rounds": st.rounds,
                    "acceptance_source": st.acceptance_source},
           "timings": {"queue_s": s.queue_s, "ttft_s": s.ttft_s, "total_s": s.total_s}}
    return usage, ext


def decision_headers(d: Decision, rid: str) -> list[tuple[str, str]]:
    return [("X-Request-Id", rid), ("X-Specgate-Arm", d.arm.name), ("X-Specgate-Source", d.source),
            ("X-Specgate-Policy-Version", d.policy_version),
            ("X-Specgate-Predicted-Speedup", f"{d.predicted_speedup.get(d.arm.name, 1.0):.3f}")]


def make_handler(service: GatewayService, keys: KeyStore, metrics: Callable[[], bytes] | None,
                 max_prompt_chars: int):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "specgate"

        def log_message(self, fmt, *args):  # route access logs through logging, quietly
            log.debug("%s %s", self.address_string(), fmt % args)

        # plumbing
        def _send(self, status: int, body: bytes, ctype="application/json", headers=()):
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            for k, v in headers:
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def _fail(self, e: Exception, rid: str):
            err = _error_for(e, rid)
            self._send(err.status, err.body(), headers=[("X-Request-Id", rid)])

        def _auth(self, rid: str, method: str) -> str:
            if not keys.enabled:
                return ""
            scheme, _, key = self.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not key:
                raise HTTPError(401, f"missing API key: send 'Authorization: Bearer <key>' (request {rid})",
                                "authentication_error", code="invalid_api_key")
            found = keys.lookup(key.strip())
            if found is None:
                raise HTTPError(401, f"unknown API key (request {rid})", "authentication_error",
                                code="invalid_api_key")
            tenant, methods = found
            if methods is not None and method not in methods:
                raise HTTPError(403, f"tenant {tenant!r} may not call {method} (request {rid})",
                                "permission_error")
            return tenant

        def _rid(self) -> str:
            rid = (self.headers.get("X-Request-Id") or "")[:128]
            return rid if rid and rid.isprintable() else new_request_id()

        # routes
        def do_GET(self):
            rid = self._rid()
            try:
                if self.path == "/metrics" and metrics is not None:
                    self._send(200, metrics(), "text/plain; version=0.0.4")
                    return
                if self.path.rstrip("/") == "/v1/models":
                    self._auth(rid, "GetStatus")
                    body = {"object": "list", "data": [{"id": MODEL_ID, "object": "model", "created": 0,
                                                        "owned_by": "specgate"}]}
                    self._send(200, json.dumps(body).encode(), headers=[("X-Request-Id", rid)])
                    return
                raise HTTPError(404, f"no route {self.path}", code="not_found")
            except Exception as e:  # noqa: BLE001
                self._fail(e, rid)

        def do_POST(self):
            rid = self._rid()
            path = self.path.rstrip("/")
            chat = path == "/v1/chat/completions"
            token = None
            self._streaming = False  # one handler serves every request of a keep-alive connection
            try:
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_BODY:
                    self.close_connection = True  # the body stays unread
                    raise HTTPError(413, f"body larger than {MAX_BODY} bytes")
                raw = self.rfile.read(length)  # read before any refusal, so the connection stays usable
                if path not in ("/v1/completions", "/v1/chat/completions"):
                    raise HTTPError(404, f"no route {self.path}", code="not_found")
                tenant = self._auth(rid, "GenerateStream")
                token = _current.set(CallInfo(rid, tenant, "http" + path))
                try:
                    body = json.loads(raw or b"null")
                except ValueError:
                    raise HTTPError(400, "the body is not valid JSON") from None
                req, stream, model = parse_body(body, chat, rid, tenant, max_prompt_chars)
                self._serve(req, stream, model, chat, rid)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client went away; its cancel callbacks already ran
            except Exception as e:  # noqa: BLE001
                if not getattr(self, "_streaming", False):
                    self._fail(e, rid)
            finally:
                if token is not None:
                    _current.reset(token)

        def _serve(self, req, stream: bool, model: str, chat: bool, rid: str):
            cancels: list[Callable[[], None]] = []
            events = service.generate(req, cancels.append)
            created = int(time.time())
            kind = "chat.completion" if chat else "text_completion"
            try:
                decision = next(events)
                if not stream:
                    text, served = [], None
                    for ev in events:
                        if isinstance(ev, Served):
                            served = ev
                        elif isinstance(ev, str):
                            text.append(ev)
                    usage, ext = outcome_json(served)
                    choice = {"index": 0, "finish_reason": served.result.stats.finish_reason, "logprobs": None}
                    if chat:
                        choice["message"] = {"role": "assistant", "content": served.result.text}
                    else:
                        choice["text"] = served.result.text
                    out = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}", "object": kind, "created": created,
                           "model": model, "choices": [choice], "usage": usage, "specgate": ext}
                    self._send(200, json.dumps(out).encode(), headers=decision_headers(decision, rid))
                    return
                self._stream(events, decision, model, chat, rid, created)
            except (BrokenPipeError, ConnectionResetError):
                for cancel in cancels:  # free the engine slot at once
                    cancel()
                raise
            finally:
                events.close()

        def _stream(self, events, decision, model, chat, rid, created):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            for k, v in decision_headers(decision, rid):
                self.send_header(k, v)
            self.end_headers()
            self._streaming = True
            kind = "chat.completion.chunk" if chat else "text_completion"
            cid = f"{'chatcmpl' if chat else 'cmpl'}-{rid}"

            def send(obj):
                data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            def chunk(text=None, finish=None, role=False):
                if chat:
                    delta = {"role": "assistant"} if role else ({"content": text} if text is not None else {})
                    c = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
                else:
                    c = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
                return {"id": cid, "object": kind, "created": created, "model": model, "choices": [c]}

            if chat:
                send(chunk(role=True))
            try:
                for ev in events:
                    if isinstance(ev, Served):
                        usage, ext = outcome_json(ev)
                        send({**chunk(finish=ev.result.stats.finish_reason), "usage": usage, "specgate": ext})
                    elif isinstance(ev, str) and ev:
                        send(chunk(text=ev))
            except (BrokenPipeError, ConnectionResetError):
                raise
            except Exception as e:  # noqa: BLE001 - headers are gone: report in the stream
                send(json.loads(_error_for(e, rid).body()))
            send(b"[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    return Handler


def prometheus_metrics() -> tuple[object, Callable[[], bytes]]:
    """A metric reader for the MeterProvider and a function rendering /metrics."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import REGISTRY, generate_latest

    return PrometheusMetricReader(), lambda: generate_latest(REGISTRY)


def create_http_server(address: str, service: GatewayService, keys: KeyStore,
                       metrics: Callable[[], bytes] | None = None,
                       max_prompt_chars: int = 1_000_000) -> tuple[ThreadingHTTPServer, int]:
    from gateway.server import is_loopback

    if not keys.enabled and not is_loopback(address):
        raise ValueError(f"refusing to serve HTTP on {address} without API keys")
    host, _, port = address.rpartition(":")
    httpd = ThreadingHTTPServer((host.strip("[]") or "127.0.0.1", int(port)),
                                make_handler(service, keys, metrics, max_prompt_chars))
    httpd.daemon_threads = True
    return httpd, httpd.server_address[1]
