"""The verification budget: what it admits alone and in a full batch, how it
prices a lone row's forwards, per-request acceptance and the draft's
calibration; and that output stays exactly the target's when the budget
verifies fewer drafts."""

import pytest
import torch

from engines import budget
from engines.api import SamplingParams
from engines.builtin import BuiltinEngine
from engines.llama import LlamaModel
from engines.proposers import ModelDraftProposer, NgramProposer
from engines.stepcost import StepCost
from tests.helpers import (
    WORDS,
    assert_follows,
    engine_over,
    exact_joint_of_first_tokens,
    lean_from_hf,
    run_together,
    tiny_hf_model,
    tiny_loaded,
    token_request,
)

COST = StepCost(a=0.036, b=0.0026, c=0.002)  # SmolLM2 on the 2-core CPU, roughly


def verified(results) -> int:
    """Draft tokens sent to verification over a run's requests."""
    return sum(sum(r.stats.verified_per_round) for r in results)


def test_alone_nearly_every_plausible_draft_is_verified():
    take = budget.admit([budget.survival(torch.tensor([0.6, 0.6, 0.6, 0.6]))], base_tokens=1, emitted=1,
                        cost=COST, rows=1)
    assert take == [4]
    take = budget.admit([budget.survival(torch.tensor([0.02, 0.9]))], base_tokens=1, emitted=1, cost=COST, rows=1)
    assert take == [0]  # the first token is hopeless: the second is never reached


def test_in_a_full_batch_only_near_certain_drafts_are_verified():
    rows = [budget.survival(torch.tensor([0.95, 0.9, 0.3])), budget.survival(torch.tensor([0.3, 0.3]))] + \
        [[] for _ in range(30)]
    take = budget.admit(rows, base_tokens=32, emitted=32, cost=COST, rows=32)
    assert take[0] >= 1 and take[1] == 0
    assert budget.threshold(COST, 32, 32, 32) > budget.threshold(COST, 1, 1, 1) * 5


def test_admission_goes_by_survival_and_keeps_each_rows_drafts_a_prefix():
    # threshold b·emitted/seconds rises as slots are admitted: 0.95, 0.9, 0.85, 0.8 pass, 0.2 and 0.1 do not
    assert budget.admit([[0.9, 0.85, 0.2], [0.8, 0.1], [0.95]], base_tokens=3, emitted=3, cost=COST,
                        rows=3) == [2, 1, 1]


def test_a_prefill_chunk_in_the_step_does_not_make_drafts_look_cheap():
    # 3 decoding rows and a 400-token chunk for a newcomer: the step is ~1.1 s and emits 3
    # tokens, so against the step's own rate every slot would pay; what an accepted token
    # saves is its row's share of a decode step, so the same slots are admitted as without it
    rows = [[0.9, 0.85, 0.2], [0.8, 0.1], [0.95]]
    alone = budget.admit(rows, base_tokens=3, emitted=3, cost=COST, rows=4)
    assert budget.admit(rows, base_tokens=3, emitted=3, cost=COST, rows=4, prefill=400) == alone == [2, 1, 1]
    # priced against the whole step (the prefill counted as decoding tokens), all six would go
    assert budget.admit(rows, base_tokens=403, emitted=3, cost=COST, rows=4) == [3, 2, 1]


def test_a_steps_room_caps_verification_when_shared_but_never_a_lone_row():
    rows = [[0.9, 0.85, 0.2], [0.8, 0.1], [0.95]]
    assert budget.admit(rows, base_tokens=3, emitted=3, cost=COST, rows=3, room_s=None) == [2, 1, 1]
    # the step without verification: a + 3b + 3c = 49.8 ms; 5 ms more admits one token of 2.6 ms, 2.5 ms none
    assert budget.admit(rows, base_tokens=3, emitted=3, cost=COST, rows=3, room_s=0.005) == [0, 0, 1]
    assert budget.admit(rows, base_tokens=3, emitted=3, cost=COST, rows=3, room_s=0.0025) == [0, 0, 0]
    lone = [budget.survival(torch.tensor([0.6, 0.6, 0.6, 0.6]))]
    assert budget.admit(lone, base_tokens=1, emitted=1, cost=COST, rows=1, room_s=0.0) == [4]  # harms nobody


def test_under_a_room_a_row_drafts_no_more_than_the_step_has_room_to_verify():
    # 3 rows sharing a 49.8 ms step; each verified token adds 2.6 ms, a model draft's drafting 1 ms more
    assert budget.stretch_room(COST, 3, 3, 0.005, limit=8) == 1
    assert budget.stretch_room(COST, 3, 3, 0.00996, limit=8) == 3  # three tokens, not four
    assert budget.stretch_room(COST, 3, 3, 0.00996, drafting_s=0.001, limit=8) == 2  # drafting stretches it too
    assert budget.stretch_room(COST, 3, 3, 0.0, limit=8) == 0
    assert budget.stretch_room(COST, 3, 3, None, limit=8) == 8  # no bound
    assert budget.stretch_room(COST, 1, 1, 0.0, limit=8) == 8  # a lone row harms nobody


def test_a_steps_room_is_its_poorest_rows_balance_and_a_row_earns_by_its_own_accepted_drafts():
    assert budget.room(None, [0.0, 0.0], 0.05) is None  # no bound
    assert budget.room(0.1, [0.0], 0.05) is None  # a lone row
    assert budget.room(0.1, [0.5, 0.0, 0.2], 0.05) == pytest.approx(0.005)  # the poorest row, and this step's share
    assert budget.room(0.1, [0.5, -0.2], 0.05) == 0.0  # overdrawn: nothing
    gains, idle = budget.Slowdown(), budget.Slowdown()
    for _ in range(10):  # ten shared 50 ms steps, each 4 ms longer for verification
        gains.settle(0.05, 0.05, 0.04, saved=1, added_s=0.004)
        idle.settle(0.05, 0.05, 0.04, saved=0, added_s=0.004)
    assert idle.balance == pytest.approx(10 * (0.0025 - 0.004))  # paid 1.5 ms a step beyond its 5%
    assert gains.balance == pytest.approx(10 * (0.0025 + 0.04 - 0.004))  # each accepted draft saved it a step


def test_with_no_slowdown_allowed_rows_sharing_every_step_verify_nothing_and_match_plain():
    target = tiny_loaded(scale=4.0)
    cheap = StepCost(a=0.05, b=0.0001, c=0.0)  # verification nearly free: unbounded, it verifies
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 3, 9, 3, 9, 3], [20, 21, 20, 21, 20]]
    sp = dict(max_tokens=12, ignore_eos=True)  # the rows share every step to the end

    def serve(arm, stretch):
        engine = engine_over(target.model, WORDS, max_context=64, gamma_max=4, cost=cheap,
                             max_step_stretch=stretch, ngram=lambda cap: NgramProposer(1, 3))
        return run_together(engine, [token_request(i, p, arm, **sp) for i, p in enumerate(prompts)])

    plain, free, bound = serve("plain", None), serve("ngram:4", None), serve("ngram:4", 0.0)
    assert [r.token_ids for r in bound] == [r.token_ids for r in plain] == [r.token_ids for r in free]
    assert sum(r.stats.drafted for r in bound) == 0  # nothing drafted that nobody may verify
    assert verified(bound) == 0
    assert sum(r.stats.drafted for r in free) > 0
    assert verified(free) > 0


def test_under_a_slowdown_bound_rows_that_all_gain_verify_and_one_that_gains_nothing_holds_them_back():
    target = tiny_loaded(scale=4.0)
    copy = [20, 21, 20, 21, 20]  # the tiny target continues it in a way prompt lookup matches
    sp = dict(max_tokens=24, ignore_eos=True)

    def serve(arms, bound):
        # verifying a token costs 8 ms against a 74 ms step of three rows: a 3% share buys
        # less than a third of a token per step
        engine = engine_over(target.model, WORDS, max_context=64, gamma_max=4,
                             cost=StepCost(a=0.05, b=0.008, c=0.0), max_step_stretch=bound,
                             ngram=lambda cap: NgramProposer(1, 3))
        return run_together(engine, [token_request(i, copy, a, **sp) for i, a in enumerate(arms)])

    copiers, mixed = ["ngram:4"] * 3, ["ngram:4", "ngram:4", "plain"]
    free_all, bound_all = serve(copiers, None), serve(copiers, 0.03)
    free_mixed, bound_mixed = serve(mixed, None), serve(mixed, 0.03)
    plain = serve(["plain"] * 3, None)
    for results in (free_all, bound_all, free_mixed, bound_mixed):
        assert [r.token_ids for r in results] == [r.token_ids for r in plain]
    # every row earns by its own accepted drafts (the poorest first), so the batch keeps verifying
    assert min(sum(r.stats.accepted_per_round) for r in bound_all) >= 5
    assert verified(bound_all) >= 0.6 * verified(free_all)
    # the plain row earns only its 3% share: the copiers verify far less than unbounded
    assert 0 < verified(bound_mixed) <= 0.4 * verified(free_mixed)


def test_a_lone_row_pays_the_jump_beyond_one_token_so_judges_its_prefix_whole():
    jump = StepCost(a=COST.a, b=COST.b, c=COST.c, d=0.0064)
    weak = [budget.survival(torch.tensor([0.15]))]
    assert budget.admit(weak, base_tokens=1, emitted=1, cost=COST, rows=1) == [1]  # worth b alone
    assert budget.admit(weak, base_tokens=1, emitted=1, cost=jump, rows=1) == [0]  # not worth b + d
    # a weak first token that carries strong ones is verified: the whole prefix pays for the jump
    assert budget.admit([budget.survival(torch.tensor([0.6, 0.9, 0.9]))], base_tokens=1, emitted=1, cost=jump,
                        rows=1) == [3]


def test_a_lone_row_is_priced_at_what_was_measured_not_at_the_fit():
    # a fit that overprices the jump (as batched shapes on a noisy machine made it) ...
    fitted = StepCost(a=0.069, b=0.0006, c=0.003, d=0.030)
    measured = StepCost(a=0.069, b=0.0006, c=0.003, d=0.030,
                               lone={1: 0.0626, 2: 0.0700, 3: 0.0796, 4: 0.0780, 5: 0.0951})
    drafts = [budget.survival(torch.tensor([0.3, 0.3, 0.3]))]
    assert budget.admit(drafts, base_tokens=1, emitted=1, cost=fitted, rows=1) == [0]
    assert budget.admit(drafts, base_tokens=1, emitted=1, cost=measured, rows=1) == [1]
    assert measured.step(4, 1) == measured.step(3, 1)  # never cheaper than a shorter forward
    assert measured.step(9, 1) >= measured.step(5, 1)  # beyond the table: the fit, at least the table's top
    assert measured.step(2, 4) == fitted.step(2, 4)  # batches: the fit
    for _ in range(60):  # the machine slowed down: one-row steps move the price
        measured.observe(2, 1, 0.0900)
    assert measured.step(2, 1) == pytest.approx(0.0900, abs=0.001)


def test_a_lone_rows_prices_follow_the_machines_pace_together():
    # profiled: verifying a draft costs 1.1x a one-token step
    cost = StepCost(lone={1: 0.030, 2: 0.033, 3: 0.035})
    drafts = [budget.survival(torch.tensor([0.3]))]
    assert budget.admit(drafts, base_tokens=1, emitted=1, cost=cost, rows=1) == [1]
    for _ in range(30):  # slowed down, verifying as the profile said
        cost.observe(1, 1, 0.045)
        cost.observe(2, 1, 0.0495)
    for _ in range(60):  # sped up, and nothing verified meanwhile: no two-token step timed
        cost.observe(1, 1, 0.025)
    assert cost.step(1, 1) == pytest.approx(0.025, rel=0.01)
    # every entry moved with the pace: a draft still costs what the profile said against a step
    # (entries moved on their own, the two-token one stayed at 49.5 ms, 2x a step, and nothing
    # was verified again)
    assert cost.step(2, 1) / cost.step(1, 1) == pytest.approx(1.1, rel=0.05)  # what it learnt while the pace lagged
    assert budget.admit(drafts, base_tokens=1, emitted=1, cost=cost, rows=1) == [1]
    for _ in range(200):  # a size that costs more than the profile said is learnt against the unit
        cost.observe(1, 1, 0.025)
        cost.observe(3, 1, 0.035)
    assert cost.step(3, 1) / cost.step(1, 1) == pytest.approx(1.4, rel=0.05)


def test_a_lone_row_drafts_when_some_prefix_pays_for_the_jump():
    cost = StepCost(lone={1: 0.0852, 2: 0.1173, 3: 0.1194, 4: 0.1073})  # measured here: a 32 ms jump
    assert not budget.worth_drafting(0.4, 1, cost, 1, 1, 1, drafting_s=0.006)  # one token cannot repay it
    assert budget.worth_drafting(0.4, 3, cost, 1, 1, 1, drafting_s=0.006)  # three share it
    assert not budget.worth_drafting(0.2, 8, cost, 1, 1, 1, drafting_s=0.006)
    # in a batch there is no jump: a token's acceptance against its own price (about 0.38 of a token here)
    assert budget.worth_drafting(0.5, 1, COST, 16, 16, 16) and not budget.worth_drafting(0.3, 8, COST, 16, 16, 16)


def test_drafting_cost_raises_the_least_survival_worth_drafting():
    assert budget.threshold(COST, 1, 1, 1, drafting_s=0.003) > 2 * budget.threshold(COST, 1, 1, 1)
    assert budget.threshold(COST, 1, 1, 0) == 0.0


def test_a_rows_first_verified_draft_pays_its_leaving_the_one_token_path():
    # the fit tells a row feeding several tokens (e) from the tokens it feeds (b), given
    # batches where verifying rows and verified tokens vary apart
    cost = StepCost(a=0.01, b=0.002, c=0.0)
    for rows in (4, 6, 8, 12, 16):
        for multi in (0, 1, 3):
            for per_row in (2, 3, 4, 8):
                tokens = rows + multi * (per_row - 1)
                cost.observe(tokens, rows, 0.025 + 0.0008 * tokens + 0.0011 * rows + 0.0017 * multi + 0.0007, multi)
    assert cost.b == pytest.approx(0.0008, abs=0.0001) and cost.e == pytest.approx(0.0017, abs=0.0002)
    # so a lone survivor at 0.3 is not worth opening a row for in a batch of 16, but a sure run of four is
    cost = StepCost(a=0.025, b=0.0008, c=0.0011, e=0.0017)
    assert budget.admit([[0.3], [0.9, 0.8, 0.7, 0.6]] + [[]] * 14, base_tokens=16, emitted=16, cost=cost,
                        rows=16) == [0, 4] + [0] * 14
    # priced at b alone, the lone 0.3 would pass: 0.3 / 0.8 ms > 16 tokens / 56 ms
    flat = StepCost(a=0.025, b=0.0008, c=0.0011)
    assert budget.admit([[0.3]] + [[]] * 15, base_tokens=16, emitted=16, cost=flat, rows=16)[0] == 1


def test_the_jump_to_the_packed_copies_is_crossed_only_when_enough_drafts_pay():
    # two rows decoding run the small-matrix kernels; from 4 tokens the packed copies (+12 ms)
    cost = StepCost(a=0.02, b=0.0007, c=0.0013, e=0.001, d=0.003, g=0.012, packed_from=4)
    flat = StepCost(a=0.02, b=0.0007, c=0.0013, e=0.001, d=0.003)
    one = [[0.9, 0.5], []]  # a sure draft below the jump, an unsure one crossing it
    assert budget.admit(one, base_tokens=2, emitted=2, cost=cost, rows=2) == [1, 0]
    assert budget.admit(one, base_tokens=2, emitted=2, cost=flat, rows=2) == [2, 0]  # priced token by token
    # a run of likely drafts shares the jump between them: worth crossing for
    many = [[0.9, 0.85, 0.8, 0.8, 0.8, 0.8], []]
    assert budget.admit(many, base_tokens=2, emitted=2, cost=cost, rows=2) == [6, 0]
    # under a bound, a room short of the jump stops at the last token before it
    assert budget.stretch_room(cost, 2, 2, 0.005, limit=8) == 1
    assert budget.stretch_room(cost, 2, 2, 0.02, limit=8) == 8
    # ... so a model draft's next token is judged at the average over the tokens it may draft
    assert budget.threshold(cost, 2, 2, 2) < budget.threshold(cost, 2, 2, 2, span=1) / 2


def worth(est: budget.AcceptanceEstimate) -> bool:
    """The gate of a lone row drafting up to 6 tokens at 3 ms per drafted token."""
    return budget.worth_drafting(est.value, 6, COST, 1, 1, 1, drafting_s=0.003)


def test_a_collapsed_row_drifts_back_and_probes_again():
    est = budget.AcceptanceEstimate(prior=0.5)
    assert worth(est)
    for _ in range(30):
        est.observe(verified=4, accepted=0)
    low = est.value
    assert low < 0.12 and not worth(est)  # the gate closes: plain rounds
    for _ in range(40):
        est.observe(verified=0, accepted=0)  # plain rounds: nothing verified
    assert est.value > 0.3 > low and worth(est)


def test_a_run_of_rejections_does_not_close_the_gate_of_a_draft_that_pays():
    # a first token accepted 28% of the time pays alone; three rejections in a row come every few rounds
    est = budget.AcceptanceEstimate(prior=0.5)
    outcomes = torch.rand(200, generator=torch.Generator().manual_seed(0)) < 0.28
    lowest = 1.0
    for i, ok in enumerate(outcomes.tolist()):
        est.observe(verified=1, accepted=int(ok))
        if i >= 20:
            lowest = min(lowest, est.value)
    assert lowest > 0.15 and worth(est)
    before = est.value
    for _ in range(3):
        est.observe(verified=1, accepted=0)
    assert before - est.value < 0.06 and worth(est)


def test_a_draft_not_worth_verifying_moves_the_row_to_what_it_believed():
    strong, weak = budget.AcceptanceEstimate(prior=0.5), budget.AcceptanceEstimate(prior=0.5)
    strong.observe(verified=6, accepted=6)
    for _ in range(6):  # a round that did not pay is no evidence against the target's agreement
        strong.settle(0.7)
        weak.settle(0.05)  # a draft judged weak round after round closes its own gate
    assert strong.value > 0.65 and weak.value < 0.15
    assert worth(strong) and not worth(weak)


def test_calibration_learns_what_confidence_means():
    cal = budget.Calibration()
    key = ("d", True)
    for _ in range(200):  # confident tokens accepted, unsure ones rejected
        cal.observe(key, torch.tensor([0.95, 0.15]), accepted=1)
    est = cal.estimate(key, torch.tensor([0.95, 0.15]))
    assert est[0] > 0.9 and est[1] < 0.1
    assert cal.value(key, 0.95) == pytest.approx(float(est[0]))


# ------------------------------------------------------------------ lossless when the budget cuts drafts
EXPENSIVE = StepCost(a=0.05, b=0.01, c=0.0)  # verification dear: the budget keeps cutting


def engine_with(target: LlamaModel, words, cost, **drafts) -> BuiltinEngine:
    return engine_over(target, words, max_context=64, gamma_max=4, cost=cost, **drafts)


# the packed copies: three rows' 3 tokens run the small-matrix kernels, a fourth token jumps by g
JUMP = StepCost(a=0.05, b=0.002, c=0.0, g=0.006, packed_from=4)


@pytest.mark.parametrize("cost", [EXPENSIVE, JUMP], ids=["linear", "jump"])
def test_greedy_output_is_plain_output_when_the_budget_cuts_drafts(cost):
    target = tiny_loaded(scale=4.0)
    sub = LlamaModel(target.model.cfg, target.model.weights, [0, 1])
    prompts = [[5, 6, 7, 5, 6], [9, 3, 12, 30, 2, 2, 8], [20, 21, 20, 21]]
    plain = run_together(engine_with(target.model, WORDS, cost), [token_request(i, p) for i, p in
                                                                  enumerate(prompts)])
    cut = run_together(engine_with(target.model, WORDS, cost, ngram=lambda cap: NgramProposer(1, 3),
                                   half=lambda cap: ModelDraftProposer(sub, cap)),
                       [token_request(i, p, "ngram:4" if i % 2 else "half:4") for i, p in enumerate(prompts)])
    assert [r.token_ids for r in cut] == [r.token_ids for r in plain]
    drafted = sum(r.stats.drafted for r in cut)
    assert 0 < verified(cut) < drafted  # it verified some, and cut others


def test_sampling_follows_the_target_when_the_budget_cuts_drafts():
    words = WORDS[:10]
    target = lean_from_hf(tiny_hf_model(vocab=10, seed=3, scale=1.5, layers=3))
    sub = LlamaModel(target.cfg, target.weights, [0])
    sp = SamplingParams(max_tokens=4, temperature=1.0, top_p=0.8, ignore_eos=True)
    prompt = [2, 3, 4, 2, 3, 4, 2]
    exact = exact_joint_of_first_tokens(target, prompt, sp, 4)
    trials = 1500
    cost = StepCost(a=0.001, b=0.004, c=0.0)
    results = run_together(engine_with(target, words, cost, half=lambda cap: ModelDraftProposer(sub, cap),
                                       ngram=lambda cap: NgramProposer(1, 2)),
                           [token_request(s, prompt, "half:3" if s % 2 else "ngram:3", **{**sp.__dict__, "seed": s})
                            for s in range(trials)])
    counts: dict = {}
    for r in results:
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
    drafted = sum(r.stats.drafted for r in results)
    assert 0 < verified(results) < drafted
    assert_follows(exact, counts, trials, "budget")


def test_prompt_lookup_learns_which_matches_hold_and_probes_what_it_judged_weak():
    from engines.proposers.ngram import match_score

    cal, key = budget.Calibration(), ("ngram", True)
    cal.start(key, NgramProposer.calibration_prior)
    long_match, short_match = [match_score(3, j) for j in range(4)], [match_score(1, j) for j in range(4)]
    assert len(set(long_match + short_match)) == 6  # bins told apart
    assert cal.estimate(key, torch.tensor(short_match))[0] > 0.5  # before evidence: better than even
    for _ in range(300):  # long matches copy on; single-token matches miss at once
        cal.observe(key, torch.tensor(long_match), accepted=4)
        cal.observe(key, torch.tensor(short_match), accepted=0)
    assert cal.estimate(key, torch.tensor(long_match)).min() > 0.9
    assert cal.estimate(key, torch.tensor(short_match[:1]))[0] < 0.1
    for _ in range(1000):  # only long matches verified from here on: the weak bin drifts back toward a try
        cal.observe(key, torch.tensor(long_match), accepted=4)
    assert cal.estimate(key, torch.tensor(short_match[:1]))[0] > 0.4  # most of the way to the prior's 0.6


def test_a_request_that_beats_the_shared_calibration_is_trusted_further():
    copying, chatty = budget.RequestBias(), budget.RequestBias()
    assert copying.ratio() == copying.ratio(later=True) == 1.0  # no evidence: as calibrated
    est = torch.tensor([0.4, 0.4, 0.4, 0.4])
    for _ in range(10):
        copying.observe(est, accepted=4)  # a quote: everything accepted
        chatty.observe(est, accepted=0)
    assert copying.ratio() > 1.8 and copying.ratio(later=True) > 2 and chatty.ratio() < 0.5
    assert copying.apply(est).min() > 0.7 and float(copying.apply(torch.tensor([0.9]))) == pytest.approx(0.99)
    for _ in range(40):  # the quote ended: recent rounds weigh most
        copying.observe(est, accepted=0)
    assert copying.ratio() < 0.5


def test_a_request_whose_lookups_are_all_rejected_stops_paying_for_one_a_round():
    """The prior counts tried tokens: at shared estimates of 0.2 and nothing accepted, the
    request's own estimate falls below 0.06, the price of one verified draft for a lone row
    (13.4 against 12.6 ms); a prior of 2 expected tokens would hold it at about 0.1. It keeps a
    floor of about M over the tokens in its memory, so a long match the shared bins rate
    near 0.9 is still worth verifying: the request's probe."""
    bias, est = budget.RequestBias(), torch.tensor([0.2, 0.4])
    for _ in range(30):
        bias.observe(est, accepted=0)
    assert float(bias.apply(est)[0]) < 0.06
    assert float(bias.apply(torch.tensor([0.9]))[0]) > 0.2


def test_a_copy_that_rarely_starts_but_holds_keeps_its_later_tokens():
    # sampled free text: the first copied token is accepted one round in five, the second after an
    # accepted first as often as calibrated; a low first ratio must not scale the later tokens down too
    bias, est = budget.RequestBias(), torch.tensor([0.4, 0.6, 0.6])
    for i in range(50):
        bias.observe(est, accepted=2 if i % 5 == 0 else 0)  # accepted first: the second held, the third not
    assert bias.ratio() < 0.7
    assert bias.ratio(later=True) == pytest.approx(1.0, abs=0.2)
    first, second, _ = budget.survival(bias.apply(est))
    assert second / first == pytest.approx(0.6, abs=0.12)  # one ratio for all gave 0.6 x the first's


def test_the_drafting_price_shrugs_off_a_prompt_read_but_follows_a_slower_machine():
    """A model draft's first call of a request also reads the prompt (here 18x a
    round's drafting per token): averaged in whole it would price the next rounds'
    drafting ~2.7x; capped, about 1.2x. A machine that really slows 3x is followed
    within a few dozen calls."""
    drafting_price = budget.drafting_price
    price = None
    for _ in range(50):
        price = drafting_price(price, 0.008, 2)  # 4 ms per drafted token
    assert price == pytest.approx(0.004)
    spiked = drafting_price(price, 0.072, 1)  # the prompt read: 72 ms for its one token
    assert spiked == pytest.approx(0.9 * 0.004 + 0.1 * 0.012) and spiked < 1.25 * 0.004
    assert 0.9 * 0.004 + 0.1 * 0.072 > 2.5 * 0.004  # what the uncapped average made of it
    slow = price
    for _ in range(40):
        slow = drafting_price(slow, 0.024, 2)  # every call now 12 ms per token
    assert slow > 0.9 * 0.012
