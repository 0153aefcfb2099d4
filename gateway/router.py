"""How a request finds an endpoint (gateway/endpoints/): a healthy one that
serves its arm, least loaded first. Every endpoint is health-checked on an
interval; one that fails its checks leaves the rotation until it passes again.
Runs on the gateway's event loop."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from engines.api import LoadSnapshot
from engines.arms import Arm, ArmMenu
from gateway.endpoints import Endpoint

log = logging.getLogger(__name__)


@dataclass
class Route:
    endpoint: Endpoint
    arm: Arm
    fallback: bool  # the chosen arm was not served: another instead


class Router:
    def __init__(self, endpoints: list[Endpoint], health_check_s: float = 2.0):
        self.endpoints = endpoints
        self.health_check_s = health_check_s
        self._inflight: dict[str, int] = {e.id: 0 for e in endpoints}
        self._task: asyncio.Task | None = None
        self._menu_key: tuple = ()
        self._menu = ArmMenu.union([])

    async def start(self) -> None:
        """Connect every endpoint, check each once, then keep checking."""
        for e in self.endpoints:
            await e.open()
        await self.check_all()
        self._task = asyncio.create_task(self._check_loop(), name="specgate-health")

    async def check_all(self) -> None:
        await asyncio.gather(*(e.check() for e in self.endpoints))

    async def _check_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_check_s)
            try:
                await self.check_all()
            except Exception:  # noqa: BLE001 - a broken check must not stop the others' next round
                log.exception("health check round failed")

    def healthy(self) -> list[Endpoint]:
        return [e for e in self.endpoints if e.healthy]

    def arms(self) -> ArmMenu:
        """Everything any healthy endpoint serves (the policy's menu); recomputed
        only when a menu or the set of healthy endpoints changed."""
        menus = [e.arms() for e in self.endpoints if e.healthy]
        key = tuple(map(id, menus))
        if key != self._menu_key:
            self._menu_key, self._menu = key, ArmMenu.union(menus)
        return self._menu

    def _score(self, e: Endpoint) -> int:
        ld = e.load()
        return ld.running + ld.waiting + self._inflight.get(e.id, 0)

    def least_loaded_load(self) -> LoadSnapshot:
        return min((e.load() for e in self.healthy()), key=lambda ld: ld.running + ld.waiting,
                   default=LoadSnapshot())

    def route(self, arm: Arm, exclude: set[str] = frozenset()) -> Route | None:
        live = [e for e in self.healthy() if e.id not in exclude]
        serving = [e for e in live if e.arms().allows(arm)]
        if serving:
            return Route(min(serving, key=self._score), arm, False)
        plain = [e for e in live if e.arms().allows(Arm())]
        if plain:  # nobody serves that arm right now: plain where it is served
            return Route(min(plain, key=self._score), Arm(), True)
        if live:  # only speculative servers left: the least loaded one, with its own arm
            e = min(live, key=self._score)
            return Route(e, e.arms().all_arms()[0], True)
        return None

    def track(self, endpoint_id: str, delta: int) -> None:
        """Requests this gateway has in flight per endpoint: counts between two
        load reports, so a burst does not all land on one endpoint."""
        self._inflight[endpoint_id] = self._inflight.get(endpoint_id, 0) + delta

    def inflight(self, endpoint_id: str) -> int:
        return self._inflight.get(endpoint_id, 0)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)  # let it finish cancelling, not die pending
        for e in self.endpoints:
            await e.close()
