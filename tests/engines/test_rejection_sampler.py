import pytest
import torch

from engines.rejection_sampler import rejection_sample


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def onehot(i, v=4):
    p = torch.zeros(v)
    p[i] = 1
    return p


def test_all_accepted_then_bonus_from_last_target_row():
    drafts = torch.tensor([2, 1])
    target = torch.stack([onehot(2), onehot(1), onehot(3)])  # rows 0,1 agree with drafts; row 2 = bonus
    n, out = rejection_sample(drafts, None, target, gen())
    assert n == 2 and out == [2, 1, 3]


def test_first_draft_with_zero_target_prob_is_rejected_and_recovered():
    drafts = torch.tensor([0, 1])
    target = torch.stack([
        torch.tensor([0.0, 0.5, 0.5, 0.0]),  # p(0) = 0: must reject draft 0
        onehot(1),
        onehot(3),
    ])
    for seed in range(20):
        n, out = rejection_sample(drafts, None, target, gen(seed))
        assert n == 0 and len(out) == 1 and out[0] in (1, 2)  # recovered from p, never token 0


def test_rejection_in_the_middle_stops_the_round():
    drafts = torch.tensor([1, 2, 3])
    target = torch.stack([onehot(1), onehot(0), onehot(3), onehot(3)])  # accept 1, reject 2
    n, out = rejection_sample(drafts, None, target, gen())
    assert n == 1 and out == [1, 0]  # residual of one-hot(0) minus one-hot(2) is one-hot(0)


def test_draft_equal_to_target_is_always_accepted():
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4]] * 3)
    drafts = torch.tensor([0, 3])
    for seed in range(50):
        n, out = rejection_sample(drafts, p[:2], p, gen(seed))
        assert n == 2 and out[:2] == [0, 3]


def test_zero_drafts_is_one_plain_sample():
    target = onehot(2)[None]
    assert rejection_sample(torch.empty(0, dtype=torch.long), None, target, gen()) == (0, [2])


def test_acceptance_probability_is_p_over_q_and_recovery_is_the_residual():
    # p(x=0) = 0.3, q(x=0) = 0.6 -> accept with probability 0.5;
    # residual max(0, p - q) = [0, 0.3, 0.1, 0] / 0.4 -> token 1 w.p. 0.75, token 2 w.p. 0.25.
    p = torch.tensor([[0.3, 0.4, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.6, 0.1, 0.1, 0.2]])
    g = gen(1)
    trials, accepted, recovered = 20000, 0, torch.zeros(4)
    for _ in range(trials):
        n, out = rejection_sample(torch.tensor([0]), q, p, g)
        if n == 1:
            accepted += 1
        else:
            recovered[out[0]] += 1
    assert accepted / trials == pytest.approx(0.5, abs=0.015)
    frac = recovered / recovered.sum()
    assert frac[0] == 0 and frac[3] == 0
    assert float(frac[1]) == pytest.approx(0.75, abs=0.02)


def test_output_distribution_equals_target_for_any_draft():
    # The emitted first token must follow p whatever q proposed.
    p = torch.tensor([0.5, 0.2, 0.2, 0.1])
    q = torch.tensor([0.1, 0.1, 0.2, 0.6])
    g = gen(2)
    counts = torch.zeros(4)
    trials = 20000
    for _ in range(trials):
        x = torch.multinomial(q, 1, generator=g)
        _, out = rejection_sample(x, q[None], torch.stack([p, p]), g)
        counts[out[0]] += 1
    tv = 0.5 * (counts / trials - p).abs().sum()
    assert tv < 0.015


def test_row_count_is_checked():
    with pytest.raises(ValueError):
        rejection_sample(torch.tensor([1]), None, onehot(1)[None], gen())
