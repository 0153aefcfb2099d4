"""Coupled sampling (EngineConfig.coupled_sampling): every sampled token is the
target's own pick at its position, so a seeded request writes plain's text under
every draft, and the picks follow the target's distribution exactly."""

import dataclasses

import numpy as np
import pytest
import torch

from engines.api import SamplingParams
from engines.llama import LlamaModel
from engines.proposers import ModelDraftProposer, NgramProposer
from engines.proposers.eagle import EagleProposer
from engines.proposers.hybrid import HybridProposer
from engines.sampling import HEAD_SHARE, Draws
from tests.engines.test_eagle import eagle_for
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

WORDS10 = WORDS[:10]
PROMPTS = [[2, 3, 4, 2, 3, 4, 2], [5, 7, 8, 5, 7], [4, 4, 9, 2, 3, 9, 4, 4]]


def _target() -> LlamaModel:
    return lean_from_hf(tiny_hf_model(vocab=10, seed=3, scale=1.5, layers=3))


def _drafts(target: LlamaModel) -> dict:
    eagle = eagle_for(target, torch.tensor([2, 3, 4, 5, 7, 8]))  # q is zero for 0, 1, 6 and 9
    half = LlamaModel(target.cfg, target.weights, [0, 1])
    key = object()  # the hybrid's rows draft together
    return {"ngram": lambda cap: NgramProposer(1, 3), "eagle": lambda cap: EagleProposer(eagle, cap),
            "half": lambda cap: ModelDraftProposer(half, cap),
            "hybrid": lambda cap: HybridProposer(NgramProposer(2, 3), EagleProposer(eagle, cap), ("ngram", "eagle"),
                                                 key)}


def _served(target, arm: str, sp: SamplingParams, fixed: bool = False, coupled: bool = True) -> list:
    engine = engine_over(target, WORDS10, max_context=96, gamma_max=6, coupled_sampling=coupled, **_drafts(target))
    return run_together(engine, [dataclasses.replace(token_request(i, p, arm, **sp.__dict__), fixed_gamma=fixed)
                                 for i, p in enumerate(PROMPTS)])


@pytest.mark.parametrize("sp", [
    SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True, seed=5),
    SamplingParams(max_tokens=24, temperature=0.7, top_p=0.9, ignore_eos=True, seed=6),
    SamplingParams(max_tokens=24, temperature=1.0, top_k=6, ignore_eos=True, seed=7),
])
def test_a_seeded_sampled_request_writes_plains_text_under_every_draft(sp):
    target = _target()
    want = [r.token_ids for r in _served(target, "plain", sp)]
    kept = 0
    for arm, fixed in (("eagle:3", True), ("eagle:6", False), ("half:2", True), ("half:5", False),
                       ("ngram:4", False), ("hybrid:4", True)):
        got = _served(target, arm, sp, fixed)
        assert [r.token_ids for r in got] == want, (arm, fixed)
        kept += sum(r.stats.accepted for r in got)
    assert kept > 0  # drafts were verified and kept
    # without coupling a model draft writes a text of its own (here: at least one of three)
    assert [r.token_ids for r in _served(target, "half:2", sp, True, coupled=False)] != want


@pytest.mark.parametrize("sp", [
    SamplingParams(max_tokens=4, temperature=0.7, top_p=0.9, ignore_eos=True),
    SamplingParams(max_tokens=4, temperature=1.0, top_k=6, ignore_eos=True),
])
def test_coupled_sampling_with_a_model_draft_follows_the_target(sp):
    """2000 seeds at fixed γ 2 with the reduced-vocabulary EAGLE draft: the first four
    tokens follow the target's exact joint, and the draft's guesses carried a good share."""
    target, prompt, trials = _target(), PROMPTS[0], 2000
    exact = exact_joint_of_first_tokens(target, prompt, sp, 4)
    engine = engine_over(target, WORDS10, max_context=96, gamma_max=6, coupled_sampling=True,
                         eagle=_drafts(target)["eagle"])
    requests = [dataclasses.replace(token_request(s, prompt, "eagle:2", **{**sp.__dict__, "seed": s}), fixed_gamma=True)
                for s in range(trials)]
    results = run_together(engine, requests)
    counts: dict = {}
    for r in results:
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
    assert sum(r.stats.accepted for r in results) > trials // 4
    assert_follows(exact, counts, trials, "eagle, coupled")


def test_a_pick_draws_exactly_from_its_distribution_tail_included():
    # a head, tokens below HEAD_SHARE of the likeliest (the tail, one item), and a zero
    probs = torch.tensor([0.6, 0.25, 0.1, 0.04, 0.6 * HEAD_SHARE / 2, 0.6 * HEAD_SHARE / 3, 0.0])
    probs = probs / probs.sum()
    trials, draws = 200_000, Draws(11, coupled=True)
    counts = np.bincount([draws.pick(probs, t) for t in range(trials)], minlength=len(probs))
    expected = probs.double().numpy() * trials
    assert counts[6] == 0 and counts[4] > 0 and counts[5] > 0  # the tail's tokens are drawn, the zero never
    chi2 = float((((counts - expected) ** 2)[:6] / expected[:6]).sum())
    assert chi2 < 20.5  # the 0.999 quantile of chi-square with 5 degrees of freedom


def test_a_tokens_noise_follows_its_id_not_its_place():
    """A draft's q over its own vocabulary (ids) picks the token the same noise gives it in
    the target's order: where q is the target's distribution, its pick is the target's."""
    rng = np.random.default_rng(0)
    for t in range(200):
        probs = torch.tensor(rng.dirichlet(np.ones(12)), dtype=torch.float32)
        probs = probs.clamp_min(float(probs.max()) * HEAD_SHARE)  # no tail: every token gets noise
        probs = probs / probs.sum()
        perm = torch.tensor(rng.permutation(12))
        draws = Draws(int(rng.integers(1 << 40)), coupled=True)
        assert int(perm[draws.pick(probs[perm], t, perm)]) == draws.pick(probs, t)
    a, b = Draws(3, coupled=True), Draws(4, coupled=True)
    probs = torch.full((1000,), 1e-3)
    assert [a.pick(probs, t) for t in range(20)] == [a.pick(probs, t) for t in range(20)]  # fixed by seed
    assert [a.pick(probs, t) for t in range(20)] != [b.pick(probs, t) for t in range(20)]
