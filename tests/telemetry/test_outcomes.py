import json
import time

import redis

from gateway.service import Outcome
from telemetry.outcomes import STREAM, RedisOutcomeSink, read_rolling_acceptance


def outcome(i, draft="ngram", cat="summarization", drafted=10, accepted=6):
    return Outcome(request_id=f"r{i}", tenant="t", features={"category": cat, "temperature": 0.0},
                   decision={"arm": f"{draft}:4", "draft": draft, "propensity": 0.9},
                   engine="local", result={"output_tokens": 20, "rounds": 8, "drafted": drafted,
                                           "accepted": accepted, "decode_s": 0.5})


def test_records_land_and_each_is_read_once_per_group(rclient):
    sink = RedisOutcomeSink(rclient)
    for i in range(40):
        sink.emit(outcome(i))
    assert sink.flush(10)
    sink.close()
    assert rclient.xlen(STREAM) == 40
    first = json.loads(rclient.xrange(STREAM, count=1)[0][1][b"record"])
    assert first["schema"] == 1 and first["request_id"] == "r0" and "prompt" not in first
    for group in ("g1", "g2"):
        rclient.xgroup_create(STREAM, group, id="0")
    seen = {"g1": [], "g2": []}
    for group, consumers in (("g1", ["a", "b"]), ("g2", ["c"])):
        for _ in range(10):
            for c in consumers:
                for _, entries in rclient.xreadgroup(group, c, {STREAM: ">"}, count=7) or []:
                    seen[group] += [e[1][b"id"].decode() for e in entries]
    assert sorted(seen["g1"]) == sorted(seen["g2"]) == sorted(f"r{i}" for i in range(40))  # once per group


def test_rolling_acceptance_is_shared_through_redis(rclient):
    sink = RedisOutcomeSink(rclient, decay=1.0)
    for i in range(5):
        sink.emit(outcome(i, drafted=10, accepted=3))
    sink.emit(outcome(9, draft="selfspec", cat="code", drafted=4, accepted=4))
    sink.close()
    table = read_rolling_acceptance(rclient)
    assert table["summarization"]["ngram"] == (0.3, 50)
    assert table["code"]["selfspec"] == (1.0, 4)


def test_redis_killed_mid_load_and_restarted_loses_nothing_within_the_bound(redis_server, rclient):
    sink = RedisOutcomeSink(redis.Redis.from_url(redis_server.url, socket_timeout=0.5,
                                                 socket_connect_timeout=0.5), max_queue=1000)
    t0 = time.perf_counter()
    for i in range(100):
        sink.emit(outcome(i))
    redis_server.kill()
    for i in range(100, 300):
        sink.emit(outcome(i))  # must not block while Redis is down
    assert time.perf_counter() - t0 < 1.0
    time.sleep(0.5)
    assert not sink.redis_up and sink.depth > 0
    redis_server.start()
    assert sink.flush(20)
    sink.close()
    client = redis.Redis.from_url(redis_server.url)
    ids = {e[1][b"id"].decode() for e in client.xrange(STREAM)}
    assert ids == {f"r{i}" for i in range(300)} and sink.dropped == 0


def test_past_the_bound_drops_are_counted(redis_server):
    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)  # nothing listens there
    sink = RedisOutcomeSink(dead, max_queue=10)
    for i in range(50):
        sink.emit(outcome(i))
    assert sink.dropped == 40 and sink.depth == 10
    sink.close(timeout=0.5)
