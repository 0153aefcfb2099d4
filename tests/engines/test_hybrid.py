"""Prompt lookup where it matches, the EAGLE head elsewhere: per round, lossless."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engines.api import SamplingParams
from engines.arms import DraftKind
from engines.config import EagleDraftConfig, EngineConfig, HybridDraftConfig, NgramDraftConfig
from engines.proposers import EagleProposer, HybridProposer, NgramProposer, Proposal
from engines.running import Running
from tests.engines.test_eagle import assert_greedy_is_plain, assert_sampling_follows, eagle_for
from tests.helpers import WORDS, lean_from_hf, tiny_hf_model


def hybrid(draft, min_match=2):
    key = object()
    return lambda cap: HybridProposer(NgramProposer(min_match, 3), EagleProposer(draft, cap), ("ngram", "eagle"),
                                      key)


def test_each_round_drafts_from_the_lookup_where_it_matches_and_from_the_model_elsewhere():
    target = lean_from_hf(tiny_hf_model(seed=0, scale=4.0))
    draft = eagle_for(target, torch.arange(2, 30))
    make = hybrid(draft)
    sp, gen = SamplingParams(max_tokens=8, temperature=0), torch.Generator()
    repeats, fresh = [5, 6, 7, 8, 9, 5, 6], [9, 3, 12, 30, 2]
    rows = [make(64), make(64)]
    for row, ctx in zip(rows, (repeats, fresh)):  # the model draft reads the prompt's states first
        row.observe_states(torch.randn(len(ctx) - 1, draft.E * len(draft.feature_layers)))
    got = HybridProposer.propose_batch([(rows[0], repeats, 4, sp, gen), (rows[1], fresh, 4, sp, gen)])
    assert got[0].source == "ngram" and got[0].token_ids.tolist() == [7, 8, 9, 5]  # what followed "5 6"
    assert got[1].source == "eagle" and 1 <= got[1].token_ids.numel() <= 4
    assert rows[0].model.pending and not rows[1].model.pending  # the states wait for its next model round
    one_token = [5, 6, 7, 8, 9, 5]  # "5" occurred before, but one token of match is below min_match
    assert HybridProposer.propose_batch([(make(64), one_token, 4, sp, gen)])[0].source == "eagle"


def test_greedy_output_with_the_hybrid_draft_is_plain_output():
    target = lean_from_hf(tiny_hf_model(seed=0, scale=4.0))
    draft = eagle_for(target, torch.arange(2, 30))
    assert_greedy_is_plain(target, "hybrid", hybrid(draft),
                           [[5, 6, 7, 5, 6], [9, 3, 12, 30, 2, 2, 8], [20], [33, 34, 33, 34, 33]], (1, 4))


@pytest.mark.parametrize("sp", [
    SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, ignore_eos=True),
    SamplingParams(max_tokens=4, temperature=1.0, top_k=6, ignore_eos=True),
])
def test_sampling_with_lookup_and_model_rounds_follows_the_target(sp):
    words = WORDS[:10]
    target = lean_from_hf(tiny_hf_model(vocab=10, seed=3, scale=1.5, layers=3))
    draft = eagle_for(target, torch.tensor([2, 3, 4, 5, 7, 8]))
    # the lookup matches after "... 4 2" and "2 3", not after "9"
    assert_sampling_follows(target, words, "hybrid", hybrid(draft), [2, 3, 4, 2, 3, 4, 2, 9], sp)


def test_a_hybrid_must_name_a_lookup_and_a_model_draft_of_the_engine():
    EngineConfig()  # the default names the shipped ones
    with pytest.raises(ValueError, match="lookup must name an ngram draft"):
        EngineConfig(drafts=[NgramDraftConfig(), EagleDraftConfig(), HybridDraftConfig(lookup="eagle")])
    with pytest.raises(ValueError, match="'nowhere'"):
        EngineConfig(drafts=[NgramDraftConfig(), HybridDraftConfig(model="nowhere")])


def test_the_menu_says_what_each_draft_is_whatever_its_name():
    """The policy starts a draft it has not seen from its kind's prior and draws a hybrid
    with its model draft: it learns both from the engine's menu, not from the names."""
    menu = EngineConfig(drafts=[NgramDraftConfig(name="lookup"), EagleDraftConfig(name="head"),
                                HybridDraftConfig(name="mix", lookup="lookup", model="head")]).arm_menu()
    assert [(d, menu.kind_of(d)) for d in menu.drafts] == [
        ("lookup", DraftKind("ngram")), ("head", DraftKind("eagle")), ("mix", DraftKind("hybrid", "head"))]
    assert DraftKind.guess("mix") == DraftKind("model")  # what the names alone would have said
    default = EngineConfig().arm_menu()
    assert all(default.kind_of(d) == DraftKind.guess(d) for d in default.drafts)  # the default's names say it


def test_without_the_model_a_round_still_looks_up():
    target = lean_from_hf(tiny_hf_model(seed=0, scale=4.0))
    draft = eagle_for(target, torch.arange(2, 30))
    sp, gen = SamplingParams(max_tokens=8, temperature=0), torch.Generator()
    rows = [hybrid(draft)(64), hybrid(draft)(64)]
    for row in rows:
        row.model_on = False  # the scheduler's judgement: the model's drafts would not pay at this load
        row.observe_states(torch.randn(4, draft.E * len(draft.feature_layers)))
    got = HybridProposer.propose_batch([(rows[0], [5, 6, 7, 5, 6], 4, sp, gen),
                                        (rows[1], [9, 3, 12, 30, 2], 4, sp, gen)])
    assert got[0].source == "ngram" and got[0].token_ids.tolist() == [7, 5, 6]
    assert got[1].token_ids.numel() == 0 and rows[1].model.pending  # the model did not run


def test_each_part_of_a_hybrid_row_keeps_its_own_bias_and_only_the_model_part_gates_drafting():
    row = Running(None, SamplingParams(max_tokens=8), 4, "hybrid", [1, 2], 2, None, None, None, None, None, 0.0, 8,
                  priced="eagle")
    lookup = Proposal(torch.tensor([7, 8]), None, torch.tensor([0.9, 0.9]), source="ngram")
    head = Proposal(torch.tensor([3]), None, torch.tensor([0.2]), source="eagle")
    row.bias_of(lookup).observe(torch.tensor([0.5, 0.5]), 2)  # a copy that held: the lookup's ratio rises
    held, untouched = row.bias_of(lookup), row.bias_of(head)
    assert held.ratio() > 1.0 and held.ratio(later=True) > 1.0  # the head's is untouched:
    assert untouched.ratio() == untouched.ratio(later=True) == 1.0
    assert row.bias_of(lookup) is row.bias_of(lookup)
    # the acceptance that decides whether the model runs hears the model's rounds and plain ones only
    assert row.gates(head) and row.gates(None) and not row.gates(lookup)
    alone = Running(None, SamplingParams(max_tokens=8), 4, "ngram", [1, 2], 2, None, None, None, None, None, 0.0, 8)
    assert alone.gates(dataclasses.replace(lookup, source=None))  # a one-part draft's rounds are all its own
