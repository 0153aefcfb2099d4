"""Gateway configuration: one pydantic model per concern, unknown keys refused.
Loaded once at the edge (`specgate serve --config FILE`) and logged."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from engines.arms import LONE_KINDS, parse_arm_specs
from engines.config import EngineConfig
from telemetry.config import TelemetryConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def is_loopback(address: str) -> bool:
    """Whether HOST:PORT names a loopback host (what may listen without credentials)."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class TLSConfig(_Strict):
    """Server TLS; with client_ca set, clients must present a certificate (mTLS)."""

    cert: str
    """PEM certificate chain file."""
    key: str
    """PEM private key file."""
    client_ca: str | None = None
    """PEM CA bundle; when set, client certificates are required and verified."""


class ClientTLSConfig(_Strict):
    """TLS from the gateway to an engine worker."""

    ca: str
    """PEM CA bundle the worker's certificate must chain to."""
    cert: str | None = None
    """PEM client certificate (mTLS), with `key`."""
    key: str | None = None


class TenantKey(_Strict):
    """An API key of a tenant. Keys are stored as SHA-256 digests, never in clear."""

    tenant: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.@-]+$")
    key_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    """hex SHA-256 of the key: `printf %s KEY | sha256sum`."""
    methods: list[str] | None = None
    """Methods this tenant may call (e.g. [Generate, GenerateStream, Decide]); None: all."""


class AuthConfig(_Strict):
    keys: list[TenantKey] = Field(default_factory=list)
    """API keys. Also read from $SPECGATE_API_KEYS as 'tenant:key,tenant:key'."""
    protect_metrics: bool = True
    """With keys configured, /metrics needs a key too (any tenant's); false serves it openly."""


class RemoteEngineConfig(_Strict):
    """An engine worker started with `specgate engine --listen HOST:PORT`."""

    address: str
    """host:port of the worker."""
    id: str | None = None
    """Name in logs and GetStatus (default: the address)."""
    token_env: str | None = "SPECGATE_WORKER_TOKEN"
    """Environment variable holding the worker token sent to it (when set)."""
    tls: ClientTLSConfig | None = None
    """Connect with TLS (and a client certificate for mTLS)."""


class OpenAIServerConfig(_Strict):
    """An OpenAI-compatible server (vLLM, SGLang, llama.cpp, TGI, ...) behind the
    gateway. These servers configure speculation per server, so each entry
    declares the arm(s) it serves: e.g. one vLLM without speculation
    (`arms: [plain]`), one with an n-gram speculator at K=4 (`[ngram:4]`), one
    with a draft model at K=5 (`[draft:5]`)."""

    url: str = Field(pattern=r"^https?://[^/\s]+/?$")
    """Base URL, e.g. http://10.0.0.5:8000 (the /v1 paths are added)."""
    id: str | None = None
    """Name in logs, outcomes and GetStatus (default: the URL)."""
    kind: Literal["vllm", "sglang", "llamacpp", "generic"] = "generic"
    """Which server it is: decides the Prometheus metric names read for load and
    acceptance counters, and the response fields read for per-request acceptance."""
    model: str | None = None
    """Model name sent with each request (default: the first one /v1/models lists)."""
    arms: list[str] = Field(default_factory=lambda: ["plain"], min_length=1)
    """Arms served: 'plain', 'DRAFT:GAMMA', or 'DRAFT:LO-HI' with gamma_field set."""
    draft_kinds: dict[str, Literal[LONE_KINDS]] = Field(default_factory=dict)
    """What each draft in `arms` is (e.g. {spec: eagle} for a vLLM serving an EAGLE head as 'spec'):
    the policy's starting point for a draft it has no outcomes for yet. A draft not listed is
    judged by its name (ngram*, eagle*; anything else a separate draft model)."""
    gamma_field: str | None = None
    """Request field that sets γ per request (llama.cpp server: 'speculative.n_max'),
    so that one endpoint serves a range of γ (the engine's γ_max under adaptive drafting)."""
    max_context: int = Field(4096, ge=16)
    """Context length the server was started with (prompt + output)."""
    connect_timeout_s: float = Field(2.0, gt=0)
    read_timeout_s: float = Field(300.0, gt=0)
    """Longest silence between two streamed chunks before the request fails."""
    health_path: str | None = None
    """GET this for health (default: /health for vllm, sglang and llamacpp; /v1/models for generic).
    llama-cpp-python's server has no /health and takes its model lock on /v1/models, which
    interrupts a running stream: point it at /openapi.json."""
    metrics_path: str | None = "/metrics"
    """Prometheus page for live load and speculation counters; None: use the
    gateway's own in-flight counts."""
    api_key_env: str | None = None
    """Environment variable holding the server's API key (sent as a Bearer token)."""
    max_inflight: int = Field(256, ge=1)
    """Requests this gateway keeps in flight on the server; beyond, RESOURCE_EXHAUSTED."""

    @model_validator(mode="after")
    def _arms_parse(self):
        served = {a.draft for a in parse_arm_specs(self.arms, ranges=self.gamma_field is not None)}
        unknown = sorted(set(self.draft_kinds) - served)  # parse_arm_specs' ValueError names a bad entry
        if unknown:
            raise ValueError(f"draft_kinds names drafts no arm serves: {unknown}")
        return self


class GatewayConfig(_Strict):
    listen: str = "127.0.0.1:50051"
    """Address to serve on. Without API keys only loopback addresses are allowed."""
    http_listen: str | None = None
    """Also serve the OpenAI-compatible HTTP API and /metrics here (e.g. 127.0.0.1:8000); None: off."""
    max_concurrent_streams: int = Field(256, ge=1, le=100_000)
    """Generation calls (gRPC and HTTP together) served at once; beyond, new ones are refused at once
    with RESOURCE_EXHAUSTED / HTTP 429. Health and status are never counted."""
    drain_grace_s: float = Field(30.0, ge=0)
    """On SIGTERM: refuse new calls, give in-flight ones (gRPC and HTTP) this long, then exit."""
    rules: str | None = None
    """Operator rules YAML (default: the shipped policy/default_rules.yaml). Reloaded on change."""
    rules_poll_s: float = Field(1.0, gt=0)
    """How often the rules file is checked for changes."""
    policy_model: str | None = None
    """A policy model JSON to start from (default: the cold-start prior)."""
    embedded_engine: bool = True
    """Serve with an in-process built-in engine."""
    engine: EngineConfig = EngineConfig()
    """The embedded engine."""
    remote_engines: list[RemoteEngineConfig] = Field(default_factory=list)
    openai_engines: list[OpenAIServerConfig] = Field(default_factory=list)
    """OpenAI-compatible servers (vLLM, SGLang, llama.cpp) and the arms each serves."""
    health_check_s: float = Field(2.0, gt=0)
    """Interval of remote engine health checks."""
    auth: AuthConfig = AuthConfig()
    tls: TLSConfig | None = None
    max_prompt_chars: int = Field(1_000_000, ge=1)
    telemetry: TelemetryConfig = TelemetryConfig()


def load_gateway_config(path: str | None) -> GatewayConfig:
    if not path:
        return GatewayConfig()
    data = yaml.safe_load(Path(path).read_text()) or {}
    return GatewayConfig.model_validate(data)
