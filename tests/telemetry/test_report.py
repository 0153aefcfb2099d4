"""`specgate report` on a real outcome stream: per category and arm, predicted
against realised speedup, acceptance, guard trips, draft errors, versions and
judgements."""

import argparse
import json

from engines.api import GenerationStats
from engines.arms import Arm
from policy.decide import Decision
from telemetry import cmd_report
from telemetry.outcomes import STREAM
from telemetry.record import OutcomeRecord
from telemetry.retrainer import DECISIONS
from tests.helpers import world_context


def record(i, arm: Arm, version: str, reason: str = "", draft_error: str = ""):
    import random

    f = world_context(random.Random(i))
    if arm.is_plain:  # 0.05 s per token
        st = GenerationStats(arm="plain", output_tokens=41, rounds=40, total_s=2.1, prefill_s=0.1)
    else:  # 40 tokens in 16 rounds of 0.06 s: 40 * 0.05 / 0.96 ≈ 2.08x plain
        st = GenerationStats(arm=arm.name, output_tokens=41, rounds=16, drafted_per_round=[4] * 16,
                             verified_per_round=[4] * 16, accepted_per_round=[1, 2] * 8 + [], total_s=1.06,
                             prefill_s=0.1, draft_error=draft_error)
    d = Decision(arm, "policy", None, version, "r", {arm.name: 1.8 if not arm.is_plain else 1.0}, 0.9, reason=reason)
    return OutcomeRecord.of(f"q{i}", "", "local", f, d, st, 0.1)


def test_report_shows_what_paid(rclient, redis_server, capsys, tmp_path):
    for i in range(40):
        rec = record(i, Arm() if i % 2 else Arm("ngram", 4), "v1" if i < 20 else "v2",
                     "ngram:4 predicted ...; guard excluded ['selfspec']" if i % 4 == 0 else "",
                     "drafting with ngram failed (RuntimeError): ..." if i % 8 == 2 else "")
        rclient.xadd(STREAM, {"v": "2", "id": rec.request_id, "record": rec.to_json()})
    rclient.lpush(DECISIONS, json.dumps(dict(candidate="v2", live="v1", evaluated_rows=30, candidate_value=1.4,
                                             live_value=1.2, lower_bound=0.05, promoted=True, time=1.0)))
    parser = argparse.ArgumentParser()
    cmd_report.add_arguments(parser)
    args = parser.parse_args(["--redis", redis_server.url, "--json", "--png", str(tmp_path / "r.png")])
    assert cmd_report.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    ngram = [r for r in out["table"].values() if r["arm"] == "ngram:4"]
    assert sum(r["requests"] for r in ngram) == 20
    assert all(abs(r["realised"] - 2.08) < 0.15 and r["predicted"] == 1.8 for r in ngram)
    assert all(r["acceptance"] == 0.375 for r in ngram)  # 24 of 64 verified drafts per request
    assert sum(r["guard_trips"] for r in out["table"].values()) == 10
    assert sum(r["draft_errors"] for r in ngram) == 5 == sum(r["draft_errors"] for r in out["table"].values())
    assert [v["version"] for v in out["versions"]] == ["v1", "v2"]
    assert out["judgements"][0]["promoted"] and (tmp_path / "r.png").stat().st_size > 1000


def test_the_markdown_says_why_a_judgement_did_not_promote(rclient, redis_server, capsys):
    """Each judgement's attempt, its z and the share of rows the prior alone priced: a
    lower bound above zero that did not promote says why in its own columns."""
    rec = record(0, Arm("ngram", 4), "v1")
    rclient.xadd(STREAM, {"v": "2", "id": rec.request_id, "record": rec.to_json()})
    for d in (dict(candidate="v2", live="v1", evaluated_rows=60, candidate_value=1.3, live_value=1.2,
                   lower_bound=0.01, promoted=False, time=2.0, attempt=3, z=2.394, prior_priced=0.2,
                   reason="on 12 newer rows ... the prior alone prices a choice"),
              dict(candidate="v0", live="prior", evaluated_rows=30, candidate_value=1.1, live_value=1.2,
                   lower_bound=-0.1, promoted=False, time=1.0)):  # recorded before attempts were
        rclient.lpush(DECISIONS, json.dumps(d))
    parser = argparse.ArgumentParser()
    cmd_report.add_arguments(parser)
    assert cmd_report.main(parser.parse_args(["--redis", redis_server.url])) == 0
    out = capsys.readouterr().out
    assert "| attempt (z) | prior-priced share |" in out
    assert "| 0.01 | 3 (2.394) | 0.2 | False | on 12 newer rows" in out
    assert "| -0.1 |  |  | False |" in out
