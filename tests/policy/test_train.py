"""Learning from synthetic telemetry whose best arm depends on category,
temperature and load."""

import dataclasses
import random

import numpy as np
import pytest

from engines.arms import Arm, DraftKind
from policy.features import RequestFeatures
from policy.model import PolicyModel, acceptance_features, expected_tokens_per_round, prior_model, prior_of
from policy.train import (
    TrainingRow,
    alpha_from_tokens_per_round,
    cross_fitted,
    fit,
    greedy_arm,
    observed_speed,
    plain_step_model,
)
from tests.helpers import WORLD_ARMS as ARMS
from tests.helpers import world_context as context
from tests.helpers import world_outcomes as simulate
from tests.helpers import world_speedup as true_speedup


@pytest.fixture(scope="module")
def trained():
    return fit(simulate(6000, seed=1), version="test")


def test_alpha_inversion_roundtrips():
    for a in (0.0, 0.3, 0.77, 0.95):
        for g in (1, 4, 8):
            assert alpha_from_tokens_per_round(expected_tokens_per_round(a, g), g) == pytest.approx(a, abs=1e-6)


def test_trained_chooser_picks_the_best_arm_in_90_percent_of_held_out_contexts(trained):
    rng = random.Random(99)
    held_out = [context(rng) for _ in range(500)]
    hits = 0
    for f in held_out:
        best = max(true_speedup(a, f) for a in ARMS)
        chosen = greedy_arm(trained, f, ARMS)
        # neighbouring γ can be within noise of each other; 2% counts as the best
        hits += true_speedup(chosen, f) >= 0.98 * best
    assert hits / len(held_out) >= 0.9, f"best arm in only {hits / len(held_out):.0%} of contexts"


def test_trained_chooser_beats_every_fixed_arm(trained):
    rng = random.Random(7)
    held_out = [context(rng) for _ in range(400)]
    adaptive = np.mean([true_speedup(greedy_arm(trained, f, ARMS), f) for f in held_out])
    for arm in ARMS:
        fixed = np.mean([true_speedup(arm, f) for f in held_out])
        assert adaptive > fixed, f"fixed {arm.name} ({fixed:.3f}) >= adaptive ({adaptive:.3f})"


def test_offline_evaluation_ranks_the_trained_model_above_the_prior(trained):
    logged = simulate(3000, seed=5)
    (trained_value, _, _), (prior_value, _, _) = cross_fitted(logged, [trained, prior_model()], ARMS,
                                                              plain_step_model(logged))
    assert trained_value.mean() > prior_value.mean()


def test_model_roundtrips_through_json_and_refuses_garbage(trained):
    again = PolicyModel.from_json(trained.to_json())
    f = context(random.Random(3))
    assert again.speedup(f, "ngram", 4) == trained.speedup(f, "ngram", 4)
    with pytest.raises(ValueError):
        PolicyModel.from_json('{"format": "something-else"}')
    broken = trained.to_json().replace('"accept_coef": [', '"accept_coef": [1.0, ', 1)
    with pytest.raises(ValueError, match="shapes"):
        PolicyModel.from_json(broken)


def test_drafts_with_too_little_telemetry_keep_the_prior():
    rows = [r for r in simulate(400, seed=2) if r.arm.draft != "draft"][:200]
    model = fit(rows)
    assert "draft" not in model.drafts
    f = context(random.Random(1))
    assert model.speedup(f, "draft", 3) == prior_model().speedup(f, "draft", 3)


def test_what_the_data_never_varied_keeps_the_prior():
    """Trained only on requests that ran alone, the model cannot learn what load
    costs; it must keep the prior's load penalty rather than assume none."""
    rows = [r for r in simulate(3000, seed=5) if r.features.waiting == 0]
    rows = [dataclasses.replace(r, features=dataclasses.replace(r.features, running=k % 2),  # alone, give or take
                                decode_s=r.decode_s * (1.0 - 0.1 * (k % 2)))  # noise that fits a negative slope
            for k, r in enumerate(rows)]
    model = fit(rows, version="alone")
    m, p = model.draft("ngram"), prior_model().draft("ngram")
    assert m.samples > 0
    assert m.cost_coef[2] == pytest.approx(p.cost_coef[2], abs=1e-9)  # the k·load term: the prior's
    busy = RequestFeatures(category="summarization", temperature=0.0, top_p=1.0, prompt_tokens=400,
                           expected_output_tokens=200, copy_signal=0.8, running=32, waiting=0)
    assert model.speedup(busy, "ngram", 8) < model.speedup(dataclasses.replace(busy, running=0), "ngram", 8)
    # the prior kept is that of the draft's kind: by its name, or as the engine reports it
    kept = {fit(rows, kind_of=lambda d, k=k: DraftKind(k)).draft("draft").cost_coef[2] for k in ("ngram", "model")}
    assert kept == {prior_of(DraftKind("ngram")).cost_coef[2], prior_of(DraftKind("model")).cost_coef[2]}
    assert model.draft("draft").cost_coef[2] == prior_of(DraftKind("model")).cost_coef[2]


def test_uncertainty_shrinks_with_evidence_and_exploration_follows():
    """Exploration is Thompson sampling on the posterior: with more outcomes the
    posterior narrows, and decisions explore less."""
    import random as _random

    from engines.arms import ArmMenu
    from policy.decide import decide
    from policy.model import acceptance_features
    from policy.rules import parse_rules

    f = context(random.Random(11))
    sds = []
    for n in (200, 1000, 5000):
        model = fit(simulate(n, seed=3))
        sds.append(model.draft("draft").logit(acceptance_features(f))[1])
    assert sds[0] > sds[1] > sds[2]
    rules = parse_rules("default: {}")
    explored = []
    for n in (300, 6000):
        model = fit(simulate(n, seed=4))
        rng = _random.Random(0)
        ds = [decide(context(rng), rules, model, rng, ArmMenu(("ngram", "draft"), 1, 8)) for _ in range(300)]
        explored.append(sum(d.explored for d in ds))
        assert all(0 < d.propensity <= 1 for d in ds)
    assert explored[0] > explored[1]


def test_learned_costs_are_never_negative():
    from policy.model import prior_draft
    from policy.train import fit_cost, plain_step_model

    rows = simulate(2000, seed=6)
    # a world where longer drafts got cheaper under load: the fit must not follow it below zero
    rows = [dataclasses.replace(r, decode_s=r.decode_s * max(0.3, 1 - 0.02 * r.arm.gamma * r.load / 8))
            for r in rows if not r.arm.is_plain] + [r for r in rows if r.arm.is_plain]
    spec = [r for r in rows if not r.arm.is_plain]
    coef = fit_cost(spec, [1.0] * len(spec), plain_step_model(rows), prior_draft("model"))
    assert all(c >= 0 for c in coef)


def test_a_candidate_is_promoted_only_when_shown_better():
    from policy.train import judge

    rows = simulate(5000, seed=8)
    candidate, decision = judge(rows, prior_model(), ARMS)
    assert decision["promoted"] and decision["lower_bound"] > 0 and decision["evaluated_rows"] == 1500
    assert decision["agreement"] < 1 and decision["fit_drafts"]
    assert candidate.metrics["judgement"] == decision
    # against itself (a live model as good as the candidate), nothing is shown better
    _, again = judge(rows, candidate, ARMS)
    assert not again["promoted"] and "lower bound" in again["reason"]


def test_the_bound_tightens_with_every_judgement_against_one_live_model():
    import math

    from policy.train import ALPHA, bound_z, judge

    assert bound_z(1) == pytest.approx(1.875, abs=0.01) and bound_z(1) < bound_z(2) < bound_z(10) < bound_z(100)
    assert sum(ALPHA * 6 / (math.pi ** 2 * k ** 2) for k in range(1, 100_000)) < ALPHA  # never more than α in all
    rows = simulate(1000, seed=9)  # a real gain over the prior, shown at about 2.2 standard errors
    _, first = judge(rows, prior_model(), ARMS)
    assert first["promoted"] and first["tested"] and (first["attempt"], first["z"]) == (1, round(bound_z(1), 3))
    # the same evidence at the third judgement against the same live model is not enough
    _, third = judge(rows, prior_model(), ARMS, attempt=3)
    assert not third["promoted"] and third["attempt"] == 3 and third["lower_bound"] < 0 < third["difference"]


def test_a_candidate_the_older_rows_cannot_fit_is_said_to_choose_as_the_live_model():
    from policy.train import MIN_ROWS_PER_DRAFT, judge

    rows = simulate(int(MIN_ROWS_PER_DRAFT / 0.7), seed=9)  # the older 70%: too few for any draft to leave the prior
    _, decision = judge(rows, prior_model(), ARMS)
    assert (decision["agreement"], decision["difference"], decision["fit_drafts"], decision["promoted"]) == (
        1.0, 0.0, [], False)
    assert "no draft has" in decision["reason"]


def test_a_draft_that_verifies_in_few_rounds_is_priced_by_the_rounds_it_verifies_in():
    """α is learnt per verified token; at T=1 prompt lookup verifies in one round of
    five (no match, or a match not worth verifying) and keeps 0.6 of what it
    verifies. Priced as if every round verified, it looks ~1.5x plain; learnt
    coverage brings it to what such rounds give."""
    from policy.model import N_FEATURES, DraftModel

    rng, nrng = random.Random(0), np.random.default_rng(0)
    cost = DraftModel([0.0] * N_FEATURES)  # the prior's per-token cost: the world's rounds cost c(k)
    rows = []
    for _ in range(400):
        t = rng.choice([0.0, 1.0])
        f = RequestFeatures(category="qa", temperature=t, top_p=1.0, prompt_tokens=200, expected_output_tokens=200,
                            copy_signal=0.3)
        q, k, alpha = (0.9 if t == 0 else 0.2), 4, 0.6
        rounds = 120
        verifying = int(nrng.binomial(rounds, q))
        per = [int(min(nrng.geometric(1 - alpha) - 1, k)) for _ in range(verifying)]  # accepted per verifying round
        out = 1 + (rounds - verifying) + sum(a + 1 for a in per)
        secs = 0.05 * ((rounds - verifying) * cost.round_cost(0, 0) + verifying * cost.round_cost(k, 0))
        trials = sum(a + (1 if a < k else 0) for a in per)
        rows.append(TrainingRow(f, Arm("ngram", 8), 0.5, out, rounds, secs, trials=trials, accepted=sum(per),
                                verified=verifying * k, verifying_rounds=verifying))
        rows.append(TrainingRow(f, Arm(), 0.5, 120, 119, 119 * 0.05))
    hot = RequestFeatures(category="qa", temperature=1.0, top_p=1.0, prompt_tokens=200, expected_output_tokens=200,
                          copy_signal=0.3)
    truth = np.mean([r.output_tokens / r.decode_s * 0.05 for r in rows
                     if r.features.temperature == 1.0 and not r.arm.is_plain])
    model = fit(rows)
    learnt = model.speedup(hot, "ngram", 8)
    blind = fit([dataclasses.replace(r, verifying_rounds=None) for r in rows]).speedup(hot, "ngram", 8)
    assert model.draft("ngram").coverage(acceptance_features(hot)) == pytest.approx(0.2, abs=0.05)
    assert learnt == pytest.approx(truth, rel=0.08), (learnt, truth)
    assert blind > 1.25 * truth, (blind, truth)  # without coverage: every round priced as a verifying one


def test_a_model_written_before_coverage_still_loads_and_prices_every_round_as_verifying(trained):
    import json

    d = json.loads(trained.to_json())
    for v in d["drafts"].values():
        v.pop("coverage_coef")
    old = PolicyModel.from_json(json.dumps(d))
    f = context(random.Random(4))
    assert old.draft("ngram").coverage(acceptance_features(f)) == 1.0
    assert old.speedup(f, "ngram", 4) == trained.speedup(f, "ngram", 4)
    d["drafts"]["ngram"]["coverage_coef"] = [0.0] * 3
    with pytest.raises(ValueError, match="shapes"):
        PolicyModel.from_json(json.dumps(d))


def test_a_busy_spell_does_not_teach_idle_requests_that_a_draft_never_pays():
    """Under load the engine's step budget declines most drafts: measured rows that verified
    nothing say nothing about acceptance, and loaded rows do not set the coverage idle
    requests are priced with (the features have no load term)."""
    def row(i, running, verifying, trials, accepted):
        f = RequestFeatures("qa", 0.0, 1.0, 300 + i, 200, 0.1, running=running)
        return TrainingRow(f, Arm("draft", 4), 0.5, output_tokens=150, rounds=100, decode_s=6.0, trials=trials,
                           accepted=accepted, verified=trials, verifying_rounds=verifying)

    idle = [row(i, 0, 100, 200, 120) for i in range(40)]  # α 0.6 per tried token, every round verifies
    busy = [row(i, 16, 0, 0, 0) for i in range(160)]  # the budget verified nothing
    alone, mixed = fit(idle), fit(idle + busy)
    f = RequestFeatures("qa", 0.0, 1.0, 320, 200, 0.1)
    x = acceptance_features(f)
    assert alone.draft("draft").alpha(f) > 0.5
    assert abs(mixed.draft("draft").alpha(f) - alone.draft("draft").alpha(f)) < 0.02
    assert mixed.draft("draft").coverage(x) == pytest.approx(alone.draft("draft").coverage(x), abs=0.02)
    assert mixed.draft("draft").coverage(x) > 0.9


def test_a_candidate_is_judged_by_outcomes_it_was_not_fit_on_not_by_its_own_predictions():
    """The older rows say prompt lookup pays 2x on these requests; the prior, live, serves
    them plain. Without lookup's outcomes among the newer rows nothing the candidate
    was not fit on prices its choice, and it is not promoted (scored by its own fit, it
    was promoted on its own word; priced by the prior, on the prior's); with them, it is."""
    from policy.train import judge

    rng = np.random.default_rng(3)

    def row(i, arm, propensity):
        f = RequestFeatures("qa", 1.0, 1.0, 200 + i % 7, 200, 0.0)
        step = 0.05 * float(rng.lognormal(0, 0.05))
        if arm.is_plain:
            return TrainingRow(f, arm, propensity, 200, 199, 199 * step, request_id=f"r{i}")
        # 4 drafts, 3 accepted per round (α 0.75): 50 rounds of 1.2 plain steps for 199 tokens
        return TrainingRow(f, arm, propensity, 200, 50, 50 * 1.2 * step, request_id=f"r{i}", trials=200,
                           accepted=150, verified=200, verifying_rounds=50)

    lookup, plain = Arm("ngram", 4), Arm()
    live = prior_model()
    assert greedy_arm(live, row(0, plain, 1.0).features, ARMS) == plain  # the prior's lookup: α ≈ 0.04 at T=1
    older = [row(i, lookup if i % 3 else plain, 0.5) for i in range(280)]
    unseen = older + [row(280 + i, plain, 1.0) for i in range(120)]
    _, decision = judge(unseen, live, ARMS)
    assert decision["evaluated_rows"] == 120 and decision["agreement"] == 0.0
    assert (decision["prior_priced"], decision["promoted"], decision["tested"]) == (1.0, False, False)
    seen = older + [row(280 + i, lookup if i % 3 else plain, 0.5) for i in range(120)]  # both halves hold both
    _, decision = judge(seen, live, ARMS)
    assert decision["promoted"] and decision["lower_bound"] > 0.5 and decision["prior_priced"] == 0.0


def test_a_rows_own_outcome_does_not_price_the_arms_it_did_not_serve():
    """cross_fitted: where a policy chooses other than the logged arm, the row's estimate
    comes from a reward model fit on the other fold, so its own outcome cannot move it
    (an in-sample reward model would be pulled towards it)."""
    rows = simulate(400, seed=4)
    model = fit(simulate(3000, seed=5))
    step = plain_step_model(rows)
    (values, choices, _), = cross_fitted(rows, [model], ARMS, step)
    order = rows[0::2] + rows[1::2]  # fold by fold
    k = next(i for i, (r, c) in enumerate(zip(order, choices)) if c != r.arm and r.arm.draft == c.draft)
    changed = [dataclasses.replace(r, decode_s=r.decode_s * 0.5) if r is order[k] else r for r in rows]
    (again, again_choices, _), = cross_fitted(changed, [model], ARMS, step)
    assert again_choices == choices and again[k] == values[k]
    assert not np.array_equal(again, values)  # it still prices its draft for the other fold


def test_without_plain_rows_each_rows_undrafted_time_is_the_yardstick():
    """A policy that always drafts sends no plain rows, so the plain step is not
    measured: priced against a guess (50 ms), a machine whose step is 80 ms had
    every draft look slow and plain win most contexts. Rows whose engine says what
    their rounds took undrafted are priced against that, whatever the machine."""
    spec = [a for a in ARMS if not a.is_plain]
    rng = random.Random(99)
    held_out = [context(rng) for _ in range(400)]
    hits = {}
    for undrafted in (False, True):
        rows = simulate(6000, seed=1, step_s=0.08, arms=spec, undrafted=undrafted)
        step = plain_step_model(rows)
        if undrafted:
            assert step[0] == pytest.approx(0.08, rel=0.05)
            assert np.median([abs(observed_speed(r, step) / true_speedup(r.arm, r.features) - 1)
                              for r in rows[:500]]) < 0.1
        model = fit(rows)
        hits[undrafted] = np.mean([true_speedup(greedy_arm(model, f, ARMS), f) >=
                                   0.98 * max(true_speedup(a, f) for a in ARMS) for f in held_out])
    assert hits[True] >= 0.9 and hits[False] < 0.6, hits
