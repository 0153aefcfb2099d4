"""The embedded built-in engine as an endpoint."""

from __future__ import annotations

import asyncio

from engines.api import GenerationRequest, LoadSnapshot
from engines.arms import ArmMenu
from engines.builtin import BuiltinEngine, BuiltinHandle

# Tokenizing a prompt longer than this moves off the event loop, so that one
# huge prompt never delays other calls (or a health check) by milliseconds.
INLINE_PROMPT_CHARS = 8192


class LocalEndpoint:
    address = "in-process"

    def __init__(self, engine: BuiltinEngine, id: str = "local"):
        self.engine, self.id = engine, id

    @property
    def healthy(self) -> bool:
        return not self.engine.closed

    def arms(self) -> ArmMenu:
        return self.engine.arms()

    def load(self) -> LoadSnapshot:
        return self.engine.load()

    def max_context(self) -> int:
        return self.engine.max_context

    async def open(self) -> None:
        pass

    async def check(self) -> bool:
        return self.healthy

    def mark_failed(self) -> None:
        pass  # in process: it is healthy exactly while it is not closed

    async def submit(self, request: GenerationRequest) -> BuiltinHandle:
        size = len(request.prompt or "") + sum(len(m.content) for m in request.messages)
        if size > INLINE_PROMPT_CHARS:
            return await asyncio.to_thread(self.engine.submit, request)
        return self.engine.submit(request)

    async def close(self) -> None:
        pass  # the engine belongs to whoever built it (it runs the main thread's decode loop)
