import json
import time

import pytest
import redis

from engines.api import GenerationStats
from engines.arms import Arm
from policy.decide import Decision
from policy.features import RequestFeatures
from telemetry.acceptance import read_table
from telemetry.outcomes import STREAM, RedisOutcomeSink
from telemetry.record import OutcomeRecord


def outcome(i, draft="ngram", cat="summarization", drafted=10, accepted=6, tenant="t", source="policy",
            classified=None, verified=None):
    f = RequestFeatures(category=cat, temperature=0.0, top_p=1.0, prompt_tokens=30, expected_output_tokens=20,
                        copy_signal=0.5)
    d = Decision(Arm(draft, 4), source, None, "prior", "r", {f"{draft}:4": 1.2}, 0.9)
    st = GenerationStats(arm=f"{draft}:4", output_tokens=20, rounds=8, drafted_per_round=[drafted],
                         verified_per_round=[] if verified is None else [verified],
                         accepted_per_round=[accepted], total_s=0.6, prefill_s=0.1)
    return OutcomeRecord.of(f"r{i}", tenant, "local", f, d, st, 0.1, classified)


def test_records_land_and_each_is_read_once_per_group(rclient):
    sink = RedisOutcomeSink(rclient)
    for i in range(40):
        sink.emit(outcome(i))
    assert sink.flush(10)
    sink.close()
    assert rclient.xlen(STREAM) == 40
    first = json.loads(rclient.xrange(STREAM, count=1)[0][1][b"record"])
    assert first["schema"] == 2 and first["request_id"] == "r0" and "prompt" not in first
    back = OutcomeRecord.from_json(rclient.xrange(STREAM, count=1)[0][1][b"record"])
    assert back.decision.arm == Arm("ngram", 4) and back.result.drafted == 10 and back.features.category == \
        "summarization"
    for group in ("g1", "g2"):
        rclient.xgroup_create(STREAM, group, id="0")
    seen = {"g1": [], "g2": []}
    for group, consumers in (("g1", ["a", "b"]), ("g2", ["c"])):
        for _ in range(10):
            for c in consumers:
                for _, entries in rclient.xreadgroup(group, c, {STREAM: ">"}, count=7) or []:
                    seen[group] += [e[1][b"id"].decode() for e in entries]
    assert sorted(seen["g1"]) == sorted(seen["g2"]) == sorted(f"r{i}" for i in range(40))  # once per group


def test_rolling_acceptance_is_shared_through_redis_per_tenant_from_policy_choices(rclient):
    sink = RedisOutcomeSink(rclient, decay=1.0)
    for i in range(5):
        sink.emit(outcome(i, drafted=10, accepted=3))
    sink.emit(outcome(9, draft="selfspec", cat="code", drafted=4, accepted=4))
    sink.emit(outcome(10, drafted=10, accepted=0, source="request"))  # a forced arm counts for nothing
    sink.emit(outcome(11, drafted=10, accepted=0, tenant="other"))  # another tenant's tally
    sink.emit(outcome(12, drafted=10, accepted=10, cat="summarization", classified="code"))  # hint disagreed
    sink.close()
    table = read_table(rclient)
    assert table[("t", "summarization")]["ngram"] == (0.3, 40)  # (acceptance, rounds of evidence)
    assert table[("t", "code")] == {"selfspec": (1.0, 8), "ngram": (1.0, 8)}
    assert table[("other", "summarization")]["ngram"] == (0.0, 8)


def test_the_guard_counts_acceptance_per_verified_token(rclient):
    """The adaptive engine drafts freely and verifies what it expects to keep:
    3 accepted of 40 drafted but of 4 verified is 0.75, not 0.075."""
    sink = RedisOutcomeSink(rclient, decay=1.0)
    sink.emit(outcome(1, drafted=40, verified=4, accepted=3))
    sink.close()
    assert read_table(rclient)[("t", "summarization")]["ngram"] == (0.75, 8)


def test_a_training_row_says_how_many_rounds_verified_only_when_every_round_is_known():
    f = RequestFeatures(category="qa", temperature=1.0, top_p=1.0, prompt_tokens=30, expected_output_tokens=20,
                        copy_signal=0.1)
    d = Decision(Arm("ngram", 8), "policy", None, "prior", "r")
    per_round = dict(drafted_per_round=[3, 0, 2, 0, 4], verified_per_round=[2, 0, 0, 0, 1],
                     accepted_per_round=[2, 0, 0, 0, 0])
    st = GenerationStats(arm="ngram:8", output_tokens=8, rounds=5, total_s=0.5, prefill_s=0.1, **per_round)
    row = OutcomeRecord.of("c1", "t", "local", f, d, st, 0.1).training_row()
    assert (row.verifying_rounds, row.verified, row.accepted, row.trials) == (2, 3, 2, 3)
    partial = GenerationStats(arm="ngram:8", output_tokens=8, rounds=7, total_s=0.5, prefill_s=0.1, **per_round)
    assert OutcomeRecord.of("c2", "t", "local", f, d, partial, 0.1).training_row().verifying_rounds is None


def test_a_training_row_takes_its_undrafted_time_from_what_the_engine_says_speculation_cost():
    f = RequestFeatures(category="qa", temperature=0.0, top_p=1.0, prompt_tokens=30, expected_output_tokens=20,
                        copy_signal=0.1)
    d = Decision(Arm("ngram", 8), "policy", None, "prior", "r")

    def row(spec):
        st = GenerationStats(arm="ngram:8", output_tokens=8, rounds=5, total_s=0.6, prefill_s=0.1, speculation_s=spec)
        rec = OutcomeRecord.from_json(OutcomeRecord.of("u", "t", "local", f, d, st, 0.1).to_json())
        return rec.training_row()

    assert row(0.15).plain_s == pytest.approx(0.35)  # the decode's 0.5 s less what drafting added
    assert row(0.0).plain_s == pytest.approx(0.5)
    assert row(None).plain_s is None  # a server that does not say: the plain-step model prices it
    assert row(5.0).plain_s == pytest.approx(0.1) and row(float("nan")).plain_s is None  # not believed


def test_records_of_schema_1_are_still_read():
    old = {"schema": 1, "request_id": "o1", "tenant": "", "engine": "local",
           "features": {"category": "qa", "temperature": 0.7, "top_p": 1.0, "prompt_tokens": 9,
                        "expected_output_tokens": 64, "copy_signal": 0.1, "rolling_acceptance": {}},
           "decision": {"arm": "ngram:3", "draft": "ngram", "source": "policy", "propensity": 0.5},
           "result": {"output_tokens": 30, "rounds": 12, "decode_s": 0.9, "drafted": 20, "accepted": 9}}
    row = OutcomeRecord.from_dict(old).training_row()
    assert row.arm == Arm("ngram", 3) and row.rounds == 12 and row.propensity == 0.5 and row.plain_s is None
    for bad in ({**old, "schema": 99}, {**old, "decision": {"arm": "ngram:²"}}, [], {"schema": 2}):
        try:
            OutcomeRecord.from_dict(bad)
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad}")


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
