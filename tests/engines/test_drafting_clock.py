"""A model draft's drafting price (engines/proposers/base.py: DraftingClock): each
row's share of the forwards that draft, a long catch-up left out."""

from __future__ import annotations

import time

import pytest
import torch

from engines.api import SamplingParams
from engines.proposers import EagleProposer
from engines.proposers.base import DraftingClock
from engines.proposers.model_draft import ModelDraftProposer
from engines.scheduler import Scheduler
from tests.engines.test_eagle import eagle_for
from tests.helpers import lean_from_hf, tiny_hf_model

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def test_rows_share_a_lap_by_positions_and_a_catch_up_is_left_out():
    clock = DraftingClock()
    time.sleep(0.02)
    clock.lap({0: 1, 1: 3, 2: DraftingClock.CATCH_UP + 1}, first=True)
    s0, s1 = clock.cost(0)[0], clock.cost(1)[0]
    assert s1 == pytest.approx(3 * s0) and s0 > 0.002  # by positions fed (9 in all: 0.02 s / 9 each)
    assert clock.cost(2) == (0.0, 0)  # reading the prompt: neither its seconds nor its token
    time.sleep(0.02)
    clock.lap({0: 1, 2: 1})  # a lap after the first prices every row fed
    assert clock.cost(0)[1] == 2 and clock.cost(2)[1] == 1 and clock.cost(2)[0] > 0.009
    before = {r: clock.cost(r)[0] for r in (0, 1, 2)}
    time.sleep(0.02)
    clock.stop()  # the last tokens' work, shared by every priced row
    assert all(clock.cost(r)[0] > before[r] + 0.006 for r in (0, 1, 2))
    assert clock.cost(3) == (0.0, 0)


def states(draft, n: int) -> torch.Tensor:
    return torch.randn(n, draft.E * len(draft.feature_layers))


def test_an_eagle_draft_prices_its_drafting_forwards_not_its_prompt():
    target = lean_from_hf(tiny_hf_model(seed=0, scale=4.0))
    draft = eagle_for(target, torch.arange(2, 30))
    p = EagleProposer(draft, 64)
    prompt = list(range(2, 14))  # 12 positions: a catch-up
    p.observe_states(states(draft, len(prompt)))
    first = p.propose(prompt + [5], 3, GREEDY, torch.Generator())
    n = first.token_ids.numel()
    assert first.cost[1] == n - 1  # the prompt's lap and its token are not priced
    ctx = prompt + [5] + first.token_ids.tolist()[:1] + [7]  # one accepted, a bonus token
    p.observe_states(states(draft, 2))
    second = p.propose(ctx, 3, GREEDY, torch.Generator())
    assert second.cost[1] == second.token_ids.numel() and second.cost[0] > 0  # two positions read: drafting
    assert second.truncate(1).cost == second.cost  # what it took, whatever the budget verifies


def test_a_model_draft_prices_its_drafting_forwards_not_its_catch_up():
    draft = lean_from_hf(tiny_hf_model(seed=1, scale=4.0))
    p = ModelDraftProposer(draft, 64)
    ctx = list(range(2, 14))
    got = p.propose(ctx, 3, GREEDY, torch.Generator())
    assert got.cost[1] == got.token_ids.numel() - 1
    got = p.propose(ctx + got.token_ids.tolist()[:2] + [9], 3, GREEDY, torch.Generator())
    assert got.cost[1] == got.token_ids.numel()  # two positions caught up: priced


def test_the_scheduler_prices_drafting_from_the_clocks_where_proposals_keep_them():
    from engines.proposers.base import Proposal
    from engines.running import Running

    class Row:  # what _time_drafting reads of a Running
        priced, draft = "eagle", "eagle"
        part = Running.part

    sched = Scheduler.__new__(Scheduler)
    sched.drafting_s = {}
    clocked = Proposal(torch.tensor([1, 2]), None, cost=(0.002, 2))
    sched._time_drafting(Row(), 0.050, [clocked])  # 50 ms for the call, 1 ms per drafted token by its clock
    assert sched.drafting_s["eagle"] == pytest.approx(0.001)
    sched.drafting_s = {}
    sched._time_drafting(Row(), 0.050, [Proposal(torch.tensor([1, 2]), None)])  # no clock: the call
    assert sched.drafting_s["eagle"] == pytest.approx(0.025)
