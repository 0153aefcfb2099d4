"""Redis as a tester breaks it: a private server SIGKILLed comes back on its own
with its data; while it is away the retrainer logs the outage once and its end
once; a private Redis needs its password; one tenant's traffic cannot switch a
draft off for another."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import redis

from engines.arms import ArmMenu
from telemetry.acceptance import read_table
from telemetry.outcomes import STREAM, RedisOutcomeSink
from telemetry.redis_server import PrivateRedis
from telemetry.retrainer import Retrainer


def test_a_killed_private_redis_is_restarted_with_its_data():
    server = PrivateRedis(supervise=True)
    try:
        client = redis.Redis.from_url(server.url, socket_timeout=1)
        client.set("kept", "yes")
        server.kill()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                if client.get("kept") == b"yes":
                    break
            except redis.RedisError:  # refused, timed out on a loaded machine, or still loading its file
                time.sleep(0.2)
        assert client.get("kept") == b"yes" and server.restarts == 1, server._log_tail(20)
    finally:
        server.stop()


def test_the_private_redis_wants_its_password():
    server = PrivateRedis()
    try:
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=server.port).ping()
        assert redis.Redis.from_url(server.url).ping()
        assert server.password not in " ".join(server.proc.args)  # not on the command line either
    finally:
        server.stop()


def test_an_outage_is_logged_once_and_its_end_once(caplog):
    server = PrivateRedis()
    client = redis.Redis.from_url(server.url, socket_timeout=2, socket_connect_timeout=0.5)  # reads block 0.5 s
    retrainer = Retrainer(client, b"k" * 32, arms=ArmMenu(("ngram",), 1, 4))
    stop = threading.Event()
    thread = threading.Thread(target=retrainer.run, kwargs={"stop": stop}, daemon=True)
    caplog.set_level(logging.INFO, logger="telemetry.retrainer")
    try:
        thread.start()
        time.sleep(0.5)
        server.kill()
        time.sleep(4)  # many retries while it is away
        server.start()
        time.sleep(3)  # the next retry (backoff at most 2 s) finds it
        stop.set()
        thread.join(5)
        lines = [r.getMessage() for r in caplog.records if r.name == "telemetry.retrainer"]
        assert sum("Redis unavailable" in m for m in lines) == 1, lines
        assert sum("Redis is back" in m for m in lines) == 1, lines
        assert not any(r.exc_info for r in caplog.records)  # no tracebacks
    finally:
        stop.set()
        server.stop()


def test_forced_arms_and_other_tenants_do_not_move_the_guard(rclient, redis_server):
    """The attack from the hardening report: a tenant forces ngram:8 at T=1 on
    random words under a summarization hint. Nothing it sends may reach the
    statistics another tenant's requests are guarded by."""
    from gateway.config import AuthConfig
    from gateway.pb import specgate_pb2 as pb
    from telemetry.acceptance import RollingAcceptance
    from tests.helpers import key, start_gateway

    sink = RedisOutcomeSink(redis.Redis.from_url(redis_server.url), decay=1.0)
    acceptance = RollingAcceptance(redis.Redis.from_url(redis_server.url), interval_s=0.1)
    keys = AuthConfig(keys=[key("mallory", "m"), key("alice", "a")])
    g = start_gateway(keys=keys, sink=sink, acceptance=acceptance)
    try:
        for i in range(6):
            g.stub.Generate(pb.GenerateRequest(prompt=f"w{i} w3 cat sat w9", max_tokens=16, temperature=1.0,
                                               category="summarization", arm="ngram:6"),
                            metadata=(("authorization", "Bearer m"),))
        assert sink.flush(10) and rclient.xlen(STREAM) == 6
        assert read_table(rclient) == {}  # forced: learning keeps the outcomes, the guard counts none
        time.sleep(0.3)
        assert g.service.acceptance.lookup("alice", "summarization") == {}  # alice's view of the guard
    finally:
        g.close()
        acceptance.close()
        sink.close()
