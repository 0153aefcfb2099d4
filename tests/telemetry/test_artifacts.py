import time

import pytest

from policy.model import PolicyModel, prior_draft
from telemetry.artifacts import (
    ATTEMPTS,
    CURRENT,
    HISTORY,
    MODEL_KEY,
    ArtifactError,
    ModelWatcher,
    load_verified,
    publish,
    rollback,
)

KEY = b"k" * 32


def model(version):
    return PolicyModel(version, {"ngram": prior_draft("ngram")}, explore=0.1)


def test_signed_model_roundtrips_and_tampering_is_refused(rclient):
    publish(rclient, model("v1"), KEY)
    assert load_verified(rclient, "v1", KEY).version == "v1"
    with pytest.raises(ArtifactError, match="signature"):
        load_verified(rclient, "v1", b"another-key")
    raw = rclient.hget(MODEL_KEY + "v1", "json").replace(b'"explore": 0.1', b'"explore": 0.9')
    rclient.hset(MODEL_KEY + "v1", "json", raw)
    with pytest.raises(ArtifactError, match="tampered"):
        load_verified(rclient, "v1", KEY)
    rclient.hdel(MODEL_KEY + "v1", "sig")
    with pytest.raises(ArtifactError, match="unsigned"):
        load_verified(rclient, "v1", KEY)


def test_watcher_swaps_within_a_second_and_keeps_its_model_on_a_tampered_one(rclient):
    live = []
    watcher = ModelWatcher(rclient, KEY, live.append, poll_s=0.2)
    try:
        t0 = time.perf_counter()
        publish(rclient, model("v1"), KEY)
        while not live and time.perf_counter() - t0 < 3:
            time.sleep(0.01)
        assert live and live[-1].version == "v1" and time.perf_counter() - t0 < 1.0
        # an attacker writes a model with a forged signature and promotes it
        rclient.hset(MODEL_KEY + "evil", mapping={"json": model("evil").to_json(), "sig": "0" * 64})
        rclient.set(CURRENT, "evil")
        rclient.publish("specgate:model:announce", "evil")
        time.sleep(0.6)
        assert watcher.version == "v1" and "evil" in watcher.refused and live[-1].version == "v1"
    finally:
        watcher.close()
    # closed means stopped: nothing announced afterwards reaches the owner
    publish(rclient, model("v2"), KEY)
    time.sleep(0.6)
    assert live[-1].version == "v1" and watcher.version == "v1"


def test_rollback_returns_to_the_previous_version(rclient):
    publish(rclient, model("v1"), KEY)
    publish(rclient, model("v2"), KEY)
    assert rollback(rclient) == "v1" and rclient.get(CURRENT) == b"v1"
    assert rollback(rclient, "v2") == "v2"
    with pytest.raises(ArtifactError):
        rollback(rclient, "v9")


def test_the_registry_keeps_the_last_promoted_versions_and_forgets_older_ones(rclient, monkeypatch):
    """Past KEEP promotions, a version that falls off the history is deleted with its
    judgement count; one pushed again by a rollback stays while it is in the history."""
    monkeypatch.setattr("telemetry.artifacts.KEEP", 3)
    for v in ("v1", "v2", "v3"):
        publish(rclient, model(v), KEY)
        rclient.hincrby(ATTEMPTS, v, 2)
    assert rollback(rclient, "v1") == "v1"  # history v1 v3 v2 v1: the old v1 entry falls off, v1 stays
    assert [v.decode() for v in rclient.lrange(HISTORY, 0, -1)] == ["v1", "v3", "v2"]
    assert all(rclient.exists(MODEL_KEY + v) for v in ("v1", "v2", "v3"))
    publish(rclient, model("v4"), KEY)  # v2 falls off
    publish(rclient, model("v5"), KEY)  # v3 falls off
    assert [v.decode() for v in rclient.lrange(HISTORY, 0, -1)] == ["v5", "v4", "v1"]
    assert not rclient.exists(MODEL_KEY + "v2") and not rclient.exists(MODEL_KEY + "v3")
    assert rclient.hkeys(ATTEMPTS) == [b"v1"] and load_verified(rclient, "v1", KEY).version == "v1"
    with pytest.raises(ArtifactError):
        rollback(rclient, "v2")


def test_a_gateway_started_from_a_model_file_seeds_an_empty_registry(rclient, redis_server, tmp_path, monkeypatch):
    """The retrainer then judges candidates against that model, not the prior; a
    registry that already has a live model keeps it."""
    from gateway.app import build_app
    from gateway.config import GatewayConfig
    from policy.train import fit
    from telemetry.artifacts import CURRENT
    from tests.helpers import world_outcomes

    monkeypatch.setenv("SPECGATE_ARTIFACT_KEY", "k" * 32)
    model = fit(world_outcomes(400, seed=3), version="from-file")
    path = tmp_path / "policy.json"
    path.write_text(model.to_json())
    config = GatewayConfig.model_validate(dict(
        embedded_engine=False, remote_engines=[{"address": "127.0.0.1:1"}], policy_model=str(path),
        telemetry={"redis_url": redis_server.url}))
    for expected in ("from-file", "from-file"):  # a second start finds it live and leaves it
        app = build_app(config)
        try:
            assert rclient.get(CURRENT).decode() == expected
            assert app.service.policy.model.version == expected
        finally:
            app.close()
    rclient.set(CURRENT, "something-newer")
    build_app(config).close()
    assert rclient.get(CURRENT).decode() == "something-newer"
