"""`specgate bench-gate`: the retrainer's promotion gate replayed on learning streams
priced by bench runs' measurements."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from bench.specbench import gate, replay
from engines.arms import Arm
from gateway import cli
from policy.classifier import CategoryClassifier
from policy.model import prior_model
from policy.rules import NO_RULES

MODES = ["plain", "ngram:8", "eagle:6", "adaptive"]
PROMPTS = ["Summarize the following text: the cat sat on the mat. " * 4, "Write a poem about rain.",
           "def add(a, b):\n    return a + b\n# fix this function"]


def _run(tmp_path, name: str, plain_s: float, speedup: float) -> dict:
    """A run of three requests whose every draft runs `speedup` times plain, 3 of 4 drafts kept per round."""
    ms = []
    for i in range(len(PROMPTS)):
        for mode in MODES[:3]:
            spec = mode != "plain"
            rounds = 16 if spec else 63
            ms.append(dict(idx=i, mode=mode, concurrency=1, repeat=0, output_tokens=64, ttft_s=0.1,
                           latency_s=0.1 + plain_s / (speedup if spec else 1.0), rounds=rounds,
                           drafted=4 * rounds if spec else 0, accepted=3 * rounds if spec else 0))
    data = tmp_path / "dev.jsonl"
    data.write_text("".join(json.dumps({"question_id": f"q{i}", "category": f"c{i}", "turns": [p]}) + "\n"
                            for i, p in enumerate(PROMPTS)))
    bench = dict(settings=dict(data=str(data), per_category=1, temperatures=[0.0, 0.7], seed=0, max_tokens=64,
                               modes=MODES), requests=[dict(idx=i, question_id=f"q{i}") for i in range(3)],
                 measurements=ms)
    (tmp_path / f"{name}.json").write_text(json.dumps(bench))
    return bench


def _choosing_plain():
    """A start that never drafts: every draft's acceptance far below the prior's, as fit on
    outcomes (a draft with none behind it would get the untried share of requests)."""
    model = prior_model()
    model.version = "plain-only"
    for d in ("ngram", "eagle"):
        model.drafts[d] = dataclasses.replace(replay.with_level(model.draft(d), -20.0, 0.0), samples=1000)
    return model


def test_the_runs_mean_prices_a_model_and_a_measurement_becomes_a_training_row(tmp_path):
    runs = [_run(tmp_path, "a", 3.0, 2.0), _run(tmp_path, "b", 5.0, 2.0)]
    mean = gate.mean_run(runs)
    m = next(x for x in mean["measurements"] if (x["idx"], x["mode"]) == (1, "eagle:6"))
    assert m["latency_s"] == pytest.approx(0.1 + 4.0 / 2.0)
    g = gate.GateReplay(runs, replay.workload_of(runs[0]), NO_RULES, CategoryClassifier.load())
    assert g.price(_choosing_plain()) == pytest.approx(1.0)
    assert g.price(prior_model()) > 1.5  # the prior drafts here, and every draft runs ~1.9x plain
    raw = next(x for x in runs[0]["measurements"] if (x["idx"], x["mode"]) == (0, "ngram:8"))
    f = replay.features_of(g.requests[0], runs[0]["settings"], g.classifier, prior_model())
    row = gate.training_row(f, SimpleNamespace(arm=Arm.parse("ngram:8"), propensity=0.5), raw, "r0")
    # 16 rounds of 4 drafts, 3 kept: each round tried its 3 and one rejection
    assert (row.rounds, row.accepted, row.verified, row.trials) == (16, 48, 64, 64)
    assert row.decode_s == pytest.approx(raw["latency_s"] - 0.1) and row.propensity == 0.5


def test_a_start_that_never_drafts_is_not_replaced_on_the_priors_word_and_a_bad_run_is_refused(tmp_path, capsys):
    """Drafts run ~2x plain in these runs, but a live model that never drafts gathers no
    outcome of one: the judge will not let the prior alone vouch for a candidate's drafts."""
    _run(tmp_path, "a", 3.0, 2.0)
    _run(tmp_path, "b", 4.0, 1.8)
    start = tmp_path / "start.json"
    start.write_text(_choosing_plain().to_json())
    out = tmp_path / "gate.json"
    args = ["bench-gate", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--policy", str(start),
            "--streams", "2", "--requests", "60", "--min-rows", "40", "--every", "10", "--out", str(out)]
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    assert "2 streams of 60 requests over 3 requests of 2 run(s), from plain-only (1.0000x plain" in printed
    result = json.loads(out.read_text())
    assert result["summary"]["streams_promoting"] == 0 and result["summary"]["final_max"] == pytest.approx(1.0)
    bench = json.loads((tmp_path / "b.json").read_text())
    bench["settings"]["modes"] = ["plain", "ngram:8", "adaptive"]  # not the other run's arms
    (tmp_path / "b.json").write_text(json.dumps(bench))
    assert cli.main(args) == 2
    assert "one set of arms" in capsys.readouterr().err


def test_a_start_with_no_outcomes_of_its_drafts_tries_them_until_the_judge_can_price_them(tmp_path, monkeypatch):
    """Drafts run ~2x plain, but the start prices both near plain by the prior alone (no
    outcomes behind them): the untried share serves them (raised here, so that a short
    stream gathers 30 outcomes of each draft in each half of the newer rows) and the
    judge then promotes a model that drafts. Without the share nothing is learnt."""
    import policy.decide

    runs = [_run(tmp_path, "a", 3.0, 2.0), _run(tmp_path, "b", 4.0, 1.8)]
    g = gate.GateReplay(runs, replay.workload_of(runs[0]), NO_RULES, CategoryClassifier.load())
    start = prior_model()
    start.version = "untried"
    for d in ("ngram", "eagle"):
        start.drafts[d] = replay.with_level(start.draft(d), -20.0, 0.0)
    monkeypatch.setattr(policy.decide, "EXPLORE_UNTRIED", 0.5)
    learnt = g.stream(start, 0, 1000, 200, 40)
    assert learnt["promotions"] and learnt["final"] > 1.5 > g.price(start)
    monkeypatch.setattr(policy.decide, "EXPLORE_UNTRIED", 0.0)
    assert g.stream(start, 0, 1000, 200, 40)["promotions"] == []


def test_the_summary_counts_promotions_that_chose_worse_and_streams_that_ended_slower():
    streams = [dict(seed=0, promotions=[], final=None),
               dict(seed=1, promotions=[dict(replaced=1.2, replayed=1.1), dict(replaced=1.1, replayed=1.25)],
                    final=1.25),
               dict(seed=2, promotions=[dict(replaced=1.2, replayed=1.15)], final=1.15)]
    out = gate.summarise(streams, start=1.2)
    assert (out["streams_promoting"], out["promotions"], out["promotions_slower"], out["streams_ending_slower"]) == (
        2, 3, 2, 1)
    assert out["final_mean"] == pytest.approx((1.2 + 1.25 + 1.15) / 3) and out["final_min"] == 1.15
