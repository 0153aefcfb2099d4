"""A real gateway on a loopback port in front of a tiny in-process engine."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import grpc
import pytest

from engines.builtin import BuiltinEngine
from engines.config import EngineConfig, NgramDraftConfig, TargetConfig
from engines.proposers import NgramProposer
from gateway.config import AuthConfig, TenantKey
from gateway.interceptors import KeyStore
from gateway.pb import specgate_pb2 as pb
from gateway.pb import specgate_pb2_grpc as pb_grpc
from gateway.router import LocalEndpoint, Router
from gateway.server import GatewayDeps, create_server
from gateway.service import GatewayService, PolicyState
from policy.rules import parse_rules
from tests.engines.tiny import tiny_loaded

ENGINE_CONFIG = EngineConfig(target=TargetConfig(max_context=96), drafts=[NgramDraftConfig()], gamma_max=6,
                             max_queue=8)
RULES = parse_rules("default: {explore: 0.0}")


def tiny_engine(config: EngineConfig = ENGINE_CONFIG, **drafts) -> BuiltinEngine:
    target = tiny_loaded(scale=4.0)
    drafts = drafts or {"ngram": lambda cap: NgramProposer(1, 3)}
    return BuiltinEngine(target, drafts, config)


@dataclass
class Gateway:
    server: grpc.Server
    port: int
    health: object
    service: GatewayService
    engine: BuiltinEngine
    channel: grpc.Channel

    @property
    def stub(self) -> pb_grpc.GatewayStub:
        return pb_grpc.GatewayStub(self.channel)

    def close(self):
        self.channel.close()
        self.server.stop(0).wait()
        self.engine.close()


def start_gateway(engine=None, keys: AuthConfig | None = None, rules=RULES, workers=16) -> Gateway:
    engine = engine or tiny_engine()
    router = Router([LocalEndpoint(engine)])
    service = GatewayService(router, PolicyState(rules))
    deps = GatewayDeps(service, KeyStore(keys or AuthConfig(), env=""), workers=workers)
    server, port, health = create_server("127.0.0.1:0", deps)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return Gateway(server, port, health, service, engine, channel)


@pytest.fixture(scope="module")
def gw():
    g = start_gateway()
    yield g
    g.close()


def key(tenant: str, secret: str, methods=None) -> TenantKey:
    return TenantKey(tenant=tenant, key_sha256=hashlib.sha256(secret.encode()).hexdigest(), methods=methods)


def request(prompt="hello world the cat", **kw) -> pb.GenerateRequest:
    kw.setdefault("max_tokens", 8)
    return pb.GenerateRequest(prompt=prompt, **kw)
