"""The OpenAI-compatible HTTP API on FastAPI/uvicorn: /v1/completions,
/v1/chat/completions (SSE streaming or not), /v1/models and Prometheus /metrics,
backed by the same GatewayService (same decision, engines, telemetry, traces)
as the gRPC API.

Point an OpenAI SDK's base_url at http://HOST:PORT/v1 and every request gets the
adaptive decoding policy. The decision and acceptance stats come back in a
`specgate` object and in `usage` (num_draft_tokens / num_accepted_draft_tokens),
and as X-Specgate-* headers for streaming clients. Errors are OpenAI's error
JSON with the matching status, never a stack trace.

Before any body is read (gateway/http_guard.py): the API key is checked, and
the body is bounded whatever its headers say.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Annotated

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engines.errors import Cancelled, EngineUnavailable, InvalidRequest, Overloaded
from gateway.auth import AuthError, KeyStore
from gateway.context import CallInfo, reset_call, set_call
from gateway.http_guard import MAX_BODY, BodyTooLarge, RequestGuard, error_body
from gateway.service import GatewayService, Served
from gateway.validation import validate
from policy.decide import Decision

log = logging.getLogger(__name__)

MODEL_ID = "specgate"


class HTTPError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self, rid: str, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), self.status,
                            headers={"X-Request-Id": rid, **(headers or {})})


def error_for(e: BaseException, rid: str) -> HTTPError:
    if isinstance(e, HTTPError):
        return e
    if isinstance(e, InvalidRequest):
        return HTTPError(400, f"{e.field}: {e.message}", param=e.field)
    if isinstance(e, AuthError):
        if e.status == 401:
            return HTTPError(401, e.message, "authentication_error", code="invalid_api_key")
        return HTTPError(403, e.message, "permission_error")
    if isinstance(e, Overloaded):
        return HTTPError(429, f"overloaded: {e} (request {rid})", "rate_limit_error", code="overloaded")
    if isinstance(e, EngineUnavailable):
        return HTTPError(503, f"{e} (request {rid})", "service_unavailable", code="engine_unavailable")
    if isinstance(e, Cancelled):
        return HTTPError(499, f"cancelled (request {rid})", "cancelled")
    if isinstance(e, TimeoutError):
        return HTTPError(504, f"{e} (request {rid})", "timeout")
    log.error("request %s failed", rid, exc_info=e)
    return HTTPError(500, f"internal error (request {rid})", "server_error")


# ----------------------------------------------------------------------- request models
class Hints(BaseModel):
    model_config = ConfigDict(extra="forbid")
    category: StrictStr | None = None
    expected_output_tokens: StrictInt | None = None
    arm: StrictStr | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")  # name, tool_calls, ...: not used for decoding
    role: StrictStr
    content: StrictStr


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")  # user, logprobs, stream_options, ...: accepted, not used
    model: StrictStr = MODEL_ID
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    seed: Annotated[StrictInt, Field(ge=0)] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=1)] = 1
    stream: StrictBool = False
    specgate: Hints | None = None


class CompletionRequest(_Common):
    prompt: StrictStr | Annotated[list[StrictStr], Field(min_length=1, max_length=1)]


class ChatCompletionRequest(_Common):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: StrictInt | None = None


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _pydantic_error(e: ValidationError) -> HTTPError:
    err = e.errors()[0]
    # pydantic names the branch of a union it tried ('str', 'list[str]', ...): not a field
    loc = [str(x) for x in err["loc"] if str(x) not in _TYPE_TAGS and "[" not in str(x)
           and not str(x).startswith(("function-", "constrained-"))]
    param = loc[0] if loc else None
    where = ".".join(loc)
    msg = err["msg"]
    if param == "n":
        msg = "only n=1 is supported (one completion per request)"
    return HTTPError(400, f"{where or 'body'}: {msg}", param=param)


def parse_request(raw: bytes, chat: bool, rid: str, tenant: str, max_prompt_chars: int,
                  carrier: tuple[tuple[str, str], ...]):
    """Body bytes -> (GatewayRequest, stream, model), or HTTPError/InvalidRequest naming the field."""
    try:
        data = json.loads(raw or b"null")
    except (ValueError, RecursionError):
        raise HTTPError(400, "the body is not valid JSON (or is nested too deeply)") from None
    if not isinstance(data, dict):
        raise HTTPError(400, "the body must be a JSON object")
    try:
        body = (ChatCompletionRequest if chat else CompletionRequest).model_validate(data)
    except ValidationError as e:
        raise _pydantic_error(e) from None
    except RecursionError:
        raise HTTPError(400, "the body is nested too deeply") from None
    stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    hints = body.specgate or Hints()
    if chat:
        messages, prompt = [(m.role, m.content) for m in body.messages], ""
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    else:
        prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
        messages, max_tokens = [], body.max_tokens
    req = validate(rid, tenant, prompt, messages, max_tokens=max_tokens, temperature=body.temperature,
                   top_p=body.top_p, top_k=body.top_k, seed=body.seed, stop=stop, category=hints.category or "",
                   expected_output_tokens=hints.expected_output_tokens, arm=hints.arm or "",
                   max_prompt_chars=max_prompt_chars, trace_carrier=carrier)
    return req, body.stream, body.model


# ----------------------------------------------------------------------- response shapes
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
    if st.draft_error:  # the draft failed mid-request; the rest was decoded without drafts
        ext["spec"]["draft_error"] = st.draft_error
    return usage, ext


def decision_headers(d: Decision, rid: str) -> dict[str, str]:
    return {"X-Request-Id": rid, "X-Specgate-Arm": d.arm.name, "X-Specgate-Source": d.source,
            "X-Specgate-Policy-Version": d.policy_version,
            "X-Specgate-Predicted-Speedup": f"{d.predicted_speedup.get(d.arm.name, 1.0):.3f}"}


def _carrier(request: Request) -> tuple[tuple[str, str], ...]:
    return tuple((k, request.headers[k]) for k in ("traceparent", "tracestate") if k in request.headers)


# ----------------------------------------------------------------------- the app
def create_app(service: GatewayService, keys: KeyStore, metrics=None, max_prompt_chars: int = 1_000_000,
               max_body: int = MAX_BODY) -> FastAPI:
    app = FastAPI(title="specgate", openapi_url=None, docs_url=None, redoc_url=None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_exc(request: Request, exc: StarletteHTTPException):
        rid = request.scope.get("specgate.request_id", "")
        code = "not_found" if exc.status_code == 404 else None
        msg = f"no route {request.url.path}" if exc.status_code == 404 else str(exc.detail)
        return HTTPError(exc.status_code, msg, code=code).response(rid)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return HTTPError(400, str(exc.errors()[:1])).response(request.scope.get("specgate.request_id", ""))

    @app.get("/metrics")
    async def prometheus_metrics(request: Request):
        if metrics is None:
            return HTTPError(404, "metrics are off", code="not_found").response(request.scope["specgate.request_id"])
        return Response(metrics(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        rid = request.scope["specgate.request_id"]
        try:
            keys.authenticate(request.headers.get("authorization"), "GetStatus", rid)
        except AuthError as e:
            return error_for(e, rid).response(rid)
        return JSONResponse({"object": "list", "data": [{"id": MODEL_ID, "object": "model", "created": 0,
                                                         "owned_by": "specgate"}]}, headers={"X-Request-Id": rid})

    async def complete(request: Request, chat: bool):
        rid = request.scope["specgate.request_id"]
        tenant = request.scope.get("specgate.tenant", "")
        path = request.url.path
        token = set_call(CallInfo(rid, tenant, "http" + path, _carrier(request)))
        try:
            raw = await request.body()  # bounded by the guard
            req, stream, model = parse_request(raw, chat, rid, tenant, max_prompt_chars, _carrier(request))
            # the method a tenant needs depends on the body: streaming or not
            keys.authenticate(request.headers.get("authorization"), "GenerateStream" if stream else "Generate", rid)
            service.admit()
        except BodyTooLarge:
            reset_call(token)
            return HTTPError(413, f"body larger than {max_body} bytes").response(rid, {"Connection": "close"})
        except Exception as e:  # noqa: BLE001 - every refusal is error JSON
            reset_call(token)
            return error_for(e, rid).response(rid)
        events = service.generate(req, time.perf_counter())
        streaming = False
        try:
            decision = await events.__anext__()
            if stream:
                streaming = True
                return _Stream(_sse(events, chat, rid, model), _closer(events, service),
                               headers={"Cache-Control": "no-cache", **decision_headers(decision, rid)})
            served = None
            async for ev in events:
                if isinstance(ev, Served):
                    served = ev
            return JSONResponse(_whole(served, chat, rid, model), headers=decision_headers(decision, rid))
        except Exception as e:  # noqa: BLE001
            return error_for(e, rid).response(rid)
        finally:
            if not streaming:  # a stream releases when it ends (_Stream)
                await events.aclose()
                service.release()
            reset_call(token)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    return RequestGuard(app, keys, max_body=max_body, protected_get={"/metrics"} if keys.protect_metrics else set())


def _whole(served: Served, chat: bool, rid: str, model: str) -> dict:
    usage, ext = outcome_json(served)
    choice = {"index": 0, "finish_reason": served.result.stats.finish_reason, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": served.result.text}
    else:
        choice["text"] = served.result.text
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}", "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice], "usage": usage, "specgate": ext}


class _Stream(StreamingResponse):
    """SSE whose generation is closed (and its slot released) however the
    response ends: finished, failed, or the client gone before the first byte."""

    def __init__(self, body, close, headers: dict):
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self._close = close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._close()


def _closer(events, service: GatewayService):
    done = False

    async def close():
        nonlocal done
        if not done:
            done = True
            await events.aclose()  # a client that went away frees its engine slot here
            service.release()
    return close


async def _sse(events, chat: bool, rid: str, model: str):
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"
    cid = f"{'chatcmpl' if chat else 'cmpl'}-{rid}"

    def chunk(text=None, finish=None, role=False) -> dict:
        if chat:
            delta = {"role": "assistant"} if role else ({"content": text} if text is not None else {})
            c = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            c = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        return {"id": cid, "object": kind, "created": created, "model": model, "choices": [c]}

    def data(obj) -> bytes:
        return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"

    if chat:
        yield data(chunk(role=True))
    try:
        async for ev in events:
            if isinstance(ev, Served):
                usage, ext = outcome_json(ev)
                yield data({**chunk(finish=ev.result.stats.finish_reason), "usage": usage, "specgate": ext})
            elif isinstance(ev, str) and ev:
                yield data(chunk(text=ev))
    except Exception as e:  # noqa: BLE001 - the headers are gone: report in the stream
        err = error_for(e, rid)
        yield data(error_body(err.message, err.type, err.param, err.code))
    yield data(b"[DONE]")
