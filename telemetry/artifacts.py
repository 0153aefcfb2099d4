"""Policy model versions in Redis: signed, announced, verified before use.

A model is JSON (coefficients only: nothing executable) signed with HMAC-SHA256
under a key shared by the retrainer and the gateways. A gateway refuses an
unsigned or tampered artifact, logs why, and keeps serving its current model.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
import time
from collections.abc import Callable

from policy.model import PolicyModel

log = logging.getLogger(__name__)

MODEL_KEY = "specgate:model:"  # + version -> hash {json, sig, meta}
CURRENT = "specgate:model:current"
HISTORY = "specgate:model:history"  # list of promoted versions, newest first
CHANNEL = "specgate:model:announce"
# per live version: judgements against it that could have promoted (hash). In Redis, not in one
# retrainer's memory: a restarted retrainer, or a second one, goes on spending the same α
ATTEMPTS = "specgate:retrainer:attempts"
KEEP = 100  # promoted versions kept for rollback; an older one is deleted with its judgement count


class ArtifactError(ValueError):
    """An artifact is missing, unsigned, tampered with or unreadable."""


def sign(payload: bytes, key: bytes) -> str:
    return hmac.new(key, payload, hashlib.sha256).hexdigest()


def publish(client, model: PolicyModel, key: bytes, meta: dict | None = None, promote: bool = True) -> str:
    payload = model.to_json().encode()
    meta = {"version": model.version, "published_at": time.time(), **(meta or {})}
    client.hset(MODEL_KEY + model.version, mapping={"json": payload, "sig": sign(payload, key),
                                                   "meta": json.dumps(meta)})
    if promote:
        promote_version(client, model.version)
    return model.version


def promote_version(client, version: str) -> None:
    if not client.exists(MODEL_KEY + version):
        raise ArtifactError(f"no stored model version {version!r}")
    # what falls off the history with this push, unless it stays in it (a rollback pushes a version again)
    staying = {v.decode() for v in client.lrange(HISTORY, 0, KEEP - 2)} | {version}
    dropped = sorted({v.decode() for v in client.lrange(HISTORY, KEEP - 1, -1)} - staying)
    pipe = client.pipeline()
    pipe.set(CURRENT, version)
    pipe.lpush(HISTORY, version)
    pipe.ltrim(HISTORY, 0, KEEP - 1)
    if dropped:  # a registry that promotes for months stays at KEEP models
        pipe.delete(*(MODEL_KEY + v for v in dropped))
        pipe.hdel(ATTEMPTS, *dropped)
    pipe.publish(CHANNEL, version)
    pipe.execute()


def load_verified(client, version: str, key: bytes) -> PolicyModel:
    h = client.hgetall(MODEL_KEY + version)
    if not h:
        raise ArtifactError(f"model {version!r} is not stored")
    payload, sig = h.get(b"json"), h.get(b"sig", b"").decode()
    if payload is None or not sig:
        raise ArtifactError(f"model {version!r} is unsigned")
    if not hmac.compare_digest(sign(payload, key), sig):
        raise ArtifactError(f"model {version!r} fails its signature check (tampered, or signed with another key)")
    try:
        model = PolicyModel.from_json(payload)
    except (ValueError, KeyError, TypeError) as e:
        raise ArtifactError(f"model {version!r} is unreadable: {e}") from None
    if model.version != version:
        raise ArtifactError(f"model stored as {version!r} says it is {model.version!r}")
    return model


def rollback(client, version: str | None = None) -> str:
    """Make `version` (default: the one before the current) live again."""
    if version is None:
        history = [v.decode() for v in client.lrange(HISTORY, 0, -1)]
        current = (client.get(CURRENT) or b"").decode()
        older = [v for v in history if v != current]
        if not older:
            raise ArtifactError("no earlier version to roll back to")
        version = older[0]
    promote_version(client, version)
    return version


class ModelWatcher:
    """Swaps a gateway's live model when a new version is announced (pub/sub), with
    a poll of the current version as a safety net for missed messages."""

    def __init__(self, client, key: bytes, on_model: Callable[[PolicyModel], None], poll_s: float = 1.0):
        self.client, self.key, self.on_model = client, key, on_model
        self.version: str | None = None
        self.refused: list[str] = []
        self._stop = threading.Event()
        self._poll = poll_s
        self._threads = (threading.Thread(target=self._poll_loop, name="specgate-model-poll", daemon=True),
                         threading.Thread(target=self._sub_loop, name="specgate-model-sub", daemon=True))
        for t in self._threads:
            t.start()

    def check(self) -> None:
        try:
            current = self.client.get(CURRENT)
        except Exception:  # noqa: BLE001 - Redis away: keep what we have
            return
        if current is None:
            return
        self._apply(current.decode())

    def _apply(self, version: str) -> None:
        if version == self.version or version in self.refused:
            return
        try:
            model = load_verified(self.client, version, self.key)
        except ArtifactError as e:
            self.refused.append(version)
            log.error("refusing policy model: %s; keeping %s", e, self.version or "the current model")
            return
        except Exception:  # noqa: BLE001
            return
        self.version = version
        self.on_model(model)

    def _poll_loop(self) -> None:
        while not self._stop.wait(self._poll):
            self.check()

    def _sub_loop(self) -> None:
        while not self._stop.is_set():
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(CHANNEL)
                self.check()
                while not self._stop.is_set():
                    msg = pubsub.get_message(timeout=0.5)
                    if msg and msg.get("type") == "message":
                        self._apply(msg["data"].decode())
            except Exception:  # noqa: BLE001 - reconnect after a pause
                self._stop.wait(1.0)
            finally:  # each reconnect opens a connection of its own: an outage must not pile them up
                pubsub.close()

    def close(self) -> None:
        """Stops both loops and waits for them (at most a poll and a reconnect's pause),
        so nothing applies a model or logs after its owner has shut down."""
        self._stop.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=self._poll + 2.0)


def seed_registry(client, key: bytes, model: PolicyModel | None) -> None:
    """A gateway started from a policy model file, in front of a Redis that holds
    no live model yet, publishes it: the retrainer then measures its candidates
    against that model instead of the prior, and replaces it only with better."""
    if model is None or model.version == "prior":
        return
    try:
        if client.get(CURRENT) is None:
            publish(client, model, key, meta=dict(source="policy_model file"))
            log.info("published the starting policy model %s as the live version", model.version)
    except Exception as e:  # noqa: BLE001 - Redis away: serve with the file's model, learn later
        log.warning("could not publish the starting policy model: %s", e)
