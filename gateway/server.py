"""Building and running the gRPC servers: the gateway and the engine worker."""

from __future__ import annotations

import ipaddress
import logging
import signal
import threading
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway.config import GatewayConfig, TLSConfig
from gateway.interceptors import GatewayInterceptor, KeyStore
from gateway.pb import specgate_pb2 as pb
from gateway.pb import specgate_pb2_grpc as pb_grpc
from gateway.service import GatewayService
from gateway.servicer import EngineServicer, GatewayServicer

log = logging.getLogger(__name__)

DEFAULT_RULES = Path(__file__).resolve().parent.parent / "policy" / "default_rules.yaml"
GATEWAY_SERVICE = pb.DESCRIPTOR.services_by_name["Gateway"].full_name
ENGINE_SERVICE = pb.DESCRIPTOR.services_by_name["Engine"].full_name


@dataclass
class GatewayDeps:
    service: GatewayService
    keys: KeyStore
    workers: int = 32
    max_prompt_chars: int = 1_000_000
    tls: TLSConfig | None = None
    metrics_text: Callable[[], bytes] | None = None  # Prometheus exposition for HTTP /metrics


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _credentials(tls: TLSConfig) -> grpc.ServerCredentials:
    key, cert = Path(tls.key).read_bytes(), Path(tls.cert).read_bytes()
    ca = Path(tls.client_ca).read_bytes() if tls.client_ca else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def _bind(server: grpc.Server, address: str, tls: TLSConfig | None) -> int:
    port = server.add_secure_port(address, _credentials(tls)) if tls else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    return port


def create_server(address: str, deps: GatewayDeps) -> tuple[grpc.Server, int, health.HealthServicer]:
    """The gateway server, bound but not started: Gateway, health and reflection."""
    if not deps.keys.enabled and not is_loopback(address):
        raise ValueError(f"refusing to listen on {address} without API keys: configure auth.keys or "
                         f"SPECGATE_API_KEYS, or listen on a loopback address")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=deps.workers, thread_name_prefix="rpc"),
                         interceptors=[GatewayInterceptor(deps.keys)],
                         options=[("grpc.max_receive_message_length", 8 * deps.max_prompt_chars + 65536)])
    pb_grpc.add_GatewayServicer_to_server(GatewayServicer(deps.service, deps.max_prompt_chars), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", GATEWAY_SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection((GATEWAY_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return server, _bind(server, address, deps.tls), health_servicer


def create_engine_server(address: str, engine, engine_id: str = "engine",
                         workers: int = 64) -> tuple[grpc.Server, int]:
    """An engine worker: the internal Engine API, health and reflection."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="engine-rpc"))
    pb_grpc.add_EngineServicer_to_server(EngineServicer(engine, engine_id), server)
    h = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(h, server)
    h.set("", health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection((ENGINE_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return server, _bind(server, address, None)


def drain(server: grpc.Server, health_servicer: health.HealthServicer | None, grace_s: float) -> threading.Event:
    """Refuse new calls (health says NOT_SERVING at once), let in-flight calls
    finish within `grace_s`, then stop. Returns an event set when stopped."""
    if health_servicer is not None:
        health_servicer.enter_graceful_shutdown()
    return server.stop(grace_s)


def install_sigterm(on_term) -> None:
    """SIGTERM and SIGINT call `on_term` once (the second one exits at once)."""
    fired = threading.Event()

    def handler(signum, frame):
        if fired.is_set():
            raise SystemExit(1)
        fired.set()
        log.info("received %s: draining", signal.Signals(signum).name)
        threading.Thread(target=on_term, name="specgate-drain", daemon=True).start()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def build_gateway(config: GatewayConfig, engine=None):
    """Everything `specgate serve` runs, from its config. `engine`: an already
    built in-process engine (else none is embedded). Returns (service, deps,
    closers): on shutdown call the closers last to first."""
    from gateway.router import LocalEndpoint, RemoteEndpoint, Router
    from gateway.service import PolicyState
    from policy.model import PolicyModel
    from policy.rules import load_rules

    endpoints = []
    if engine is not None:
        endpoints.append(LocalEndpoint(engine))
    endpoints += [RemoteEndpoint(r.address, r.id) for r in config.remote_engines]
    if config.openai_engines:
        from engines.openai_server import OpenAIServerEndpoint

        endpoints += [OpenAIServerEndpoint(c) for c in config.openai_engines]
    if not endpoints:
        raise ValueError("no engines: enable embedded_engine or list remote_engines or openai_engines")
    router = Router(endpoints, config.health_check_s)
    rules_path = config.rules or str(DEFAULT_RULES)
    model = PolicyModel.from_json(Path(config.policy_model).read_text()) if config.policy_model else None
    policy = PolicyState(load_rules(rules_path), model, rules_path=rules_path)
    policy.watch_rules(config.rules_poll_s)
    closers = [router.close, policy.close]
    outcomes, acceptance, instr, metrics_text = _telemetry(config, router, policy, closers)
    service = GatewayService(router, policy, outcomes, instrumentation=instr, acceptance=acceptance)
    deps = GatewayDeps(service, KeyStore(config.auth), config.workers, config.max_prompt_chars, config.tls,
                       metrics_text)
    return service, deps, closers


def _telemetry(config: GatewayConfig, router, policy, closers: list):
    """Redis (configured, or a private one), the outcome sink, the shared rolling
    acceptance, the model watcher, the embedded retrainer, and OpenTelemetry."""
    import os
    import secrets
    import shutil

    from gateway.service import OutcomeLog
    from telemetry.otel import Instrumentation, build_providers

    t = config.telemetry
    extra, render = (), None
    if config.http_listen:
        from gateway.http_api import prometheus_metrics

        reader, render = prometheus_metrics()
        extra = (reader,)
    tp, mp = build_providers(t.exporter, t.otlp_endpoint, extra_readers=extra)
    closers += [tp.shutdown, mp.shutdown]
    url, private = t.redis_url, None
    if url is None:
        if shutil.which("redis-server") is None:
            log.warning("no Redis configured and redis-server is not installed: outcomes stay in memory, "
                        "learning is off")
            return OutcomeLog(), None, Instrumentation(tp, mp), render
        from telemetry.redis_server import PrivateRedis

        private = PrivateRedis()
        url = private.url
        closers.append(private.stop)
        log.info("no Redis configured: started a private redis-server at %s", url)
    import redis

    from engines.api import ArmInfo
    from telemetry.artifacts import ModelWatcher
    from telemetry.outcomes import RedisOutcomeSink, RollingAcceptance

    client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    key = os.environ.get(t.artifact_key_env, "").encode()
    if not key:
        if private is None:
            log.warning("$%s is not set: policy models from %s cannot be verified and will not be used",
                        t.artifact_key_env, url)
        key = secrets.token_bytes(32) if private is not None else b""
    sink = RedisOutcomeSink(client, max_queue=t.max_queue, include_prompt=t.include_prompt)
    acceptance = RollingAcceptance(client)
    closers += [sink.close, acceptance.close]
    if key:
        _seed_registry(client, key, policy.model)
        watcher = ModelWatcher(client, key, policy.set_model)
        closers.append(watcher.close)
    if private is not None and t.embedded_retrainer:
        from telemetry.retrainer import Retrainer

        arms = router.arms()
        retrainer = Retrainer(client, key, every=t.retrain_every, arms=arms if arms.drafts else ArmInfo((), 1, 1))
        stop = threading.Event()

        def loop():
            while not stop.is_set():
                try:
                    retrainer.consume(block_ms=500)
                    retrainer.maybe_retrain()
                except Exception:  # noqa: BLE001 - keep learning through hiccups
                    log.exception("embedded retrainer step failed")
                    stop.wait(1.0)

        threading.Thread(target=loop, name="specgate-retrainer", daemon=True).start()
        closers.append(stop.set)
    instr = Instrumentation(tp, mp, queue_depth=lambda: sink.depth, dropped=lambda: sink.dropped)
    return sink, acceptance, instr, render


def _seed_registry(client, key: bytes, model) -> None:
    """A gateway started from a policy model file, in front of a Redis that holds
    no live model yet, publishes it: the retrainer then measures its candidates
    against that model instead of the prior, and replaces it only with better."""
    from telemetry.artifacts import CURRENT, publish

    if model is None or model.version == "prior":
        return
    try:
        if client.get(CURRENT) is None:
            publish(client, model, key, meta=dict(source="policy_model file"))
            log.info("published the starting policy model %s as the live version", model.version)
    except Exception as e:  # noqa: BLE001 - Redis away: serve with the file's model, learn later
        log.warning("could not publish the starting policy model: %s", e)
