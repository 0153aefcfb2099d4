import pytest
import torch

from engines.api import SamplingParams
from engines.errors import InvalidRequest
from engines.sampling import argmax, logits_to_probs, sample_index, uniform, validate_sampling


def test_greedy_is_one_hot_argmax():
    probs = logits_to_probs(torch.tensor([[0.1, 3.0, 2.0]]), SamplingParams(temperature=0))
    assert probs.tolist() == [[0.0, 1.0, 0.0]]


def test_top_k_keeps_k_tokens():
    probs = logits_to_probs(torch.tensor([[1.0, 4.0, 3.0, 2.0]]), SamplingParams(temperature=1, top_k=2))
    assert (probs[0] > 0).tolist() == [False, True, True, False]


def test_top_p_keeps_smallest_prefix_covering_p():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    probs = logits_to_probs(logits, SamplingParams(temperature=1, top_p=0.7))
    assert (probs[0] > 0).tolist() == [True, True, False, False]
    assert probs[0, :2].tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8])
    # the top token always survives, even with a tiny top_p
    tiny = logits_to_probs(logits, SamplingParams(temperature=1, top_p=0.01))
    assert tiny[0].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 2.0]])
    cold = logits_to_probs(logits, SamplingParams(temperature=0.5))[0, 1]
    hot = logits_to_probs(logits, SamplingParams(temperature=2.0))[0, 1]
    assert cold > hot > 0.5


@pytest.mark.parametrize("field,params", [
    ("max_tokens", SamplingParams(max_tokens=0)),
    ("max_tokens", SamplingParams(max_tokens=-3)),
    ("max_tokens", SamplingParams(max_tokens=10_000)),
    ("temperature", SamplingParams(temperature=-0.1)),
    ("temperature", SamplingParams(temperature=float("nan"))),
    ("top_p", SamplingParams(top_p=0.0)),
    ("top_p", SamplingParams(top_p=1.5)),
    ("top_k", SamplingParams(top_k=-1)),
    ("seed", SamplingParams(seed=-1)),
    ("stop", SamplingParams(stop=("",))),
])
def test_bad_fields_are_named(field, params):
    with pytest.raises(InvalidRequest) as e:
        validate_sampling(params, max_new_tokens_allowed=1000)
    assert e.value.field == field


def test_argmax_is_torchs_including_ties():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 5, (64, 300), generator=g).float()  # many ties per row
    assert torch.equal(argmax(x), x.argmax(dim=-1))
    assert int(argmax(x[3])) == int(x[3].argmax())


def test_a_draw_follows_the_weights_and_never_lands_on_zero():
    weights = torch.tensor([2.0, 0.0, 1.0, 1.0, 0.0, 0.0])  # not normalised; zeros inside and at the end
    g = torch.Generator().manual_seed(0)
    trials = 20000
    counts = torch.bincount(torch.tensor([sample_index(weights, uniform(g)) for _ in range(trials)]), minlength=6)
    assert counts[1] == counts[4] == counts[5] == 0
    assert (counts / trials).tolist() == pytest.approx([0.5, 0.0, 0.25, 0.25, 0.0, 0.0], abs=0.015)
    assert sample_index(torch.tensor([0.0, 0.0, 1.0]), uniform(g)) == 2  # one-hot: its index, whatever the draw
