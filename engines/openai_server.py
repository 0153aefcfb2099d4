"""An OpenAI-compatible server (vLLM, SGLang, llama.cpp, TGI) as a gateway endpoint.

The server decodes; the gateway chose the arm by choosing the server (or, where
the server takes γ per request, by setting it). What comes back:

    text          streamed from /v1/chat/completions or /v1/completions (SSE)
    acceptance    reported  per request in the response: vLLM
                            `metrics.speculative_decoding` (num_draft_tokens,
                            num_accepted_draft_tokens), llama.cpp `timings`
                            (draft_n, draft_n_accepted), SGLang `meta_info`
                            (spec_draft_token_num, spec_accept_rate);
                  estimated from the server's Prometheus speculation counters
                            over the request's lifetime (vLLM), shared by
                            whatever else ran on the server meanwhile;
                  unknown   otherwise: drafted/accepted stay empty, never invented.
    load          the server's own running/waiting gauges from /metrics, else
                  this gateway's in-flight count.
Errors: connection refused or reset before an answer may be retried on another
endpoint; everything else is mapped to a status and not retried.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import threading
import time
from typing import Iterator
from urllib.parse import urlsplit

from engines.api import (
    Arm, ArmInfo, Cancelled, EngineUnavailable, GenerationRequest, GenerationResult, GenerationStats,
    InvalidRequest, LoadSnapshot, Overloaded, TokenDelta,
)
from engines.config import OpenAIServerConfig
from engines.health import HealthState
from engines.prometheus import MAX_METRICS_BYTES, parse_sums

MAX_LINE = 1 << 20  # one SSE line; a longer one is a broken server
MAX_ERROR_BODY = 64 << 10

# Prometheus names per server kind: (running, waiting) gauges and (drafted, accepted) counters.
LOAD_METRICS = {
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting"),
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs"),
    "llamacpp": ("llamacpp:requests_processing", "llamacpp:requests_deferred"),
}
SPEC_COUNTERS = {
    "vllm": ("vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"),
}


def parse_arms(specs: list[str], gamma_field: str | None) -> frozenset[Arm]:
    """'plain', 'DRAFT:G' or 'DRAFT:LO-HI' (a range needs a per-request γ field)."""
    out = set()
    for spec in specs:
        draft, sep, g = spec.strip().rpartition(":")
        lo, dash, hi = g.partition("-")
        if sep and dash:
            if not (lo.isdigit() and hi.isdigit() and 1 <= int(lo) <= int(hi)):
                raise ValueError(f"arm {spec!r}: expected DRAFT:LO-HI with 1 <= LO <= HI")
            if gamma_field is None and lo != hi:
                raise ValueError(f"arm {spec!r}: a γ range needs gamma_field (a server that takes γ per request)")
            out.update(Arm(draft, k) for k in range(int(lo), int(hi) + 1))
        else:
            try:
                out.add(Arm.parse(spec))
            except InvalidRequest as e:
                raise ValueError(f"arm {spec!r}: {e.message}") from None
    return frozenset(out)


def read_acceptance(chunk: dict) -> tuple[int, int] | None:
    """(drafted, accepted) if this response chunk reports them."""
    spec = (chunk.get("metrics") or {}).get("speculative_decoding") if isinstance(chunk.get("metrics"), dict) else None
    if isinstance(spec, dict) and "num_draft_tokens" in spec:
        return int(spec["num_draft_tokens"]), int(spec.get("num_accepted_draft_tokens", 0))
    t = chunk.get("timings")
    if isinstance(t, dict) and "draft_n" in t:
        return int(t["draft_n"]), int(t.get("draft_n_accepted", 0))
    m = chunk.get("meta_info")
    if isinstance(m, dict) and "spec_draft_token_num" in m and "spec_accept_rate" in m:
        drafted = int(m["spec_draft_token_num"])
        return drafted, int(round(drafted * float(m["spec_accept_rate"])))
    return None


def rounds_from_rate(output_tokens: int, gamma: int, rate: float) -> int:
    """Rounds that emit `output_tokens` when γ are drafted per round and a share
    `rate` of drafts is accepted: each round yields 1 + rate·γ tokens."""
    return max(1, round(max(output_tokens - 1, 1) / (1.0 + rate * gamma)))


class OpenAIServerEndpoint:
    def __init__(self, config: OpenAIServerConfig):
        self.config = config
        self.id = config.id or config.url.rstrip("/")
        self.address = config.url.rstrip("/")
        u = urlsplit(self.address)
        self._https, self._host, self._port = u.scheme == "https", u.hostname, u.port or (
            443 if u.scheme == "https" else 80)
        self._menu = ArmInfo.of(parse_arms(config.arms, config.gamma_field))
        self._key = os.environ.get(config.api_key_env, "") if config.api_key_env else ""
        self.model = config.model  # None: discovered at the first health check ("" if the server lists none)
        self.health_path = config.health_path or ("/v1/models" if config.kind == "generic" else "/health")
        self._health = HealthState(f"server {self.id} at {self.address}")
        self._lock = threading.Lock()
        self._inflight = 0
        self._gauges: tuple[float, float] | None = None  # (running, waiting) from the last scrape
        self._counters: tuple[float, float] | None = None  # (drafted, accepted) totals from the last scrape

    # ---------------------------------------------------------------- plumbing
    def _conn(self, timeout: float) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        return cls(self._host, self._port, timeout=timeout)

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json", "Accept": "text/event-stream, application/json"}
        if self._key:
            h["Authorization"] = f"Bearer {self._key}"
        return h

    def _get(self, path: str, limit: int = MAX_METRICS_BYTES) -> tuple[int, bytes]:
        conn = self._conn(self.config.connect_timeout_s)
        try:
            conn.request("GET", path, headers=self._headers())
            resp = conn.getresponse()
            return resp.status, resp.read(limit)
        finally:
            conn.close()

    # ---------------------------------------------------------------- health and load
    @property
    def healthy(self) -> bool:
        return self._health.healthy

    def check(self) -> bool:
        """One health check and metrics scrape (rotation rules: engines/health.py)."""
        try:
            status, _ = self._get(self.health_path, MAX_ERROR_BODY)
            if status != 200:
                raise OSError(f"HTTP {status} from {self.health_path}")
            if self.model is None:
                self._discover_model()
            self._scrape()
            self._health.passed(f" (arms {[a.name for a in self._menu.all_arms()]})")
        except (OSError, ValueError, KeyError, http.client.HTTPException) as e:
            self._health.failed(str(e))
        return self._health.healthy

    def _discover_model(self) -> None:
        """The model name to send: the first one the server lists (asked once)."""
        status, body = self._get("/v1/models", MAX_ERROR_BODY)
        models = json.loads(body).get("data") or [] if status == 200 else []
        self.model = str(models[0]["id"]) if models else ""

    def _scrape(self) -> None:
        names = LOAD_METRICS.get(self.config.kind, ()) + SPEC_COUNTERS.get(self.config.kind, ())
        if not self.config.metrics_path or not names:
            return
        try:
            status, body = self._get(self.config.metrics_path)
        except (OSError, http.client.HTTPException):
            return  # metrics are optional; the health check decides health
        if status != 200:
            return
        values = parse_sums(body.decode("utf-8", "replace"), set(names))
        load = LOAD_METRICS.get(self.config.kind)
        if load and load[0] in values:
            self._gauges = (values[load[0]], values.get(load[1], 0.0))
        spec = SPEC_COUNTERS.get(self.config.kind)
        if spec and spec[0] in values:
            self._counters = (values[spec[0]], values.get(spec[1], 0.0))

    def mark_failed(self) -> None:
        self._health.mark_failed()

    def arms(self) -> ArmInfo:
        return self._menu

    def load(self) -> LoadSnapshot:
        if self._gauges is not None:
            return LoadSnapshot(running=int(self._gauges[0]), waiting=int(self._gauges[1]))
        return LoadSnapshot(running=self._inflight)

    def max_context(self) -> int:
        return self.config.max_context

    def close(self) -> None:
        pass

    # ---------------------------------------------------------------- requests
    def submit(self, request: GenerationRequest) -> "OpenAIServerCall":
        if not self._menu.allows(request.arm):
            raise InvalidRequest("arm", f"server {self.id} serves {[a.name for a in self._menu.all_arms()]}, "
                                        f"not {request.arm.name}")
        if request.prompt_token_ids is not None:
            raise InvalidRequest("prompt_token_ids", f"server {self.id} takes text, not token ids")
        with self._lock:
            if self._inflight >= self.config.max_inflight:
                raise Overloaded(f"server {self.id}: {self._inflight} requests in flight (max_inflight)")
            self._inflight += 1
        return OpenAIServerCall(self, request)

    def _done(self) -> None:
        with self._lock:
            self._inflight -= 1

    def request_body(self, r: GenerationRequest) -> tuple[str, dict]:
        s = r.sampling
        body: dict = {"max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p, "stream": True,
                      "stream_options": {"include_usage": True}}
        if self.model:
            body["model"] = self.model
        if s.top_k:
            body["top_k"] = s.top_k
        if s.seed is not None:  # servers keep 32-bit seeds (llama.cpp fails mid-stream on larger ones)
            body["seed"] = s.seed % (1 << 31)
        if s.stop:
            body["stop"] = list(s.stop)
        if self.config.gamma_field and not r.arm.is_plain:
            body[self.config.gamma_field] = r.arm.gamma
        if r.messages:
            body["messages"] = [{"role": m.role, "content": m.content} for m in r.messages]
            return "/v1/chat/completions", body
        body["prompt"] = r.prompt or ""
        return "/v1/completions", body


class OpenAIServerCall:
    """One streamed request; iterate for text, then result()."""

    def __init__(self, endpoint: OpenAIServerEndpoint, request: GenerationRequest):
        self.ep, self.request, self.request_id = endpoint, request, request.request_id
        self._conn: http.client.HTTPConnection | None = None
        self._cancelled = False
        self._result: GenerationResult | None = None
        self._started = False

    def cancel(self) -> None:
        self._cancelled = True
        conn = self._conn
        if conn is not None:
            try:
                conn.sock and conn.sock.shutdown(2)  # wakes the reading thread
            except OSError:
                pass

    def result(self, timeout: float | None = None) -> GenerationResult:
        if self._result is None:
            for _ in self:
                pass
        if self._result is None:
            raise EngineUnavailable(f"server {self.ep.id} ended the stream without a result", True)
        return self._result

    def __iter__(self) -> Iterator[TokenDelta]:
        if self._started:
            return
        self._started = True
        try:
            yield from self._stream()
        finally:
            if self._conn is not None:
                self._conn.close()
            self.ep._done()

    def _open(self):
        ep, cfg = self.ep, self.ep.config
        path, body = ep.request_body(self.request)
        self._conn = conn = ep._conn(cfg.connect_timeout_s)
        try:
            conn.connect()
        except OSError as e:  # never reached the server: another endpoint may take it
            raise EngineUnavailable(f"server {ep.id}: cannot connect to {ep.address}: {e}") from None
        conn.sock.settimeout(cfg.read_timeout_s)
        try:
            conn.request("POST", path, body=json.dumps(body).encode(), headers=ep._headers())
            resp = conn.getresponse()
        except (ConnectionResetError, ConnectionRefusedError, BrokenPipeError, http.client.RemoteDisconnected) as e:
            raise EngineUnavailable(f"server {ep.id}: connection lost before an answer: {e}") from None
        except (OSError, http.client.HTTPException) as e:  # e.g. timed out: the server may be working on it
            raise EngineUnavailable(f"server {ep.id}: {type(e).__name__}: {e}", retryable=False) from None
        if resp.status != 200:
            raise _http_error(ep.id, resp.status, resp.read(MAX_ERROR_BODY))
        return resp

    def _stream(self) -> Iterator[TokenDelta]:
        ep, r = self.ep, self.request
        if self._cancelled:  # cancelled before it was sent: nothing to tell the server
            raise Cancelled(f"request {self.request_id} cancelled")
        t0 = time.perf_counter()
        counters0 = ep._counters
        resp = self._open()
        ttft = None
        pieces: list[str] = []
        chunks = 0
        finish, usage, reported = "", {}, None
        try:
            for event in _sse_events(resp):
                if self._cancelled:
                    break
                if isinstance(event.get("error"), (dict, str)):
                    raise EngineUnavailable(f"server {ep.id}: {_message(event)}", bool(pieces), retryable=False)
                reported = read_acceptance(event) or reported
                if isinstance(event.get("usage"), dict):
                    usage = event["usage"]
                for choice in event.get("choices") or []:
                    if "delta" in choice or "message" in choice:  # chat: streamed delta, or a whole message
                        text = (choice.get("delta") or choice.get("message") or {}).get("content")
                    else:
                        text = choice.get("text")
                    if text:
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        pieces.append(text)
                        chunks += 1
                        yield TokenDelta(text, ())
                    finish = choice.get("finish_reason") or finish
        except (OSError, http.client.HTTPException) as e:
            if self._cancelled:
                raise Cancelled(f"request {self.request_id} cancelled") from None
            raise EngineUnavailable(f"server {ep.id}: stream broken: {type(e).__name__}: {e}", bool(pieces),
                                    retryable=False) from None
        if self._cancelled:
            raise Cancelled(f"request {self.request_id} cancelled")
        if not finish:  # e.g. llama.cpp's server closes the stream when the prompt overflows its context
            raise EngineUnavailable(f"server {ep.id} ended the stream without finishing (prompt longer than its "
                                    f"context?)", bool(pieces), retryable=False)
        total = time.perf_counter() - t0
        out_tokens = int(usage.get("completion_tokens") or chunks)
        stats = GenerationStats(
            arm=r.arm.name, seed=r.sampling.seed or 0, prompt_tokens=int(usage.get("prompt_tokens") or 0),
            output_tokens=out_tokens, finish_reason={"stop": "stop", "length": "length"}.get(finish, finish or "stop"),
            prefill_s=ttft or total, ttft_s=ttft or total, total_s=total)
        self._fill_acceptance(stats, reported, counters0)
        self._result = GenerationResult(self.request_id, "".join(pieces), (), stats)

    def _fill_acceptance(self, st: GenerationStats, reported, counters0) -> None:
        arm = self.request.arm
        if arm.is_plain:
            st.rounds = st.output_tokens  # one target step per token, as the built-in engine counts
            return
        if reported is not None and reported[0] > 0:
            drafted, accepted = reported
            st.drafted_per_round, st.accepted_per_round = [drafted], [min(accepted, drafted)]
            st.rounds = max(1, math.ceil(drafted / arm.gamma))
            st.acceptance_source = "reported"
            return
        if counters0 is not None and SPEC_COUNTERS.get(self.ep.config.kind):
            self.ep._scrape()
            c1 = self.ep._counters
            if c1 is not None and c1[0] > counters0[0]:
                rate = min(max((c1[1] - counters0[1]) / (c1[0] - counters0[0]), 0.0), 1.0)
                st.rounds = rounds_from_rate(st.output_tokens, arm.gamma, rate)
                drafted = st.rounds * arm.gamma
                st.drafted_per_round, st.accepted_per_round = [drafted], [round(drafted * rate)]
                st.acceptance_source = "estimated"
                return
        st.acceptance_source = "unknown"  # rounds stay 0: the retrainer leaves the row out


def _sse_events(resp) -> Iterator[dict]:
    """JSON payloads of `data:` lines until `data: [DONE]` or the end. A plain
    JSON body (a server that ignored stream=true) is one event."""
    first = True
    while True:
        line = resp.readline(MAX_LINE + 1)
        if not line:
            return
        if len(line) > MAX_LINE:
            raise http.client.HTTPException("SSE line too long")
        line = line.strip()
        if first and line.startswith(b"{"):
            rest = resp.read(MAX_ERROR_BODY * 16)
            yield json.loads(line + rest)
            return
        first = False
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        try:
            event = json.loads(data)
        except ValueError:
            raise http.client.HTTPException(f"malformed SSE data: {data[:80]!r}") from None
        if isinstance(event, dict):
            yield event


def _message(payload: dict) -> str:
    err = payload.get("error", payload)
    if isinstance(err, dict):
        return str(err.get("message") or err.get("detail") or err)[:500]
    return str(err)[:500]


def _http_error(server: str, status: int, body: bytes) -> Exception:
    try:
        detail = _message(json.loads(body))
    except ValueError:
        detail = body.decode("utf-8", "replace")[:500]
    if status in (400, 404, 413, 422):
        return InvalidRequest("request", f"server {server} refused it (HTTP {status}): {detail}")
    if status == 429:
        return Overloaded(f"server {server}: HTTP 429: {detail}")
    return EngineUnavailable(f"server {server}: HTTP {status}: {detail}", retryable=False)
