"""Learning from synthetic telemetry whose best arm depends on category,
temperature and load."""

import dataclasses
import random

import numpy as np
import pytest

from policy.features import RequestFeatures
from policy.model import PolicyModel, expected_tokens_per_round, prior_model
from policy.train import alpha_from_tokens_per_round, fit, greedy_arm, offline_value
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
    assert offline_value(trained, logged, ARMS) > offline_value(prior_model(), logged, ARMS)


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
    prior = prior_model()
    m, p = model.draft("ngram"), prior.draft("ngram")
    assert m.samples > 0
    assert m.cost_coef[2:] == pytest.approx(p.cost_coef[2:], abs=1e-6)  # load and γ·load: the prior's
    busy = RequestFeatures(category="summarization", temperature=0.0, top_p=1.0, prompt_tokens=400,
                           expected_output_tokens=200, copy_signal=0.8, running=32, waiting=0)
    assert model.speedup(busy, "ngram", 8) < model.speedup(busy.__class__(**{**busy.__dict__, "running": 0}),
                                                           "ngram", 8)


def test_exploration_anneals_with_evidence():
    from policy.train import exploration_share

    shares = [exploration_share(n) for n in (0, 50, 100, 400, 900, 10_000)]
    assert shares == sorted(shares, reverse=True)
    assert shares[0] == prior_model().explore == 0.2 and shares[-1] == 0.03
    assert fit(simulate(400, seed=2)).explore == pytest.approx(exploration_share(400))


def test_learned_load_terms_are_never_negative():
    from policy.train import fit_round_cost

    rng = np.random.default_rng(0)
    x = np.array([[1.0, g, load, g * load] for g in range(1, 9) for load in (0, 4, 8, 16) for _ in range(5)])
    y = 1.1 + 0.05 * x[:, 1] - 0.01 * x[:, 2] + rng.normal(0, 0.01, len(x))  # a (noisy) cheaper-under-load fit
    coef = fit_round_cost(x, y, np.ones(len(x)), np.array([1.0, 0.05, 0.0, 0.03]))
    assert coef[2] >= 0 and coef[3] >= 0
    assert coef[1] == pytest.approx(0.05, abs=0.02)
