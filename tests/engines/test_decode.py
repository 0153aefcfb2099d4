"""Speculative decoding against plain decoding on tiny float64 models."""


import pytest
import torch
from scipy.stats import chisquare

from engines.api import GenerationStats, SamplingParams
from engines.decode import generate
from engines.llama import LlamaModel
from engines.proposers import ModelDraftProposer, NgramProposer
from engines.sampling import logits_to_probs
from tests.engines.tiny import lean_from_hf, tiny_hf_model

EOS = frozenset({1})


def run(target, prompt, sampling, proposer=None, gamma=0, seed=0):
    stats = GenerationStats()
    cache = target.new_cache(len(prompt) + sampling.max_tokens + gamma + 1)
    g = torch.Generator().manual_seed(seed)
    out = [t for step in generate(target, cache, prompt, sampling, g, stats, EOS, proposer, gamma) for t in step]
    return out, stats


@pytest.fixture(scope="module")
def target():
    # Sharpened so that greedy text repeats itself (n-gram drafts then get accepted).
    return lean_from_hf(tiny_hf_model(seed=0, scale=4.0))


@pytest.fixture(scope="module")
def noisy_copy(target):
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
        for gamma in range(1, 9):
            out, stats = run(target, prompt, sp, drafts(target, noisy_copy)[draft](64), gamma)
            assert out == plain, f"{draft} γ={gamma} diverged on prompt {prompt}"
            accepted += stats.accepted
            assert all(d <= gamma for d in stats.drafted_per_round)
    assert accepted > 0, "no draft was ever accepted: the test would prove nothing"


def test_max_tokens_and_eos_are_respected_mid_round(target, noisy_copy):
    sp = SamplingParams(max_tokens=5, temperature=0)
    out, stats = run(target, PROMPTS[0], sp, NgramProposer(1, 3), gamma=8)
    assert len(out) == 5
    assert all(d <= 4 for d in stats.drafted_per_round)  # never drafts past the budget


def test_same_seed_same_output_different_seed_differs(target, noisy_copy):
    sp = SamplingParams(max_tokens=16, temperature=1.0)
    make = drafts(target, noisy_copy)["model"]
    a, _ = run(target, PROMPTS[1], sp, make(64), 4, seed=7)
    b, _ = run(target, PROMPTS[1], sp, make(64), 4, seed=7)
    outs = {tuple(run(target, PROMPTS[1], sp, make(64), 4, seed=s)[0]) for s in range(5)}
    assert a == b
    assert len(outs) > 1


def exact_joint_of_first_tokens(target, prompt, sp, n):
    """P(t_1..t_n) under plain sampling, by enumerating every prefix."""
    dist = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for prefix, pr in dist.items():
            logits = target.forward(torch.tensor(prompt + list(prefix)), target.new_cache(64), all_logits=False)
            probs = logits_to_probs(logits, sp)[0]
            for tok in probs.nonzero().flatten().tolist():
                nxt[prefix + (tok,)] = pr * float(probs[tok])
        dist = nxt
    return dist


@pytest.mark.parametrize("draft", ["ngram", "model", "layers"])
@pytest.mark.parametrize("sp", [
    SamplingParams(max_tokens=4, temperature=0.7, top_p=0.9, ignore_eos=True),
    SamplingParams(max_tokens=4, temperature=1.0, top_p=0.8, top_k=6, ignore_eos=True),
])
def test_speculative_sampling_follows_the_target_distribution(draft, sp):
    # A flatter target (scale 1) and a small vocabulary make every token likely.
    hf = tiny_hf_model(vocab=10, seed=3, scale=1.5, layers=3)
    target = lean_from_hf(hf)
    other = lean_from_hf(tiny_hf_model(vocab=10, seed=4, scale=1.5, layers=2))
    make = {
        "ngram": lambda: NgramProposer(1, 2),
        "model": lambda: ModelDraftProposer(other, 32),
        "layers": lambda: ModelDraftProposer(LlamaModel(target.cfg, target.weights, [0]), 32),
    }[draft]
    prompt = [2, 3, 4, 2, 3, 4, 2]
    exact = exact_joint_of_first_tokens(target, prompt, sp, 4)
    trials = 2000
    counts = dict.fromkeys(exact, 0)
    drafted = 0
    for seed in range(trials):
        out, stats = run(target, prompt, sp, make(), gamma=2, seed=seed)
        counts[tuple(out)] += 1  # KeyError = a sequence the target gives probability 0
        drafted += stats.drafted
    # After the first (prefill) token one round drafts up to 2 tokens: the
    # speculative path must have carried a good share of the output.
    assert drafted > trials // 4
    # Chi-square on the joint of each pair of consecutive speculative positions
    # (the full 4-token joint has too many cells for 2000 samples).
    for pos in [(1, 2), (2, 3)]:
        marg_exact, marg_obs = {}, {}
        for seq, pr in exact.items():
            key = tuple(seq[i] for i in pos)
            marg_exact[key] = marg_exact.get(key, 0.0) + pr
            marg_obs[key] = marg_obs.get(key, 0) + counts[seq]
        big = [k for k in marg_exact if marg_exact[k] * trials >= 5]
        small = [k for k in marg_exact if marg_exact[k] * trials < 5]
        obs = [marg_obs[k] for k in big] + [sum(marg_obs[k] for k in small)]
        exp = [marg_exact[k] * trials for k in big] + [sum(marg_exact[k] for k in small) * trials]
        if not small:
            obs, exp = obs[:-1], exp[:-1]
        assert len(obs) >= 5
        stat, pvalue = chisquare(obs, exp, sum_check=False)
        assert pvalue > 1e-3, f"{draft} positions {pos}: output does not follow the target (chi2={stat:.1f}, p={pvalue:.2g})"
