"""The decode rules (engines/decode.py) as the engine applies them to one
sequence: speculative output against plain output on tiny float64 models."""

from dataclasses import replace

import pytest
import torch

from engines.api import SamplingParams
from engines.decode import draft_budget, settle
from engines.llama import LlamaModel
from engines.proposers import ModelDraftProposer, NgramProposer
from tests.helpers import (
    WORDS,
    assert_follows,
    engine_over,
    exact_joint_of_first_tokens,
    lean_from_hf,
    run_together,
    tiny_hf_model,
    token_request,
)


def run(target, prompt, sampling, proposer=None, gamma=0, seed=0, words=WORDS, fixed=False):
    """One sequence through the engine; returns (token ids, stats)."""
    drafts = {"d": lambda cap: proposer} if proposer is not None else {}
    arm = f"d:{gamma}" if proposer is not None else "plain"
    request = replace(token_request(0, prompt, arm, **{**sampling.__dict__, "seed": seed}), fixed_gamma=fixed)
    res = run_together(engine_over(target, words, **drafts), [request])[0]
    return list(res.token_ids), res.stats


@pytest.fixture(scope="module")
def target():
    # Sharpened so that greedy text repeats itself (n-gram drafts then get accepted).
    return lean_from_hf(tiny_hf_model(seed=0, scale=4.0))


@pytest.fixture(scope="module")
def noisy_copy():
    """A separate draft model: the target's weights plus noise, same vocabulary."""
    hf = tiny_hf_model(seed=0, scale=4.0)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return lean_from_hf(hf)


def drafts(target, noisy_copy):
    return {
        "ngram": lambda cap: NgramProposer(1, 3),
        "layers": lambda cap: ModelDraftProposer(LlamaModel(target.cfg, target.weights, [0, 1]), cap),
        "model": lambda cap: ModelDraftProposer(noisy_copy, cap),
    }


PROMPTS = [[5, 6, 7, 5, 6], [9, 3, 12, 30, 2, 2, 8], [20]]


@pytest.mark.parametrize("draft", ["ngram", "layers", "model"])
def test_greedy_speculative_output_is_token_identical_to_plain(target, noisy_copy, draft):
    sp = SamplingParams(max_tokens=24, temperature=0)
    accepted = 0
    for prompt in PROMPTS:
        plain, _ = run(target, prompt, sp)
        for gamma in (1, 2, 3, 5, 8):
            out, stats = run(target, prompt, sp, drafts(target, noisy_copy)[draft](64), gamma)
            assert out == plain, f"{draft} γ={gamma} diverged on prompt {prompt}"
            accepted += stats.accepted
            assert all(d <= gamma for d in stats.drafted_per_round)
    assert accepted > 0, "no draft was ever accepted: the test would prove nothing"


def test_max_tokens_and_eos_are_respected_mid_round(target):
    sp = SamplingParams(max_tokens=5, temperature=0)
    out, stats = run(target, PROMPTS[0], sp, NgramProposer(1, 3), gamma=8)
    assert len(out) == 5
    assert all(d <= 4 for d in stats.drafted_per_round)  # never drafts past the budget


def test_budget_and_settle_rules():
    cache = type("Cache", (), {"capacity": 20, "lengths": [15]})()
    assert draft_budget(8, produced=0, max_tokens=100, cache=cache) == 4  # KV room: 20 - 15 - 1
    assert draft_budget(8, produced=7, max_tokens=10, cache=cache) == 2  # a round emits accepted + 1
    assert draft_budget(8, produced=9, max_tokens=10, cache=cache) == 0
    sp = SamplingParams(max_tokens=6)
    assert settle([4, 1, 5], produced=0, sampling=sp, eos_ids=frozenset({1})) == ([4, 1], True)
    assert settle([4, 5, 6], produced=4, sampling=sp, eos_ids=frozenset({1})) == ([4, 5], False)
    assert settle([4, 1], produced=0, sampling=SamplingParams(ignore_eos=True), eos_ids=frozenset({1})) == \
        ([4, 1], False)


def test_same_seed_same_output_different_seed_differs(target, noisy_copy):
    sp = SamplingParams(max_tokens=16, temperature=1.0)
    make = drafts(target, noisy_copy)["model"]
    # fixed γ: adaptive speculation sizes drafts from measured timings, and how many
    # drafts a step verifies decides how the seeded random stream is consumed
    a, _ = run(target, PROMPTS[1], sp, make(64), 4, seed=7, fixed=True)
    b, _ = run(target, PROMPTS[1], sp, make(64), 4, seed=7, fixed=True)
    outs = {tuple(run(target, PROMPTS[1], sp, make(64), 4, seed=s, fixed=True)[0]) for s in range(5)}
    assert a == b
    assert len(outs) > 1


@pytest.mark.parametrize("draft", ["ngram", "model", "layers"])
@pytest.mark.parametrize("sp", [
    SamplingParams(max_tokens=4, temperature=0.7, top_p=0.9, ignore_eos=True),
    SamplingParams(max_tokens=4, temperature=1.0, top_p=0.8, top_k=6, ignore_eos=True),
])
def test_speculative_sampling_follows_the_target_distribution(draft, sp):
    # A flatter target (scale 1.5) and a small vocabulary make every token likely.
    words = WORDS[:10]
    target = lean_from_hf(tiny_hf_model(vocab=10, seed=3, scale=1.5, layers=3))
    other = lean_from_hf(tiny_hf_model(vocab=10, seed=4, scale=1.5, layers=2))
    make = {
        "ngram": lambda cap: NgramProposer(1, 2),
        "model": lambda cap: ModelDraftProposer(other, cap),
        "layers": lambda cap: ModelDraftProposer(LlamaModel(target.cfg, target.weights, [0]), cap),
    }[draft]
    prompt = [2, 3, 4, 2, 3, 4, 2]
    exact = exact_joint_of_first_tokens(target, prompt, sp, 4)
    trials = 2000
    # a mixed batch: every other request verifies its whole draft (fixed γ), the rest
    # what the step budget admits (which, on a model this small, is not much)
    requests = [token_request(s, prompt, "d:2", **{**sp.__dict__, "seed": s}) for s in range(trials)]
    requests = [replace(r, fixed_gamma=s % 2 == 0) for s, r in enumerate(requests)]
    results = run_together(engine_over(target, words, d=make), requests)
    counts: dict = {}
    for r in results:
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
    # After the first (prefill) token a round drafts up to 2 tokens: the speculative path
    # must have carried a good share of the output. Counted on the fixed-γ rows, whose
    # verification is the same however fast the machine (the others' follows the step timings)
    assert sum(sum(r.stats.verified_per_round) for r in results[::2]) > trials // 5
    assert_follows(exact, counts, trials, draft)
