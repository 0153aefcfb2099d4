"""Endpoints: what a request can be routed to, side by side behind one protocol.

    local.py       the embedded built-in engine, in this process
    worker.py      a `specgate engine` worker over the internal gRPC API
    openai.py      an OpenAI-compatible server (vLLM, SGLang, llama.cpp) declared with its arms
    openai_wire.py their wire format: SSE, error bodies, acceptance fields, metric names
    health.py      rotation bookkeeping shared by the out-of-process ones
    prometheus.py  reading the servers' /metrics
"""

from __future__ import annotations

from typing import Protocol

from engines.api import GenerationHandle, GenerationRequest, LoadSnapshot
from engines.arms import ArmMenu


class Endpoint(Protocol):
    id: str
    address: str

    @property
    def healthy(self) -> bool: ...

    def arms(self) -> ArmMenu: ...

    def load(self) -> LoadSnapshot: ...

    def max_context(self) -> int: ...

    async def open(self) -> None:
        """Connect (on the serving event loop); called once by the router."""

    async def check(self) -> bool:
        """One health check, refreshing arms and load; returns healthy."""

    def mark_failed(self) -> None:
        """A request found it dead: out of rotation until a check passes."""

    async def submit(self, request: GenerationRequest) -> GenerationHandle:
        """Start a generation; raises InvalidRequest / Overloaded / EngineUnavailable at once."""

    async def close(self) -> None: ...
