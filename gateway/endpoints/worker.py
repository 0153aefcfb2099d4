"""A `specgate engine` worker as an endpoint, over the internal gRPC API.

The gateway authenticates to the worker with a shared token (metadata
`authorization: Bearer TOKEN`) and/or TLS with a client certificate.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from engines.api import GenerationRequest, GenerationResult, LoadSnapshot, TokenDelta
from engines.arms import ArmMenu
from engines.errors import Cancelled, EngineError, EngineUnavailable, InvalidRequest, Overloaded
from gateway.config import RemoteEngineConfig
from gateway.endpoints.health import HealthState
from gateway.pb import specgate_pb2 as pb
from gateway.pb import specgate_pb2_grpc as pb_grpc
from gateway.pbconv import engine_request_pb, load_from_pb, menu_from_status, result_from_pb

# Short reconnect backoff: gRPC's default grows to minutes, and a worker that
# comes back should be in rotation at the next health check.
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                   ("grpc.max_reconnect_backoff_ms", 1000)]


def map_error(e: grpc.RpcError, endpoint: str, streamed: bool) -> EngineError:
    code, details = e.code(), e.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field, _, msg = details.partition(": ")
        return InvalidRequest(field, msg)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Overloaded(details)
    if code == grpc.StatusCode.CANCELLED:
        return Cancelled(details)
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return EngineUnavailable(f"engine {endpoint} refused the gateway's credentials: {details}", streamed,
                                 retryable=True)
    return EngineUnavailable(f"engine {endpoint}: {code.name} {details}", streamed)


class WorkerHandle:
    """A request running on a worker."""

    def __init__(self, call, request_id: str, endpoint_id: str):
        self._call, self.request_id, self._endpoint = call, request_id, endpoint_id
        self._result: GenerationResult | None = None
        self._streamed = False
        self._consumed = False

    async def __aiter__(self) -> AsyncIterator[TokenDelta]:
        if self._consumed:
            return
        self._consumed = True
        try:
            async for ev in self._call:
                if ev.HasField("result"):
                    self._result = result_from_pb(self.request_id, ev.result)
                else:
                    self._streamed = True
                    yield TokenDelta(ev.text, ())
        except grpc.RpcError as e:
            raise map_error(e, self._endpoint, self._streamed) from None

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
            raise EngineUnavailable(f"engine {self._endpoint} ended the stream without a result", self._streamed)
        return self._result

    def cancel(self) -> None:
        self._call.cancel()


class WorkerEndpoint:
    def __init__(self, config: RemoteEngineConfig, timeout_s: float = 2.0):
        self.config = config
        self.address, self.id = config.address, config.id or config.address
        token = os.environ.get(config.token_env, "") if config.token_env else ""
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._timeout = timeout_s
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.EngineStub | None = None
        self._status: pb.EngineStatus | None = None
        self._menu = ArmMenu((), 1, 1)
        self._health = HealthState(f"engine {self.id} at {self.address}")

    async def open(self) -> None:
        """The channel, on the serving event loop (grpc.aio channels belong to one loop)."""
        if self._channel is not None:
            return
        tls = self.config.tls
        if tls is not None:
            creds = grpc.ssl_channel_credentials(
                Path(tls.ca).read_bytes(), Path(tls.key).read_bytes() if tls.key else None,
                Path(tls.cert).read_bytes() if tls.cert else None)
            self._channel = grpc.aio.secure_channel(self.address, creds, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.EngineStub(self._channel)

    @property
    def healthy(self) -> bool:
        return self._health.healthy

    async def check(self) -> bool:
        """One health check: refreshes arms and load (rotation rules: health.py)."""
        await self.open()
        try:
            # wait_for_ready: a channel in reconnect backoff would otherwise fail at once
            self._status = await self._stub.Status(pb.GetStatusRequest(), timeout=self._timeout, wait_for_ready=True,
                                                   metadata=self._metadata)
            menu = menu_from_status(self._status)
            if menu != self._menu:
                self._menu = menu
            self._health.passed()
        except grpc.RpcError as e:
            self._health.failed(f"{e.code().name} {e.details() or ''}".strip())
        return self._health.healthy

    def mark_failed(self) -> None:
        self._health.mark_failed()

    def arms(self) -> ArmMenu:
        return self._menu

    def load(self) -> LoadSnapshot:
        s = self._status
        if s is None:
            return LoadSnapshot()
        return load_from_pb(s.load)

    def max_context(self) -> int:
        return self._status.max_context if self._status else 0

    async def submit(self, request: GenerationRequest) -> WorkerHandle:
        await self.open()
        call = self._stub.Generate(engine_request_pb(request), metadata=self._metadata)
        return WorkerHandle(call, request.request_id, self.id)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
