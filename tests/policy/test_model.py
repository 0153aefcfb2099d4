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
    expected_tokens_per_round,
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


def test_a_draft_added_after_a_decision_is_priced_by_its_own_coefficients():
    f = RequestFeatures(category="chat", temperature=0.0, top_p=1.0, prompt_tokens=50, expected_output_tokens=64,
                        copy_signal=0.0)
    model = PolicyModel("t")
    before = model.speedup(f, "ngram", 4)  # the prior's, and its stack made
    model.drafts["ngram"] = dataclasses.replace(prior_draft("ngram"), cost_coef=[0.0, 2.0, 0.0])
    assert model.speedup(f, "ngram", 4) < 1.0 < before
    assert model.stack(("ngram",), (DraftKind.guess("ngram"),)).models == (model.drafts["ngram"],)
