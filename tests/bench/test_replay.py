"""`specgate bench-replay`: a policy's choices priced by a run's fixed-arm measurements."""

from __future__ import annotations

import json

import pytest

from bench.specbench import replay
from bench.specbench.workload import WorkloadError
from gateway import cli
from policy.classifier import CategoryClassifier
from policy.model import INTERCEPT, TEMPERATURE, DraftModel, prior_draft, prior_model, speedups_at
from policy.rules import load_rules

# per request: (tokens, seconds) under plain, ngram:8, eagle:6; request 1 is the one where the head wins
TIMES = [((60, 3.0), (60, 2.0), (60, 2.5)),
         ((40, 2.0), (40, 1.8), (40, 1.0)),
         ((80, 4.0), (78, 2.6), (80, 3.9))]
MODES = ["plain", "ngram:8", "eagle:6", "adaptive"]


@pytest.fixture
def run(tmp_path):
    data = tmp_path / "dev.jsonl"
    prompts = ["Summarize the following text: the cat sat on the mat. " * 4, "Write a poem about rain.",
               "def add(a, b):\n    return a + b\n# fix this function"]
    data.write_text("".join(json.dumps({"question_id": f"q{i}", "category": f"c{i}", "turns": [p]}) + "\n"
                            for i, p in enumerate(prompts)))
    ms = [dict(idx=i, mode=mode, concurrency=1, repeat=0, output_tokens=t, latency_s=s)
          for i, arms in enumerate(TIMES) for mode, (t, s) in zip(MODES, arms)]
    ms.append(dict(idx=0, mode="adaptive", concurrency=1, repeat=0, output_tokens=60, latency_s=2.0))
    bench = dict(settings=dict(data=str(data), per_category=1, temperatures=[0.0, 0.7], seed=0, max_tokens=64,
                               modes=MODES), requests=[dict(idx=i, question_id=f"q{i}") for i in range(3)],
                 measurements=ms)
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    return bench, path, tmp_path


def _rules(tmp_path, force: str):
    p = tmp_path / f"rules-{force.replace(':', '')}.yaml"
    p.write_text(f"default: {{force: '{force}'}}\nrules: []\n")
    return load_rules(p)


def _speed(col: int) -> float:
    return sum(r[col][0] for r in TIMES) / sum(r[col][1] for r in TIMES)


def test_a_forced_arm_replays_as_that_arms_measurements(run):
    bench, _, tmp = run
    requests = replay.workload_of(bench)
    clf, model = CategoryClassifier.load(), prior_model()
    out = replay.replay(bench, requests, model, _rules(tmp, "ngram:8"), clf, draws=10)
    assert out["vs_plain"] == pytest.approx(_speed(1) / _speed(0))
    assert out["choices"] == {"ngram:8": 3}
    assert out["best_fixed"] == "ngram:8"
    # the oracle takes ngram:8 for requests 0 and 2, the head for request 1
    oracle = (60 + 40 + 78) / (2.0 + 1.0 + 2.6)
    assert out["oracle_vs_plain"] == pytest.approx(oracle / _speed(0))
    assert out["vs_oracle"] == pytest.approx(_speed(1) / oracle)
    plain = replay.replay(bench, requests, model, _rules(tmp, "plain"), clf, draws=10)
    assert plain["vs_plain"] == pytest.approx(1.0) and plain["choices"] == {"plain": 3}


def test_a_policy_that_explores_lands_between_its_arms_and_follows_its_draws(run):
    bench, _, _ = run
    requests = replay.workload_of(bench)
    clf, model = CategoryClassifier.load(), prior_model()
    from policy.rules import NO_RULES

    out = replay.replay(bench, requests, model, NO_RULES, clf, draws=50)
    assert sum(out["choices"].values()) == pytest.approx(3, abs=0.2)  # shares, rounded per arm
    assert min(out["fixed_vs_plain"].values()) <= out["vs_plain"] <= out["oracle_vs_plain"]
    model.explore = 0.0  # the mean's choice alone: one arm per request
    greedy = replay.replay(bench, requests, model, NO_RULES, clf, draws=5)
    assert all(float(n).is_integer() for n in greedy["choices"].values())


def test_the_prior_fit_recovers_the_coefficients_a_run_was_made_with(run):
    bench, _, _ = run
    requests = replay.workload_of(bench)
    clf, model = CategoryClassifier.load(), prior_model()
    prior = prior_draft("ngram")
    truth = list(prior.accept_coef)
    truth[INTERCEPT], truth[TEMPERATURE] = 0.4, -2.0
    m = DraftModel(truth, None, prior.cost_coef, prior.overhead_steps, prior.overhead_per_prompt_token)
    for r in requests:  # ngram:8 made to run exactly as `truth` predicts (two temperatures: both identifiable)
        f = replay.features_of(r, bench["settings"], clf, model)
        x = next(x for x in bench["measurements"] if x["idx"] == r.idx and x["mode"] == "ngram:8")
        tokens, plain_s = TIMES[r.idx][0]
        x["output_tokens"], x["latency_s"] = tokens, plain_s / speedups_at(m, m.alpha(f), f, [8])[0]
    fit = replay.fit_prior([(bench, requests)], clf, model)["ngram:8"]
    assert fit["kind"] == "ngram" and fit["requests"] == 3
    assert fit["intercept"] == pytest.approx(0.4, abs=0.05) and fit["temperature"] == pytest.approx(-2.0, abs=0.1)
    assert fit["loss"] < 1e-4 < fit["prior_loss"]


def test_a_data_file_that_does_not_give_the_runs_requests_is_refused(run):
    bench, _, tmp = run
    other = tmp / "other.jsonl"
    other.write_text(json.dumps({"question_id": "zz", "category": "c0", "turns": ["hi"]}) + "\n")
    with pytest.raises(WorkloadError, match="run's requests"):
        replay.workload_of(bench, str(other))


def test_the_command_prints_the_ratios_and_refuses_a_missing_file(run, capsys):
    _, path, tmp = run
    assert cli.main(["bench-replay", str(path), "--explore", "0", "--draws", "3", "--fit-prior"]) == 0
    out = capsys.readouterr().out
    assert "3 requests" in out and "x plain" in out and "the oracle" in out
    assert "prior for ngram:8 (ngram, 3 requests)" in out and "prior for eagle:6 (eagle" in out
    assert cli.main(["bench-replay", str(tmp / "nope.json")]) == 2
    assert "error:" in capsys.readouterr().err
    bench = json.loads(path.read_text())
    bench["measurements"] = [m for m in bench["measurements"] if m["mode"] != "eagle:6"]  # no full information
    path.write_text(json.dumps(bench))
    assert cli.main(["bench-replay", str(path)]) == 2
    assert "measured under every fixed arm" in capsys.readouterr().err
    bench["settings"]["modes"] = ["plain", "ngram:8", "ngram:4", "eagle:6"]  # a choice of ngram: which arm?
    path.write_text(json.dumps(bench))
    assert cli.main(["bench-replay", str(path)]) == 2
    assert "two fixed arms of one draft" in capsys.readouterr().err


def test_the_prior_chosen_by_value_reaches_the_oracle_a_temperature_slope_can_reach(run):
    """--fit-prior-value: the drafts' intercepts and slopes searched together by replayed
    speed. Here lookup wins at T=0 and the head at T=0.7 (request 1); started where the
    head is never chosen (request 1 goes plain), the search finds coefficients that choose
    as the oracle, and the speed it reports is what a policy with them replays at."""
    from policy.model import PolicyModel
    from policy.rules import NO_RULES

    bench, _, _ = run
    requests = replay.workload_of(bench)
    clf, model = CategoryClassifier.load(), prior_model()
    model.explore = 0.0  # the mean's choice: one arm per request, no draws to average
    lookup = prior_draft("ngram").accept_coef
    start = {"ngram:8": (lookup[INTERCEPT], lookup[TEMPERATURE]), "eagle:6": (-2.0, 0.0)}
    fit = replay.fit_prior_by_value([(bench, requests)], clf, model, NO_RULES, draws=3, rounds=3, start=start)
    oracle = (60 + 40 + 78) / (2.0 + 1.0 + 2.6) / _speed(0)
    assert fit["prior_replayed"] < oracle - 0.05  # request 1 served plain from there
    assert fit["replayed"] == pytest.approx(oracle)
    assert fit["drafts"]["eagle:6"]["prior"] == [-2.0, 0.0] and fit["drafts"]["eagle:6"]["kind"] == "eagle"
    drafts = {arm.split(":")[0]: replay.with_level(prior_draft(d["kind"]), d["intercept"], d["temperature"])
              for arm, d in fit["drafts"].items()}
    again = replay.replay(bench, requests, PolicyModel("fit", drafts, 0.0), NO_RULES, clf, draws=3)
    assert again["vs_plain"] == pytest.approx(fit["replayed"]) and again["choices"] == {"ngram:8": 2, "eagle:6": 1}


def test_a_prior_fit_over_several_runs_chooses_for_their_mean_and_refuses_runs_of_other_menus(run, capsys):
    """Runs on machines of one CPU model measured the head's cost differently: a prior fit
    by value over several runs is scored by the mean of its replays on each."""
    import copy

    from policy.model import PolicyModel
    from policy.rules import NO_RULES

    bench, path, tmp = run
    requests = replay.workload_of(bench)
    slower = copy.deepcopy(bench)  # here the head loses request 1 too: lookup is the oracle everywhere
    for m in slower["measurements"]:
        if m["mode"] == "eagle:6":
            m["latency_s"] *= 2.5
    clf, model = CategoryClassifier.load(), prior_model()
    model.explore = 0.0
    runs = [(bench, requests), (slower, requests)]
    fit = replay.fit_prior_by_value(runs, clf, model, NO_RULES, draws=3, rounds=2)
    drafts = {arm.split(":")[0]: replay.with_level(prior_draft(d["kind"]), d["intercept"], d["temperature"])
              for arm, d in fit["drafts"].items()}
    policy = PolicyModel("fit", drafts, 0.0)
    each = [replay.replay(b, r, policy, NO_RULES, clf, draws=3)["vs_plain"] for b, r in runs]
    assert fit["replayed"] == pytest.approx(sum(each) / 2) and fit["replayed"] >= fit["prior_replayed"]
    pooled = replay.fit_prior(runs, clf, model)["ngram:8"]
    assert pooled["requests"] == 6  # both runs' rows
    other = copy.deepcopy(bench)
    other["settings"]["modes"] = ["plain", "ngram:8", "adaptive"]
    with pytest.raises(ValueError, match="different fixed arms"):
        replay.fit_prior([(bench, requests), (other, requests)], clf, model)
    second = tmp / "slower.json"
    second.write_text(json.dumps(slower))
    assert cli.main(["bench-replay", str(path), str(second), "--explore", "0", "--draws", "3", "--fit-prior"]) == 0
    out = capsys.readouterr().out
    assert out.count("3 requests of") == 2 and "prior for ngram:8 (ngram, 6 requests)" in out


def test_a_run_of_two_passes_replays_both_and_gives_the_held_out_oracle(run):
    """A second pass where ngram:8 and the head trade their times on request 1: a
    forced arm is priced by both passes, the oracle takes the faster arm of each
    pass, and the held-out oracle the one that was faster on the other pass."""
    bench, _, tmp = run
    second = []
    for m in bench["measurements"]:
        if m["mode"] != "adaptive":
            m2 = {**m, "repeat": 1}
            if m["idx"] == 1 and m["mode"] in ("ngram:8", "eagle:6"):
                m2["latency_s"] = {"ngram:8": 1.0, "eagle:6": 1.8}[m["mode"]]
            second.append(m2)
    two = {**bench, "measurements": bench["measurements"] + second}
    requests = replay.workload_of(two)
    clf, model = CategoryClassifier.load(), prior_model()
    out = replay.replay(two, requests, model, _rules(tmp, "ngram:8"), clf, draws=10)
    both = (2 * 178) / (2 * (2.0 + 2.6) + 1.8 + 1.0)  # ngram:8 on both passes
    plain = 2 * 180 / (2 * 9.0)
    assert out["vs_plain"] == pytest.approx(both / plain)
    # request 1: the head on pass 0 (1.0 s) and ngram:8 on pass 1 (1.0 s) by their own timings;
    # chosen on the other pass, ngram:8 on pass 0 (1.8 s) and the head on pass 1 (1.8 s)
    assert out["oracle_vs_plain"] == pytest.approx((2 * 178) / (2 * 4.6 + 2.0) / plain)
    assert out["held_out_oracle_vs_plain"] == pytest.approx((2 * 178) / (2 * 4.6 + 3.6) / plain)
    assert out["vs_held_out_oracle"] == pytest.approx(both / ((2 * 178) / (2 * 4.6 + 3.6)))
    assert "vs_held_out_oracle" not in replay.replay(bench, replay.workload_of(bench), model,
                                                     _rules(tmp, "ngram:8"), clf, draws=10)
