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
Errors: a connection refused or lost before an answer may be retried on another
endpoint; everything else is mapped to a status and not retried.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import httpx

from engines.api import GenerationRequest, GenerationResult, GenerationStats, LoadSnapshot, TokenDelta
from engines.arms import ArmMenu, DraftKind, parse_arm_specs
from engines.errors import Cancelled, EngineUnavailable, InvalidRequest, Overloaded
from gateway.config import OpenAIServerConfig
from gateway.endpoints.health import HealthState
from gateway.endpoints.openai_wire import (
    LOAD_METRICS,
    MAX_ERROR_BODY,
    SPEC_COUNTERS,
    Limited,
    as_count,
    error_message,
    http_error,
    read_acceptance,
    read_capped,
    read_capped_quiet,
    rounds_from_rate,
    sse_events,
)
from gateway.endpoints.prometheus import MAX_METRICS_BYTES, parse_sums


class OpenAIServerEndpoint:
    def __init__(self, config: OpenAIServerConfig):
        self.config = config
        self.id = config.id or config.url.rstrip("/")
        self.address = config.url.rstrip("/")
        self._menu = replace(ArmMenu.of(parse_arm_specs(config.arms, ranges=config.gamma_field is not None)),
                             kinds=tuple((d, DraftKind(k)) for d, k in sorted(config.draft_kinds.items())))
        key = os.environ.get(config.api_key_env, "") if config.api_key_env else ""
        self._headers = {"Content-Type": "application/json", "Accept": "text/event-stream, application/json"}
        if key:
            self._headers["Authorization"] = f"Bearer {key}"
        self.model = config.model  # None: discovered at the first health check ("" if the server lists none)
        self.health_path = config.health_path or ("/v1/models" if config.kind == "generic" else "/health")
        self._health = HealthState(f"server {self.id} at {self.address}")
        self._client: httpx.AsyncClient | None = None
        self._inflight = 0
        self._gauges: tuple[float, float] | None = None  # (running, waiting) from the last scrape
        self._counters: tuple[float, float] | None = None  # (drafted, accepted) totals from the last scrape

    async def open(self) -> None:
        if self._client is None:
            c = self.config
            self._client = httpx.AsyncClient(
                base_url=self.address, headers=self._headers, follow_redirects=False,
                timeout=httpx.Timeout(c.read_timeout_s, connect=c.connect_timeout_s),
                limits=httpx.Limits(max_connections=c.max_inflight + 4, max_keepalive_connections=32))

    async def _get(self, path: str, limit: int) -> tuple[int, bytes]:
        await self.open()
        async with self._client.stream("GET", path, timeout=self.config.connect_timeout_s + 3.0) as resp:
            return resp.status_code, await read_capped(resp, limit)

    # ---------------------------------------------------------------- health and load
    @property
    def healthy(self) -> bool:
        return self._health.healthy

    async def check(self) -> bool:
        """One health check and metrics scrape (rotation rules: health.py)."""
        try:
            status, _ = await self._get(self.health_path, MAX_ERROR_BODY)
            if status != 200:
                raise OSError(f"HTTP {status} from {self.health_path}")
            if self.model is None:
                await self._discover_model()
            await self.scrape()
            self._health.passed(f" (arms {[a.name for a in self._menu.all_arms()]})")
        except (OSError, ValueError, KeyError, TypeError, httpx.HTTPError, Limited) as e:
            self._health.failed(f"{type(e).__name__}: {e}")
        return self._health.healthy

    async def _discover_model(self) -> None:
        """The model name to send: the first one the server lists (asked once)."""
        status, body = await self._get("/v1/models", MAX_ERROR_BODY)
        models = (json.loads(body).get("data") or []) if status == 200 else []
        self.model = str(models[0]["id"]) if models else ""

    async def scrape(self) -> None:
        names = LOAD_METRICS.get(self.config.kind, ()) + SPEC_COUNTERS.get(self.config.kind, ())
        if not self.config.metrics_path or not names:
            return
        try:
            status, body = await self._get(self.config.metrics_path, MAX_METRICS_BYTES)
        except (OSError, httpx.HTTPError, Limited):
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

    def forget_counters(self) -> None:
        """Drop the last scraped speculation totals (a server restarted without them)."""
        self._counters = None

    def mark_failed(self) -> None:
        self._health.mark_failed()

    def arms(self) -> ArmMenu:
        return self._menu

    def load(self) -> LoadSnapshot:
        if self._gauges is not None:
            return LoadSnapshot(running=int(self._gauges[0]), waiting=int(self._gauges[1]))
        return LoadSnapshot(running=self._inflight)

    def max_context(self) -> int:
        return self.config.max_context

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    # ---------------------------------------------------------------- requests
    async def submit(self, request: GenerationRequest) -> OpenAIServerCall:
        self._menu.check(request.arm)
        if request.prompt_token_ids is not None:
            raise InvalidRequest("prompt_token_ids", f"server {self.id} takes text, not token ids")
        if self._inflight >= self.config.max_inflight:
            raise Overloaded(f"server {self.id}: {self._inflight} requests in flight (max_inflight)")
        await self.open()
        self._inflight += 1
        return OpenAIServerCall(self, request)

    def done(self) -> None:
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
    """One streamed request: `async for` the text, then `await result()`."""

    def __init__(self, endpoint: OpenAIServerEndpoint, request: GenerationRequest):
        self.ep, self.request, self.request_id = endpoint, request, request.request_id
        self._cancelled = False
        self._result: GenerationResult | None = None
        self._started = False
        self._pieces: list[str] = []

    def cancel(self) -> None:
        self._cancelled = True

    async def result(self, timeout: float | None = None) -> GenerationResult:
        async def drain():
            async for _ in self:
                pass

        try:
            await asyncio.wait_for(drain(), timeout)
        except asyncio.TimeoutError:
            self.cancel()
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s") from None
        if self._result is None:
            raise EngineUnavailable(f"server {self.ep.id} ended the stream without a result", True)
        return self._result

    async def __aiter__(self) -> AsyncIterator[TokenDelta]:
        if self._started:
            return
        self._started = True
        try:
            async for delta in self._stream():
                yield delta
        finally:
            self.ep.done()

    async def _stream(self) -> AsyncIterator[TokenDelta]:
        ep, r = self.ep, self.request
        if self._cancelled:  # cancelled before it was sent: nothing to tell the server
            raise Cancelled(f"request {self.request_id} cancelled")
        t0 = time.perf_counter()
        counters0 = ep._counters
        path, body = ep.request_body(r)
        ttft, chunks, finish, usage, reported = None, 0, "", {}, None
        try:
            async with ep._client.stream("POST", path, json=body) as resp:
                if resp.status_code != 200:
                    raise http_error(ep.id, resp.status_code, await read_capped_quiet(resp, MAX_ERROR_BODY))
                async for event in sse_events(resp):
                    if self._cancelled:
                        break
                    if isinstance(event.get("error"), (dict, str)):
                        raise EngineUnavailable(f"server {ep.id}: {error_message(event)}", bool(self._pieces),
                                                retryable=False)
                    reported = read_acceptance(event) or reported
                    if isinstance(event.get("usage"), dict):
                        usage = event["usage"]
                    for choice in event.get("choices") or []:
                        if not isinstance(choice, dict):
                            continue
                        if "delta" in choice or "message" in choice:  # chat: streamed delta, or a whole message
                            text = (choice.get("delta") or choice.get("message") or {}).get("content")
                        else:
                            text = choice.get("text")
                        if isinstance(text, str) and text:
                            if ttft is None:
                                ttft = time.perf_counter() - t0
                            self._pieces.append(text)
                            chunks += 1
                            yield TokenDelta(text, ())
                        finish = choice.get("finish_reason") or finish
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # never reached the server: another may take it
            raise EngineUnavailable(f"server {ep.id}: cannot connect to {ep.address}: {e}") from None
        except (httpx.RemoteProtocolError, httpx.ReadError) as e:
            # lost before any answer: retryable; after output: not
            raise EngineUnavailable(f"server {ep.id}: connection lost: {type(e).__name__}: {e}",
                                    bool(self._pieces), retryable=not self._pieces) from None
        except (httpx.HTTPError, Limited, ValueError) as e:  # e.g. timed out: the server may be working on it
            if self._cancelled:
                raise Cancelled(f"request {self.request_id} cancelled") from None
            raise EngineUnavailable(f"server {ep.id}: {type(e).__name__}: {e}", bool(self._pieces),
                                    retryable=False) from None
        if self._cancelled:
            raise Cancelled(f"request {self.request_id} cancelled")
        if not finish:  # e.g. llama.cpp's server closes the stream when the prompt overflows its context
            raise EngineUnavailable(f"server {ep.id} ended the stream without finishing (prompt longer than its "
                                    f"context?)", bool(self._pieces), retryable=False)
        total = time.perf_counter() - t0
        out_tokens = as_count(usage.get("completion_tokens")) or chunks
        stats = GenerationStats(
            arm=r.arm.name, seed=r.sampling.seed or 0, prompt_tokens=as_count(usage.get("prompt_tokens")),
            output_tokens=out_tokens, finish_reason={"stop": "stop", "length": "length"}.get(finish, "stop"),
            prefill_s=ttft or total, ttft_s=ttft or total, total_s=total)
        await self._fill_acceptance(stats, reported, counters0)
        self._result = GenerationResult(self.request_id, "".join(self._pieces), (), stats)

    async def _fill_acceptance(self, st: GenerationStats, reported, counters0) -> None:
        arm = self.request.arm
        if arm.is_plain:
            st.rounds = st.output_tokens  # one target step per token, as the built-in engine counts
            return
        if reported is not None and reported[0] > 0:
            drafted, accepted = reported
            st.drafted_per_round, st.accepted_per_round = [drafted], [min(max(accepted, 0), drafted)]
            st.rounds = max(1, math.ceil(drafted / arm.gamma))
            st.acceptance_source = "reported"
            return
        if counters0 is not None and SPEC_COUNTERS.get(self.ep.config.kind):
            await self.ep.scrape()
            c1 = self.ep._counters
            if c1 is not None and c1[0] > counters0[0]:
                rate = min(max((c1[1] - counters0[1]) / (c1[0] - counters0[0]), 0.0), 1.0)
                st.rounds = rounds_from_rate(st.output_tokens, arm.gamma, rate)
                drafted = st.rounds * arm.gamma
                st.drafted_per_round, st.accepted_per_round = [drafted], [round(drafted * rate)]
                st.acceptance_source = "estimated"
                return
        st.acceptance_source = "unknown"  # rounds stay 0: the retrainer leaves the row out


