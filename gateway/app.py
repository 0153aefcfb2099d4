"""The composition root: everything a gateway runs, built from its config, and
the loop that serves it.

    build_app(config, engine)  router, policy, telemetry, service (nothing listens yet)
    App.start()                on the event loop: endpoints connected, gRPC (and HTTP) listening
    App.drain(grace)           refuse new calls, let in-flight ones finish, stop
    App.close()                telemetry and the rest, last built first
    EventLoopThread            the servers' event loop on a thread of its own, so that the
                               built-in engine's decode loop keeps the main thread (engines/builtin.py)
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gateway.auth import KeyStore
from gateway.config import GatewayConfig, is_loopback
from gateway.endpoints.local import LocalEndpoint
from gateway.endpoints.openai import OpenAIServerEndpoint
from gateway.endpoints.worker import WorkerEndpoint
from gateway.policy_state import PolicyState
from gateway.router import Router
from gateway.service import GatewayService
from policy.model import PolicyModel
from policy.rules import SHIPPED_RULES, load_rules
from telemetry.runtime import Telemetry, start_telemetry

log = logging.getLogger(__name__)


@dataclass
class App:
    config: GatewayConfig
    service: GatewayService
    keys: KeyStore
    telemetry: Telemetry
    closers: list[Callable[[], None]] = field(default_factory=list)
    grpc_server: object = None
    grpc_health: object = None
    grpc_port: int = 0
    http_server: object = None
    http_port: int = 0
    _http_task: asyncio.Task | None = None

    @property
    def router(self) -> Router:
        return self.service.router

    async def start(self) -> None:
        """Connect the endpoints and listen; raises OSError/ValueError for an address
        that cannot be served (after stopping whatever had started)."""
        from gateway.grpc_server import create_gateway_server

        cfg = self.config
        await self.router.start()
        try:
            self.grpc_server, self.grpc_port, self.grpc_health = await create_gateway_server(
                cfg.listen, self.service, self.keys, cfg.max_prompt_chars, cfg.max_concurrent_streams, cfg.tls)
            if cfg.http_listen:
                await self._start_http(cfg.http_listen)
        except BaseException:
            await self.stop_servers(0)
            raise

    async def _start_http(self, address: str) -> None:
        import uvicorn

        from gateway.http_api import create_app

        if not self.keys.enabled and not is_loopback(address):
            raise ValueError(f"refusing to serve HTTP on {address} without API keys")
        sock = bind_tcp(address)  # bound here, so that a bad address is an OSError now, not an exit later
        app = create_app(self.service, self.keys, self.telemetry.metrics_text, self.config.max_prompt_chars)
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", server_header=False,
                                limit_concurrency=self.config.max_concurrent_streams + 64,
                                timeout_graceful_shutdown=max(self.config.drain_grace_s, 0.1))
        server = uvicorn.Server(config)
        server.install_signal_handlers = lambda: None  # the process's SIGTERM handler drains everything together
        self._http_task = asyncio.create_task(server.serve(sockets=[sock]), name="specgate-http")
        while not server.started:
            if self._http_task.done():
                raise OSError(f"cannot serve HTTP on {address}")
            await asyncio.sleep(0.01)
        self.http_server = server
        self.http_port = sock.getsockname()[1]

    async def drain(self, grace_s: float) -> None:
        """Health says NOT_SERVING at once; new calls are refused; calls in flight
        (gRPC and HTTP alike) get `grace_s` to finish; then the servers stop."""
        from gateway.grpc_server import drain

        jobs = []
        if self.grpc_server is not None:
            jobs.append(drain(self.grpc_server, self.grpc_health, grace_s))
        if self.http_server is not None:
            self.http_server.should_exit = True  # stops accepting; waits for in-flight up to the grace
            jobs.append(self._http_task)
        await asyncio.gather(*jobs, return_exceptions=True)
        await self.service.wait_idle(0.5)
        await self.router.close()

    async def stop_servers(self, grace_s: float = 0) -> None:
        await self.drain(grace_s)

    def close(self) -> None:
        """Telemetry and the rest, last built first (the sink flushes before Redis goes)."""
        while self.closers:
            close = self.closers.pop()
            try:
                close()
            except Exception:  # noqa: BLE001 - shutting down regardless
                log.exception("error while closing")


def build_endpoints(config: GatewayConfig, engine=None) -> list:
    endpoints = [LocalEndpoint(engine)] if engine is not None else []
    endpoints += [WorkerEndpoint(r) for r in config.remote_engines]
    endpoints += [OpenAIServerEndpoint(c) for c in config.openai_engines]
    if not endpoints:
        raise ValueError("no engines: enable embedded_engine or list remote_engines or openai_engines")
    return endpoints


def build_app(config: GatewayConfig, engine=None, endpoints: list | None = None,
              policy: PolicyState | None = None, keys: KeyStore | None = None,
              telemetry: Telemetry | None = None) -> App:
    """Everything `specgate serve` runs, from its config. `engine`: an already
    built in-process engine (else none is embedded); `endpoints`, `policy`,
    `keys` and `telemetry` replace what the config would build (tests)."""
    closers: list[Callable[[], None]] = []
    try:
        endpoints = endpoints if endpoints is not None else build_endpoints(config, engine)
        router = Router(endpoints, config.health_check_s)
        if policy is None:
            rules_path = config.rules or str(SHIPPED_RULES)
            model = PolicyModel.from_json(Path(config.policy_model).read_text()) if config.policy_model else None
            policy = PolicyState(load_rules(rules_path), model, rules_path=rules_path)
            policy.watch_rules(config.rules_poll_s)
        closers.append(policy.close)
        keys = keys or KeyStore(config.auth)
        if telemetry is None:
            telemetry = start_telemetry(config.telemetry, policy.set_model, policy.model, router.arms,
                                        prometheus=bool(config.http_listen))
        closers.append(telemetry.close)
        service = GatewayService(router, policy, telemetry.sink, telemetry.instrumentation, telemetry.acceptance,
                                 max_concurrent=config.max_concurrent_streams,
                                 include_prompt=config.telemetry.include_prompt)
        telemetry.instrumentation.watch(lambda: {e.id: e.load() for e in router.endpoints}, lambda: service.active)
        return App(config, service, keys, telemetry, closers)
    except BaseException:
        for close in reversed(closers):  # a refused start leaves nothing behind (no orphaned redis-server)
            close()
        raise


def bind_tcp(address: str) -> socket.socket:
    """A TCP socket bound to HOST:PORT (IPv4 or IPv6), not yet listening."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        port_n = int(port)
        infos = socket.getaddrinfo(host, port_n, type=socket.SOCK_STREAM)
    except (ValueError, OSError) as e:
        raise OSError(f"cannot listen on {address}: {e}") from None
    family, _, _, _, sockaddr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(sockaddr)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {address}: {e.strerror}") from None
    return sock


class EventLoopThread:
    """An asyncio event loop running on a thread of its own."""

    def __init__(self, name: str = "specgate-io"):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro, timeout: float | None = None):
        """Run `coro` on the loop and wait for its result here."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def install_sigterm(on_term: Callable[[], None]) -> None:
    """SIGTERM and SIGINT call `on_term` once, on a thread of its own (the second
    signal exits at once)."""
    import signal

    fired = threading.Event()

    def handler(signum, frame):
        if fired.is_set():
            raise SystemExit(1)
        fired.set()
        log.info("received %s: draining", signal.Signals(signum).name)
        threading.Thread(target=on_term, name="specgate-drain", daemon=True).start()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


class ServingApp:
    """An App serving from an event loop on a background thread (scripts,
    benchmarks, tests): the calling thread stays free."""

    def __init__(self, app: App, io: EventLoopThread):
        self.app, self.io = app, io

    @property
    def service(self) -> GatewayService:
        return self.app.service

    @property
    def grpc_port(self) -> int:
        return self.app.grpc_port

    @property
    def http_port(self) -> int:
        return self.app.http_port

    def stop(self, grace_s: float = 0.0) -> None:
        try:
            self.io.run(self.app.drain(grace_s), timeout=grace_s + 30)
        finally:
            self.app.close()
            self.io.stop()


def serve_in_background(app: App) -> ServingApp:
    io = EventLoopThread()
    try:
        io.run(app.start(), timeout=120)
    except BaseException:
        app.close()
        io.stop()
        raise
    return ServingApp(app, io)
