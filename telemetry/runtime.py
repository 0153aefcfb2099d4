"""Starting a gateway's telemetry from its config: Redis (configured, or a
private supervised one), the outcome sink, the shared rolling acceptance, the
model watcher, the embedded retrainer and OpenTelemetry. Returns what the
gateway uses and the closers that stop it all, in order."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from engines.arms import ArmMenu
from policy.model import PolicyModel
from telemetry.acceptance import RollingAcceptance
from telemetry.config import TelemetryConfig
from telemetry.otel import Instrumentation, build_providers, prometheus_reader
from telemetry.outcomes import MemoryOutcomeSink

log = logging.getLogger(__name__)


@dataclass
class Telemetry:
    sink: object  # RedisOutcomeSink or MemoryOutcomeSink: emit(OutcomeRecord)
    instrumentation: Instrumentation
    acceptance: RollingAcceptance | None = None
    metrics_text: Callable[[], bytes] | None = None  # Prometheus exposition for the HTTP /metrics
    redis_url: str | None = None
    private_redis: object | None = None  # PrivateRedis when this process started one
    closers: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        """Stop everything, last started first (the sink flushes before Redis goes)."""
        while self.closers:
            close = self.closers.pop()
            try:
                close()
            except Exception:  # noqa: BLE001 - shutting down regardless
                log.exception("error while closing telemetry")


def with_password(url: str, password_env: str | None) -> str:
    """The URL with the password from $password_env when the URL carries none."""
    password = os.environ.get(password_env, "") if password_env else ""
    u = urlsplit(url)
    if not password or u.password:
        return url
    host = u.hostname or "127.0.0.1"
    netloc = f":{password}@{host}" + (f":{u.port}" if u.port else "")
    return urlunsplit((u.scheme, netloc, u.path, u.query, u.fragment))


def start_telemetry(config: TelemetryConfig, on_model: Callable[[PolicyModel], None],
                    starting_model: PolicyModel | None, arms: Callable[[], ArmMenu],
                    prometheus: bool = False) -> Telemetry:
    """`on_model` receives every promoted policy model; `arms` says what the
    engines serve (the embedded retrainer scores candidates over it)."""
    extra, render = (), None
    if prometheus:
        reader, render = prometheus_reader()
        extra = (reader,)
    tp, mp = build_providers(config.exporter, config.otlp_endpoint, extra_readers=extra)
    closers: list[Callable[[], None]] = [tp.shutdown, mp.shutdown]
    url, private = config.redis_url, None
    if url is None and shutil.which("redis-server") is None:
        log.warning("no Redis configured and redis-server is not installed: outcomes stay in memory, learning is off")
        sink = MemoryOutcomeSink()
        return Telemetry(sink, Instrumentation(tp, mp, sink), metrics_text=render, closers=closers)
    try:
        if url is None:
            from telemetry.redis_server import PrivateRedis

            private = PrivateRedis(supervise=True)
            closers.append(private.stop)
            url = private.url
            log.info("no Redis configured: started a private, supervised redis-server on 127.0.0.1:%d", private.port)
        else:
            url = with_password(url, config.redis_password_env)
        return _connect(config, url, private, on_model, starting_model, arms, tp, mp, render, closers)
    except BaseException:
        Telemetry(MemoryOutcomeSink(), Instrumentation(), closers=closers).close()  # no orphaned redis-server
        raise


def _connect(config, url, private, on_model, starting_model, arms, tp, mp, render, closers) -> Telemetry:
    import redis

    from telemetry.artifacts import ModelWatcher, seed_registry
    from telemetry.outcomes import RedisOutcomeSink

    client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    closers.append(client.close)
    key = os.environ.get(config.artifact_key_env, "").encode()
    if not key:
        if private is None:
            log.warning("$%s is not set: policy models from Redis cannot be verified and will not be used",
                        config.artifact_key_env)
        else:
            key = secrets.token_bytes(32)  # private Redis, in-process retrainer: a key for this run only
    sink = RedisOutcomeSink(client, max_queue=config.max_queue)
    acceptance = RollingAcceptance(client)
    closers += [acceptance.close, sink.close]
    if key:
        seed_registry(client, key, starting_model)
        closers.append(ModelWatcher(client, key, on_model).close)
    if private is not None and config.embedded_retrainer:
        closers.append(_embedded_retrainer(client, key, config.retrain_every, arms))
    return Telemetry(sink, Instrumentation(tp, mp, sink), acceptance, render, url, private, closers)


def _embedded_retrainer(client, key: bytes, every: int, arms: Callable[[], ArmMenu]) -> Callable[[], None]:
    from telemetry.retrainer import Retrainer

    retrainer = Retrainer(client, key, every=every)
    stop = threading.Event()

    def refresh_arms():
        menu = arms()
        if menu.drafts or menu.only:
            retrainer.arms = menu

    def loop():
        retrainer.before_retrain = refresh_arms
        retrainer.run(stop=stop)

    thread = threading.Thread(target=loop, name="specgate-retrainer", daemon=True)
    thread.start()
    return lambda: (stop.set(), thread.join(5))
