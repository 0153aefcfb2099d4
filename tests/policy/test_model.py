"""The speedup model: the stacked table a decision prices its menu with agrees with
the formula one draft at a time."""

import dataclasses

import numpy as np
import pytest

from engines.arms import DraftKind
from policy.features import RequestFeatures
from policy.model import (
    N_FEATURES,
    DraftModel,
    DraftStack,
    PolicyModel,
    acceptance_features,
    expected_tokens_per_round,
    powers,
    prior_draft,
)


def _by_hand(m: DraftModel, alpha: float, q: float, f: RequestFeatures, gamma: int) -> float:
    """The module docstring's formula, a draft and a bound at a time, in plain floats."""
    L = f.expected_output_tokens
    return max(L / (L * m.round_cost(q * k, f.load) / (q * expected_tokens_per_round(alpha, k) + 1 - q)
                    + m.overhead(f)) for k in range(1, gamma + 1))


@pytest.mark.parametrize("load", [0, 3, 40])
def test_the_stacked_table_prices_every_draft_as_it_would_alone(load):
    rng = np.random.default_rng(load)
    f = RequestFeatures(category="code", temperature=0.7, top_p=1.0, prompt_tokens=900, expected_output_tokens=96,
                        copy_signal=0.3, running=load)
    ms = (prior_draft("ngram"), prior_draft("eagle"),
          DraftModel([0.0] * N_FEATURES, None, [0.1, 0.3, 0.05], overhead_steps=7.0, overhead_per_prompt_token=0.01))
    alpha = rng.uniform(0.0, 0.99, size=(5, len(ms)))  # [draws, drafts]
    coverage = np.array([0.4, 1.0, 0.8])
    table = DraftStack(ms).speeds(alpha, f, 8, coverage)
    assert table.shape == (8, 5, 3)
    for j, m in enumerate(ms):
        for i in range(5):
            for g in range(1, 9):
                assert table[g - 1, i, j] == pytest.approx(_by_hand(m, alpha[i, j], coverage[j], f, g), rel=1e-12)


def test_a_stack_without_coverage_models_prices_as_at_full_coverage():
    """A stack whose drafts have no coverage model (the prior's) takes fewer array calls:
    the same figures, to the bit, as the general path given a coverage of ones."""
    f = RequestFeatures(category="qa", temperature=0.0, top_p=1.0, prompt_tokens=300, expected_output_tokens=128,
                        copy_signal=0.1, running=2)
    ms = (prior_draft("ngram"), prior_draft("eagle"), prior_draft("hybrid"))
    stack = DraftStack(ms)
    alpha = np.random.default_rng(2).uniform(0.0, 0.99, size=(65, 3))
    fast = stack.speeds(alpha, f, 8, stack.coverage(acceptance_features(f)))
    assert np.array_equal(fast, stack.speeds(alpha, f, 8, np.ones(3)))
    for j, m in enumerate(ms):
        assert fast[7, 0, j] == pytest.approx(_by_hand(m, alpha[0, j], 1.0, f, 8), rel=1e-12)


def test_powers_by_doubling_are_the_powers():
    a = np.random.default_rng(3).uniform(0.0, 1.0, size=(4, 3))
    for n in range(1, 12):
        want = a[None] ** np.arange(2, n + 2, dtype=float)[:, None, None]
        np.testing.assert_allclose(powers(a, n), want, rtol=1e-14, atol=0)


def test_the_stacked_posterior_and_coverage_are_each_drafts_own():
    """Drafts with a fitted covariance, the prior's, with a coverage model and
    without: each row of the stack reads its own draft's coefficients."""
    rng = np.random.default_rng(1)
    f = RequestFeatures(category="rag", temperature=1.0, top_p=0.9, prompt_tokens=400, expected_output_tokens=64,
                        copy_signal=0.6, repetition=0.2, code=0.1)
    x = acceptance_features(f)
    a = rng.normal(size=(N_FEATURES, N_FEATURES))
    fitted = DraftModel(rng.normal(size=N_FEATURES).tolist(), (a @ a.T / N_FEATURES).ravel().tolist(),
                        coverage_coef=rng.normal(size=N_FEATURES).tolist(), samples=100)
    ms = (prior_draft("eagle"), fitted, prior_draft("hybrid"))
    stack = DraftStack(ms)
    mean, sd = stack.posterior(x)
    coverage = stack.coverage(x)
    for j, m in enumerate(ms):
        assert (mean[j], sd[j]) == pytest.approx(m.logit(x), rel=1e-12)
        assert coverage[j] == pytest.approx(m.coverage(x), rel=1e-12)
    assert coverage[0] == coverage[2] == 1.0 != coverage[1]


def test_a_draft_put_into_a_model_after_it_priced_the_prior_is_priced_by_its_own_coefficients():
    f = RequestFeatures(category="chat", temperature=0.0, top_p=1.0, prompt_tokens=50, expected_output_tokens=64,
                        copy_signal=0.0)
    model = PolicyModel("t")
    before = model.speedup(f, "ngram", 4)  # the prior's, and its stack made
    model.drafts["ngram"] = dataclasses.replace(prior_draft("ngram"), cost_coef=[0.0, 2.0, 0.0])
    assert model.speedup(f, "ngram", 4) < 1.0 < before
    assert model.stack(("ngram",), (DraftKind.guess("ngram"),)).models == (model.drafts["ngram"],)
