import pytest
import torch

from engines.rejection_sampler import rejection_sample
from engines.sampling import Draws, sample_index


class gen:
    """Uniforms for rejection_sample from a seeded generator, fresh ones every round."""

    def __init__(self, seed=0):
        self.g = torch.Generator().manual_seed(seed)

    def draws(self, k):
        u = torch.rand(2 * k + 1, generator=self.g, dtype=torch.float64).tolist()
        return u[:k + 1], u[k + 1:]


def sample(drafts, q, p, g):
    return rejection_sample(drafts, q, p, *g.draws(drafts.shape[0]))


def onehot(i, v=4):
    p = torch.zeros(v)
    p[i] = 1
    return p


def test_all_accepted_then_bonus_from_last_target_row():
    drafts = torch.tensor([2, 1])
    target = torch.stack([onehot(2), onehot(1), onehot(3)])  # rows 0,1 agree with drafts; row 2 = bonus
    n, out = sample(drafts, None, target, gen())
    assert n == 2 and out == [2, 1, 3]


def test_first_draft_with_zero_target_prob_is_rejected_and_recovered():
    drafts = torch.tensor([0, 1])
    target = torch.stack([
        torch.tensor([0.0, 0.5, 0.5, 0.0]),  # p(0) = 0: must reject draft 0
        onehot(1),
        onehot(3),
    ])
    for seed in range(20):
        n, out = sample(drafts, None, target, gen(seed))
        assert n == 0 and len(out) == 1 and out[0] in (1, 2)  # recovered from p, never token 0


def test_rejection_in_the_middle_stops_the_round():
    drafts = torch.tensor([1, 2, 3])
    target = torch.stack([onehot(1), onehot(0), onehot(3), onehot(3)])  # accept 1, reject 2
    n, out = sample(drafts, None, target, gen())
    assert n == 1 and out == [1, 0]  # residual of one-hot(0) minus one-hot(2) is one-hot(0)


def test_draft_equal_to_target_is_always_accepted():
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4]] * 3)
    drafts = torch.tensor([0, 3])
    for seed in range(50):
        n, out = sample(drafts, p[:2], p, gen(seed))
        assert n == 2 and out[:2] == [0, 3]


def test_zero_drafts_is_one_plain_sample():
    target = onehot(2)[None]
    assert sample(torch.empty(0, dtype=torch.long), None, target, gen()) == (0, [2])


def test_acceptance_probability_is_p_over_q_and_recovery_is_the_residual():
    # p(x=0) = 0.3, q(x=0) = 0.6 -> accept with probability 0.5;
    # residual max(0, p - q) = [0, 0.3, 0.1, 0] / 0.4 -> token 1 w.p. 0.75, token 2 w.p. 0.25.
    p = torch.tensor([[0.3, 0.4, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.6, 0.1, 0.1, 0.2]])
    g = gen(1)
    trials, accepted, recovered = 20000, 0, torch.zeros(4)
    for _ in range(trials):
        n, out = sample(torch.tensor([0]), q, p, g)
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
        x = torch.multinomial(q, 1, generator=g.g)
        _, out = sample(x, q[None], torch.stack([p, p]), g)
        counts[out[0]] += 1
    tv = 0.5 * (counts / trials - p).abs().sum()
    assert tv < 0.015


def test_row_and_uniform_counts_are_checked():
    with pytest.raises(ValueError):
        sample(torch.tensor([1]), None, onehot(1)[None], gen())
    with pytest.raises(ValueError):
        rejection_sample(torch.tensor([1]), None, torch.stack([onehot(1), onehot(2)]), [0.5], [0.5])


def test_a_one_hot_draft_is_kept_with_probability_p_and_the_first_token_follows_p():
    p = torch.tensor([0.5, 0.2, 0.2, 0.1])
    g = gen(3)
    counts, kept, trials = torch.zeros(4), 0, 20000
    for _ in range(trials):
        n, out = sample(torch.tensor([1]), None, torch.stack([p, p]), g)
        kept += n
        counts[out[0]] += 1
    assert kept / trials == pytest.approx(0.2, abs=0.012)
    assert 0.5 * (counts / trials - p).abs().sum() < 0.015


def test_a_one_hot_draft_emits_what_plain_sampling_draws_with_the_same_uniforms():
    # the target's own draw at each position, in order: plain sampling's tokens, whatever was drafted
    g = torch.Generator().manual_seed(4)
    for trial in range(300):
        k = trial % 5
        p = torch.rand(k + 1, 6, generator=g) ** 3
        p[:, trial % 6] = 0.0  # a token never drawn: a draft of it is always rejected
        u = torch.rand(k + 1, generator=g, dtype=torch.float64).tolist()
        plain = [sample_index(p[i], u[i]) for i in range(k + 1)]
        drafts = torch.tensor(plain[:k])
        if k and trial % 2:
            drafts[trial % k] = trial % 6  # a wrong draft ends the round at that position
        n, out = rejection_sample(drafts, None, p, u, [0.0] * k)
        assert out == plain[:n + 1]
        assert n == k or (n == trial % k and int(drafts[n]) != plain[n])


def test_draws_are_fixed_by_seed_and_position_alone():
    a, b = Draws(7), Draws(7)
    us = [a.sample(t) for t in range(2000)]
    assert [b.sample(t) for t in reversed(range(2000))] == us[::-1]  # asked in any order: the same
    assert all(0.0 <= u < 1.0 for u in us)
    assert abs(sum(us) / len(us) - 0.5) < 0.02 and len(set(us)) == len(us)
    assert [a.accept(t) for t in range(50)] != us[:50] and [Draws(8).sample(t) for t in range(50)] != us[:50]
    d1, d2 = torch.rand(4, generator=Draws(7).drafting), torch.rand(4, generator=Draws(7).drafting)
    assert torch.equal(d1, d2) and not torch.equal(d1, torch.rand(4, generator=Draws(9).drafting))
