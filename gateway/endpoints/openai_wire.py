"""The wire format of OpenAI-compatible servers, as the endpoint reads it:
server-sent events, error bodies, per-request acceptance fields, and the
Prometheus names of their load gauges and speculation counters. Every read is
bounded: a broken or hostile server cannot make the gateway buffer without end."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx

from engines.errors import EngineUnavailable, InvalidRequest, Overloaded

MAX_LINE = 1 << 20  # one SSE line; a longer one is a broken server
MAX_ERROR_BODY = 64 << 10
MAX_WHOLE_BODY = 16 << 20  # a server that ignored stream=true answers with one JSON body

# Prometheus names per server kind: (running, waiting) gauges and (drafted, accepted) counters.
LOAD_METRICS = {
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting"),
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs"),
    "llamacpp": ("llamacpp:requests_processing", "llamacpp:requests_deferred"),
}
SPEC_COUNTERS = {
    "vllm": ("vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"),
}


def read_acceptance(chunk: dict) -> tuple[int, int] | None:
    """(drafted, accepted) if this response chunk reports them."""
    metrics = chunk.get("metrics")
    spec = metrics.get("speculative_decoding") if isinstance(metrics, dict) else None
    try:
        if isinstance(spec, dict) and "num_draft_tokens" in spec:
            return int(spec["num_draft_tokens"]), int(spec.get("num_accepted_draft_tokens", 0))
        t = chunk.get("timings")
        if isinstance(t, dict) and "draft_n" in t:
            return int(t["draft_n"]), int(t.get("draft_n_accepted", 0))
        m = chunk.get("meta_info")
        if isinstance(m, dict) and "spec_draft_token_num" in m and "spec_accept_rate" in m:
            drafted = int(m["spec_draft_token_num"])
            return drafted, int(round(drafted * float(m["spec_accept_rate"])))
    except (TypeError, ValueError, OverflowError):
        return None  # a malformed figure is no figure
    return None


def rounds_from_rate(output_tokens: int, gamma: int, rate: float) -> int:
    """Rounds that emit `output_tokens` when γ are drafted per round and a share
    `rate` of drafts is accepted: each round yields 1 + rate·γ tokens."""
    return max(1, round(max(output_tokens - 1, 1) / (1.0 + rate * gamma)))


class Limited(Exception):
    """The server sent more than we read from it."""


async def read_capped(resp: httpx.Response, limit: int) -> bytes:
    buf = bytearray()
    async for chunk in resp.aiter_bytes():
        buf += chunk
        if len(buf) > limit:
            raise Limited(f"more than {limit} bytes")
    return bytes(buf)


def as_count(v) -> int:
    try:
        return max(0, int(v or 0))
    except (TypeError, ValueError, OverflowError):
        return 0


async def read_capped_quiet(resp: httpx.Response, limit: int) -> bytes:
    try:
        return await read_capped(resp, limit)
    except Limited:
        return b"(error body too long)"


async def _lines(resp: httpx.Response) -> AsyncIterator[bytes]:
    """Lines of the body, each at most MAX_LINE bytes (a longer one is a broken server)."""
    buf = b""
    async for chunk in resp.aiter_bytes():
        buf += chunk
        while True:
            nl = buf.find(b"\n")
            if nl < 0:
                break
            yield buf[:nl]
            buf = buf[nl + 1:]
        if len(buf) > MAX_LINE:
            raise Limited("SSE line too long")
    if buf:
        yield buf


async def sse_events(resp: httpx.Response) -> AsyncIterator[dict]:
    """JSON payloads of `data:` lines until `data: [DONE]` or the end. A plain
    JSON body (a server that ignored stream=true) is one event."""
    first, whole = True, None
    async for raw in _lines(resp):
        line = raw.strip()
        if whole is not None:
            whole += raw + b"\n"
            if len(whole) > MAX_WHOLE_BODY:
                raise Limited("response body too long")
            continue
        if first and line.startswith(b"{"):
            whole = raw + b"\n"
            continue
        if line:
            first = False
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        try:
            event = json.loads(data)
        except ValueError:
            raise ValueError(f"malformed SSE data: {data[:80]!r}") from None
        if isinstance(event, dict):
            yield event
    if whole is not None:
        event = json.loads(whole)
        if isinstance(event, dict):
            yield event


def error_message(payload: dict) -> str:
    err = payload.get("error", payload)
    if isinstance(err, dict):
        return str(err.get("message") or err.get("detail") or err)[:500]
    return str(err)[:500]


def http_error(server: str, status: int, body: bytes) -> Exception:
    try:
        detail = error_message(json.loads(body))
    except (ValueError, AttributeError):
        detail = body.decode("utf-8", "replace")[:500]
    if status in (400, 404, 413, 422):
        return InvalidRequest("request", f"server {server} refused it (HTTP {status}): {detail}")
    if status == 429:
        return Overloaded(f"server {server}: HTTP 429: {detail}")
    return EngineUnavailable(f"server {server}: HTTP {status}: {detail}", retryable=False)
