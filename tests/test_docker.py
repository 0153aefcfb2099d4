"""docker/: the Dockerfiles pass hadolint, the compose files validate against
the Compose specification, and every specgate config they mount loads."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gateway.config import GatewayConfig

DOCKER = Path(__file__).resolve().parent.parent / "docker"
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    path = BIN / name if (BIN / name).exists() else shutil.which(name)
    if not path:
        pytest.fail(f"{name} is not installed (it is a dev dependency: pip install -e '.[dev]')")
    return str(path)


@pytest.mark.parametrize("dockerfile", sorted(DOCKER.glob("Dockerfile*")), ids=lambda p: p.name)
def test_dockerfiles_pass_hadolint(dockerfile):
    # DL3008/DL3013: apt and pip versions are pinned where it matters (torch); base images are pinned
    r = subprocess.run([_tool("hadolint"), "--ignore", "DL3008", "--ignore", "DL3013", str(dockerfile)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("compose", sorted(DOCKER.glob("compose*.yaml")), ids=lambda p: p.name)
def test_compose_files_match_the_compose_spec(compose):
    r = subprocess.run([_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(compose)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("compose", sorted(DOCKER.glob("compose*.yaml")), ids=lambda p: p.name)
def test_compose_services_have_health_checks_and_mount_existing_configs(compose):
    doc = yaml.safe_load(compose.read_text())
    for name, cfg in doc.get("configs", {}).items():
        assert (DOCKER / cfg["file"]).exists(), f"config {name}: {cfg['file']} missing"
    services = doc["services"]
    for name, svc in services.items():
        for dep, cond in (svc.get("depends_on") or {}).items() if isinstance(svc.get("depends_on"), dict) else []:
            assert dep in services, f"{name} depends on unknown {dep}"
            if cond.get("condition") == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep}, which has no healthcheck"
    assert "healthcheck" in services["gateway"] and "healthcheck" in services["redis"]


@pytest.mark.parametrize("path", sorted((DOCKER / "config").glob("gateway*.yaml")), ids=lambda p: p.name)
def test_mounted_gateway_configs_load(path):
    config = GatewayConfig.model_validate(yaml.safe_load(path.read_text()))
    assert config.telemetry.redis_url  # every deployment shares outcomes and models through Redis


def test_the_grafana_dashboard_reads_only_metrics_the_gateway_exports():
    """Every series the provisioned dashboard queries is one a running gateway's
    /metrics serves (names checked against a live render, not a list)."""
    import json
    import re

    from opentelemetry.sdk.metrics import MeterProvider

    from engines.config import EngineConfig, NgramDraftConfig, TargetConfig
    from engines.proposers import NgramProposer
    from telemetry.otel import Instrumentation, prometheus_reader
    from telemetry.outcomes import MemoryOutcomeSink
    from tests.helpers import RaisingDraft, request, start_gateway, tiny_engine

    dash = json.loads((DOCKER / "grafana" / "dashboards" / "specgate.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    wanted = {m for e in exprs for m in re.findall(r"\b((?:specgate|gen_ai)_[a-z0-9_]+)", e)}
    reader, render = prometheus_reader()
    sink = MemoryOutcomeSink()
    # a draft that raises: the counter of failed drafting is served only once it counts something
    cfg = EngineConfig(target=TargetConfig(max_context=96),
                       drafts=[NgramDraftConfig(), NgramDraftConfig(name="broken")])
    engine = tiny_engine(cfg, ngram=lambda cap: NgramProposer(1, 3), broken=lambda cap: RaisingDraft())
    g = start_gateway(engine, instrumentation=Instrumentation(meter_provider=MeterProvider(metric_readers=[reader]),
                                                              sink=sink), sink=sink)
    try:
        for arm in ("plain", "ngram:3", "broken:2"):
            g.stub.Generate(request(arm=arm))
        served = {line.split("{")[0].split(" ")[0] for line in render().decode().splitlines()
                  if line and not line.startswith("#")}
    finally:
        g.close()
    assert wanted and wanted <= served, sorted(wanted - served)
    provisioning = DOCKER / "grafana" / "provisioning"
    assert yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"][0]["url"]
    prom = yaml.safe_load((DOCKER / "config" / "prometheus.yml").read_text())
    assert prom["scrape_configs"][0]["static_configs"][0]["targets"] == ["gateway:8000"]
