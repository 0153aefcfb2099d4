"""The gRPC servers (asyncio): the gateway's public API and an engine worker's
internal one, each with health and reflection, TLS, and a graceful drain.

Streams cost no thread each, so health checks and GetStatus are answered at
once however many generations are open; generations beyond the configured
limit are refused with RESOURCE_EXHAUSTED by the service (gateway/service.py).
"""

from __future__ import annotations

from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway.config import TLSConfig, is_loopback
from gateway.interceptors import GatewayInterceptor, WorkerInterceptor
from gateway.pb import specgate_pb2 as pb
from gateway.pb import specgate_pb2_grpc as pb_grpc
from gateway.servicer import EngineServicer, GatewayServicer

GATEWAY_SERVICE = pb.DESCRIPTOR.services_by_name["Gateway"].full_name
ENGINE_SERVICE = pb.DESCRIPTOR.services_by_name["Engine"].full_name
# A hard backstop above the generation limit: health, status and reflection keep room.
HEADROOM_RPCS = 256


def credentials(tls: TLSConfig) -> grpc.ServerCredentials:
    key, cert = Path(tls.key).read_bytes(), Path(tls.cert).read_bytes()
    ca = Path(tls.client_ca).read_bytes() if tls.client_ca else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def bind(server: grpc.aio.Server, address: str, tls: TLSConfig | None) -> int:
    try:
        port = server.add_secure_port(address, credentials(tls)) if tls else server.add_insecure_port(address)
    except RuntimeError as e:  # grpc raises this for an address it cannot bind
        raise OSError(f"cannot listen on {address}: {e}") from None
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    return port


def _health(server, service_name: str) -> health.aio.HealthServicer:
    h = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(h, server)
    return h


async def create_gateway_server(address: str, service, keys, max_prompt_chars: int, max_concurrent: int,
                                tls: TLSConfig | None = None) -> tuple[grpc.aio.Server, int, object]:
    """Bound and started: Gateway, health and reflection."""
    if not keys.enabled and not is_loopback(address):
        raise ValueError(f"refusing to listen on {address} without API keys: configure auth.keys or "
                         f"SPECGATE_API_KEYS, or listen on a loopback address")
    server = grpc.aio.server(interceptors=[GatewayInterceptor(keys)],
                             maximum_concurrent_rpcs=max_concurrent + HEADROOM_RPCS,
                             options=[("grpc.max_receive_message_length", 8 * max_prompt_chars + 65536),
                                      ("grpc.so_reuseport", 0)])
    pb_grpc.add_GatewayServicer_to_server(GatewayServicer(service, max_prompt_chars), server)
    h = _health(server, GATEWAY_SERVICE)
    reflection.enable_server_reflection((GATEWAY_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = bind(server, address, tls)
    await server.start()
    for name in ("", GATEWAY_SERVICE):
        await h.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port, h


async def create_engine_server(address: str, engine, engine_id: str, token, tls: TLSConfig | None = None
                               ) -> tuple[grpc.aio.Server, int, object]:
    """An engine worker: the internal Engine API, health and reflection. Beyond
    loopback it needs a worker token or mTLS: it would otherwise let anyone
    bypass the gateway's keys, rules and telemetry."""
    if not is_loopback(address) and not token.enabled and not (tls and tls.client_ca):
        raise ValueError(f"refusing to serve an engine on {address} without credentials: set "
                         f"$SPECGATE_WORKER_TOKEN (and the same on the gateway) or configure mTLS, or listen "
                         f"on a loopback address")
    server = grpc.aio.server(interceptors=[WorkerInterceptor(token)],
                             options=[("grpc.max_receive_message_length", 16 << 20), ("grpc.so_reuseport", 0)])
    pb_grpc.add_EngineServicer_to_server(EngineServicer(engine, engine_id), server)
    h = _health(server, ENGINE_SERVICE)
    reflection.enable_server_reflection((ENGINE_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = bind(server, address, tls)
    await server.start()
    await h.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, port, h


async def drain(server: grpc.aio.Server, health_servicer, grace_s: float) -> None:
    """Health says NOT_SERVING at once, new calls are refused, in-flight calls get
    `grace_s` to finish; then the server stops."""
    if health_servicer is not None:
        await health_servicer.enter_graceful_shutdown()
    await server.stop(grace_s)
