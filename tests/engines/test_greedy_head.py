"""Greedy rows' head in two stages: the argmax of exact dot products, whatever
the row is batched with, and every arm's greedy output unchanged by it."""

import dataclasses

import torch

from engines.greedy_head import GreedyHead, calibrate, choose_greedy_head, outlier_channels
from engines.llama import LlamaModel
from engines.loading import LoadedModel
from engines.proposers import ModelDraftProposer, NgramProposer
from tests.engines.test_scheduler import CONFIG, PROMPTS
from tests.helpers import WORDS, lean_from_hf, run_together, tiny_hf_model, tiny_tokenizer, token_request


def exact(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Every token's logit as the head computes a candidate's: its row times x, summed. [N, V]"""
    return (w[None] * x[:, None]).sum(-1)


def head_and_states(seed: int, V: int = 3000, E: int = 64, N: int = 9):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, E, generator=g) * 0.05
    w[10] = w[3] + 1e-7 * torch.randn(E, generator=g)  # a near-tie, within float32 rounding of row 3's logit
    x = torch.randn(N, E, generator=g)
    x[:, [5, 40, 41]] *= 30  # outlier channels, as final hidden states have
    return GreedyHead(w, outlier_channels(x, 2)), w, x  # two of the three kept in float32: the third is screened


def test_the_token_is_the_argmax_of_the_exact_dot_products_and_candidates_carry_them():
    for seed in range(20):
        head, w, x = head_and_states(seed)
        out, ref = head(x), exact(w, x)
        assert torch.equal(out.argmax(1), ref.argmax(1)), seed
        kept = out.isfinite()
        assert torch.equal(out[kept], ref[kept])
        assert 0 < kept.sum() < out.numel() / 10  # the screen cut most of the vocabulary


def test_exact_ties_go_to_the_first_token_as_the_full_head_gives_them():
    head, w, x = head_and_states(0)
    w[7] = w[3] = 3 * x[0] / x[0].norm()  # rows 3 and 7 tie, and win, for row 0
    head = GreedyHead(w, outlier_channels(x, 2))
    assert int(head(x)[0].argmax()) == 3 == int((x @ w.T)[0].argmax())


def test_a_rows_token_does_not_depend_on_its_batch():
    head, w, x = head_and_states(1)
    together = head(x)
    for i in range(len(x)):
        alone = head(x[i:i + 1])[0]
        assert int(alone.argmax()) == int(together[i].argmax())
        both = alone.isfinite() & together[i].isfinite()
        assert torch.equal(alone[both], together[i][both])


def test_rows_that_are_not_finite_get_the_full_head():
    head, w, x = head_and_states(2)
    x[4, 0] = float("nan")
    out = head(x)
    assert out[4].isnan().all()
    torch.testing.assert_close(out, x @ w.T, rtol=0, atol=0, equal_nan=True)


def f32_engine(head: bool):
    """The scheduler tests' engine over a float32 tiny target (the two stages are float32's)."""
    from engines.builtin import BuiltinEngine

    hf = tiny_hf_model(vocab=len(WORDS), scale=4.0)
    target = LoadedModel(lean_from_hf(hf, dtype=torch.float32), tiny_tokenizer(WORDS), hf.config, "tiny")
    sub = LlamaModel(target.model.cfg, target.model.weights, [0, 1])
    drafts = {"ngram": lambda cap: NgramProposer(1, 3), "half": lambda cap: ModelDraftProposer(sub, cap)}
    eng = BuiltinEngine(target, drafts, CONFIG, start_worker=False)
    if head:
        eng.model.greedy_head = calibrate(eng.model, PROMPTS[3])[0]
    return eng


def test_every_arms_greedy_output_is_the_same_with_the_two_stage_head_and_sampled_rows_untouched():
    arms = ["ngram:4", "half:2", "plain", "half:6", "ngram:1", "plain"]
    reqs = [dataclasses.replace(token_request(i, p, a), fixed_gamma=True)
            for i, (p, a) in enumerate(zip(PROMPTS, arms))]
    reqs.append(token_request(9, PROMPTS[6], "half:3", temperature=0.9, seed=7))  # a sampled row beside them
    eng = f32_engine(True)
    together = run_together(eng, reqs)
    assert eng.model.greedy_head.screens > 0
    assert [r.token_ids for r in together] == [r.token_ids for r in run_together(f32_engine(False), reqs)]
    for r in reqs[:3]:  # alone: one row, verifying 1-6 drafts a round
        assert run_together(f32_engine(True), [r])[0].token_ids == run_together(f32_engine(False), [r])[0].token_ids
    assert sum(r.stats.accepted for r in together) > 0


def test_the_start_up_choice():
    eng = f32_engine(False)
    ids = PROMPTS[3]
    assert choose_greedy_head(eng.model, False, ids) is None
    assert isinstance(choose_greedy_head(eng.model, True, ids), GreedyHead)
    timed = choose_greedy_head(eng.model, "auto", ids)  # kept or not by what it measured
    assert timed is None or isinstance(timed, GreedyHead)
    wide = lean_from_hf(tiny_hf_model(vocab=len(WORDS)))  # float64: the int8 screen is float32's
    assert choose_greedy_head(wide, True, ids) is None
