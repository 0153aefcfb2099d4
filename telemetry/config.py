"""Telemetry configuration (the `telemetry:` section of the gateway config)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class TelemetryConfig(BaseModel):
    """Outcomes, model versions and traces."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    redis_url: str | None = None
    """e.g. redis://:PASSWORD@127.0.0.1:6379/0. None: start a private redis-server on loopback (with a
    random password, supervised) when the binary is installed, and retrain in-process; else keep outcomes
    in memory with learning off."""
    redis_password_env: str | None = "SPECGATE_REDIS_PASSWORD"
    """Environment variable holding the password of the configured Redis (used when the URL has none)."""
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
