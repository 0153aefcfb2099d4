"""Gateway configuration: one pydantic model per concern, unknown keys refused.
Loaded once at the edge (`specgate serve --config FILE`) and logged."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from engines.config import EngineConfig, OpenAIServerConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TLSConfig(_Strict):
    """Server TLS; with client_ca set, clients must present a certificate (mTLS)."""

    cert: str
    """PEM certificate chain file."""
    key: str
    """PEM private key file."""
    client_ca: str | None = None
    """PEM CA bundle; when set, client certificates are required and verified."""


class TenantKey(_Strict):
    """An API key of a tenant. Keys are stored as SHA-256 digests, never in clear."""

    tenant: str = Field(min_length=1, max_length=64)
    key_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    """hex SHA-256 of the key: `printf %s KEY | sha256sum`."""
    methods: list[str] | None = None
    """Methods this tenant may call (e.g. [Generate, GenerateStream, Decide]); None: all."""


class AuthConfig(_Strict):
    keys: list[TenantKey] = Field(default_factory=list)
    """API keys. Also read from $SPECGATE_API_KEYS as 'tenant:key,tenant:key'."""


class RemoteEngineConfig(_Strict):
    """An engine worker started with `specgate engine --listen HOST:PORT`."""

    address: str
    """host:port of the worker."""
    id: str | None = None
    """Name in logs and GetStatus (default: the address)."""


class TelemetryConfig(_Strict):
    """Outcomes, model versions and traces."""

    redis_url: str | None = None
    """e.g. redis://127.0.0.1:6379/0. None: start a private redis-server on loopback when the binary
    is installed (and retrain in-process), else keep outcomes in memory with learning off."""
    embedded_retrainer: bool = True
    """With the private Redis, also run the retrainer in this process."""
    retrain_every: int = Field(500, ge=10)
    """New outcomes between retrainings (embedded retrainer)."""
    artifact_key_env: str = "SPECGATE_ARTIFACT_KEY"
    """Environment variable holding the HMAC key that signs policy models (shared with the retrainer)."""
    include_prompt: bool = False
    """Put prompt text into outcome records."""
    max_queue: int = Field(10_000, ge=1)
    """Outcome records held in memory while Redis is away; beyond, the oldest are dropped and counted."""
    exporter: Literal["none", "console", "otlp-grpc", "otlp-http"] = "none"
    """Where traces and metrics go."""
    otlp_endpoint: str | None = None
    """OTLP collector endpoint (default: the exporter's own default)."""


class GatewayConfig(_Strict):
    listen: str = "127.0.0.1:50051"
    """Address to serve on. Without API keys only loopback addresses are allowed."""
    http_listen: str | None = None
    """Also serve the OpenAI-compatible HTTP API and /metrics here (e.g. 127.0.0.1:8000); None: off."""
    workers: int = Field(32, ge=1, le=1024)
    """Concurrent RPCs served (thread pool size)."""
    max_concurrent_streams: int = Field(256, ge=1)
    drain_grace_s: float = Field(30.0, ge=0)
    """On SIGTERM: refuse new calls, give in-flight ones this long, then exit."""
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
