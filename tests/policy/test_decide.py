"""Invariants of decide(): rules win, excluded arms never chosen, determinism."""

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.arms import Arm, ArmMenu, DraftKind
from policy.decide import SOURCES, decide
from policy.features import RequestFeatures
from policy.model import prior_model
from policy.rules import CATEGORIES, parse_rules

ARMS = ArmMenu(("ngram", "selfspec"), 1, 8)

features_st = st.builds(
    RequestFeatures,
    category=st.sampled_from(CATEGORIES),
    temperature=st.floats(0, 2),
    top_p=st.floats(0.05, 1),
    prompt_tokens=st.integers(1, 8000),
    expected_output_tokens=st.integers(1, 2048),
    copy_signal=st.floats(0, 1),
    running=st.integers(0, 64),
    waiting=st.integers(0, 64),
    tenant=st.sampled_from(["", "acme", "bench"]),
    requested_arm=st.sampled_from([None, "plain", "ngram:4", "selfspec:2", "ngram:9", "junk"]),
    rolling_acceptance=st.dictionaries(st.sampled_from(["ngram", "selfspec"]),
                                       st.tuples(st.floats(0, 1), st.integers(0, 100))),
)

RESTRICTIVE = parse_rules("""
rules:
  - name: force-hot
    when: {temperature: {gt: 1.5}}
    then: {force: "ngram:3"}
  - name: code-small
    when: {category: [code]}
    then: {drafts: [ngram], gamma: {min: 2, max: 3}, explore: 0.5}
default:
  drafts: [selfspec]
  gamma: {max: 4}
  explore: 0.3
  guard: {min_acceptance: 0.55, min_samples: 10, reprobe: 0.0}
""")


@settings(max_examples=400, deadline=None)
@given(f=features_st, seed=st.integers(0, 2**32))
def test_decision_respects_rules_and_is_deterministic(f, seed):
    d = decide(f, RESTRICTIVE, prior_model(), random.Random(seed), ARMS)
    again = decide(f, RESTRICTIVE, prior_model(), random.Random(seed), ARMS)
    assert d == again  # same rng seed, same decision
    assert d.source in SOURCES and 0 < d.propensity <= 1 and d.reason
    assert ARMS.allows(d.arm)
    if f.temperature > 1.5:
        assert d.arm == Arm("ngram", 3) and d.source == "rule"  # rules always win
        return
    if f.category == "code":
        assert d.arm.is_plain or (d.arm.draft == "ngram" and 2 <= d.arm.gamma <= 3)
    else:
        assert d.arm.is_plain or (d.arm.draft == "selfspec" and d.arm.gamma <= 4)
        alpha, n = f.rolling_acceptance.get("selfspec", (1.0, 0))
        if n >= 10 and alpha < 0.55 and d.source != "request":
            assert d.arm.is_plain  # guard tripped, reprobe share 0 (the guard steers the policy's choices)


@settings(max_examples=200, deadline=None)
@given(f=features_st, seed=st.integers(0, 2**32))
def test_exploration_never_leaves_the_allowed_set(f, seed):
    rules = parse_rules("default: {drafts: [ngram], gamma: {min: 2, max: 2}, explore: 1.0}")
    d = decide(f, rules, prior_model(), random.Random(seed), ARMS)
    assert d.arm in (Arm(), Arm("ngram", 2))


def test_cold_start_prior_avoids_speculation_when_it_cannot_pay():
    rules = parse_rules("default: {explore: 0}")
    base = dict(category="summarization", top_p=1.0, prompt_tokens=900, copy_signal=0.8)
    d = decide(RequestFeatures(temperature=0, expected_output_tokens=256, **base), rules, None, random.Random(0), ARMS)
    assert d.arm.draft == "ngram" and d.source == "policy"  # copy-heavy, greedy, idle engine
    for f in (
        RequestFeatures(temperature=0, expected_output_tokens=256, running=16, waiting=32, **base),  # high load
        # a full batch of 16 (the bench's): a verified token costs about what it may gain there
        RequestFeatures(temperature=0, expected_output_tokens=256, running=15, **base),
        RequestFeatures(temperature=0, expected_output_tokens=3, **base),  # short output
    ):
        assert decide(f, rules, None, random.Random(0), ARMS).arm.is_plain, f
    # hot sampling: the adaptive engine keeps prompt lookup about even with plain at T=1
    # (measured 1.06x), so it may still be chosen, but for less than at T=0
    hot = decide(RequestFeatures(temperature=1.0, expected_output_tokens=256, **base), rules, None,
                 random.Random(0), ARMS)
    assert max(hot.predicted_speedup.values()) < max(d.predicted_speedup.values())


def test_requested_arm_is_honoured_only_when_allowed():
    f = RequestFeatures("chat", 0, 1, 10, 100, 0.1, requested_arm="ngram:5")
    allow = parse_rules("default: {explore: 0}")
    deny = parse_rules("default: {drafts: [selfspec], explore: 0}")
    assert decide(f, allow, None, random.Random(0), ARMS).arm == Arm("ngram", 5)
    assert decide(f, deny, None, random.Random(0), ARMS).arm != Arm("ngram", 5)


def test_propensities_of_all_arms_sum_to_one():
    f = RequestFeatures("chat", 0.65, 1, 900, 200, 0.05)  # prompt lookup within the posterior's reach of plain
    rules = parse_rules("default: {drafts: [ngram], gamma: {min: 1, max: 3}, explore: 0.2}")
    seen = {}
    for seed in range(3000):
        d = decide(f, rules, None, random.Random(seed), ARMS)
        seen[d.arm] = d.propensity
    assert len(seen) >= 2 and abs(sum(seen.values()) - 1) < 1e-6


def test_a_drafts_equal_predictions_go_to_its_largest_gamma():
    """Where the engine adapts, γ is a bound it verifies within: of a draft's
    bounds predicted alike the largest is chosen, explored or not (the smallest
    was, and capped prompt lookup's long copies)."""
    from policy.train import greedy_arm

    f = RequestFeatures("summarization", 0, 1, 900, 200, 0.36)  # a weak copy cue: past k = 2 a token does not pay
    rules = parse_rules("default: {drafts: [ngram], gamma: {min: 1, max: 3}, explore: 1.0}")
    adaptive = dataclasses.replace(ARMS, adaptive=True)
    chosen = {decide(f, rules, None, random.Random(seed), adaptive).arm for seed in range(300)}
    speed = decide(f, rules, None, random.Random(0), adaptive).predicted_speedup
    assert speed["ngram:2"] == speed["ngram:3"] > 1.0  # a tie: nothing but the order decides it
    assert chosen == {Arm("ngram", 3)}
    # a server that runs the γ it is given: the shortest draft predicted to pay as much
    greedy = parse_rules("default: {drafts: [ngram], gamma: {min: 1, max: 3}, explore: 0}")
    assert decide(f, greedy, None, random.Random(0), ARMS).arm == Arm("ngram", 2)
    menu = ArmMenu(("ngram",), 1, 8, adaptive=True)
    assert greedy_arm(prior_model(), f, menu.by_preference()) == Arm("ngram", 8)


def test_a_hybrid_is_drawn_with_its_model_part():
    """A hybrid runs its model part wherever lookup finds nothing, so their acceptance moves
    together: Thompson draws that rate the hybrid above the head alone at the mean do so in
    every draw, and the head alone is never explored in its place. Two unrelated drafts with
    the same coefficients are drawn independently and both get tried. What a draft is comes
    from the engine where it says (any names), else from the default config's names."""
    from policy.model import N_FEATURES, DraftModel, PolicyModel

    head = [0.0] * N_FEATURES  # α ≈ 0.5
    hybrid = list(head)
    hybrid[-1] = 0.1  # a little above the head alone, well within the posterior's spread
    f = RequestFeatures("chat", 0.0, 1, 900, 200, 0.0)
    rules = parse_rules("default: {explore: 1.0}")

    def chosen(names, kinds=()):
        # fitted drafts (outcomes behind them): what is tested is the draws, not the untried share
        model = PolicyModel("t", {names[0]: DraftModel(head, None, [0.0, 0.09, 0.02], samples=500),
                                  names[1]: DraftModel(hybrid, None, [0.0, 0.09, 0.02], samples=500)}, explore=1.0)
        menu = ArmMenu(names, 1, 8, adaptive=True, kinds=kinds)
        return {decide(f, rules, model, random.Random(seed), menu).arm.draft for seed in range(400)}

    assert chosen(("eagle", "ngram-eagle")) == {"ngram-eagle"}
    assert chosen(("eagle", "other")) == {"eagle", "other"}
    assert chosen(("head", "mix")) == {"head", "mix"}
    assert chosen(("head", "mix"), (("mix", DraftKind("hybrid", "head")), ("head", DraftKind("eagle")))) == {"mix"}


def test_an_unseen_draft_starts_from_its_kinds_prior():
    """A draft the model has no outcomes for is predicted by its kind's prior: the kind
    the engine reports, whatever the draft is called (prompt lookup named 'lookup' is
    predicted as prompt lookup, not as a separate draft model costing most of a step)."""
    f = RequestFeatures("coding", 0.0, 1, 900, 200, 0.9)
    rules = parse_rules("default: {explore: 0}")

    def predicted(kinds=()):
        menu = ArmMenu(("lookup",), 8, 8, adaptive=True, kinds=kinds)
        return decide(f, rules, None, random.Random(0), menu).predicted_speedup["lookup:8"]

    as_lookup = predicted((("lookup", DraftKind("ngram")),))
    assert as_lookup == pytest.approx(prior_model().speedup(f, "ngram", 8), abs=1e-3) and as_lookup > 1.0
    as_named = predicted()  # no kind reported: a name that is no default draft's reads as a draft model
    assert as_named == pytest.approx(prior_model().speedup(f, "a-draft-model", 8), abs=1e-3) and as_named < as_lookup


def test_exploration_stays_near_the_best_prediction():
    """Under load a selfspec:8 trial would hold back the whole batch: arms
    predicted far below the best are never tried, however high explore is."""
    from policy.decide import EXPLORE_FLOOR

    f = RequestFeatures("summarization", 0, 1, 900, 200, 0.8, running=12)
    rules = parse_rules("default: {explore: 1.0}")
    model = prior_model()
    for seed in range(500):
        d = decide(f, rules, model, random.Random(seed), ARMS)
        assert d.predicted_speedup[d.arm.name] >= EXPLORE_FLOOR * max(d.predicted_speedup.values())


def test_under_load_exploration_never_tries_an_arm_predicted_below_plain():
    """Alone, an arm predicted a little below plain may be tried (it costs only
    its own request); sharing steps with others, it is not."""
    from policy.model import N_FEATURES, DraftModel, PolicyModel

    w = [0.0] * N_FEATURES
    w[-1] = -1.5  # α ≈ 0.18 everywhere; the per-request overhead puts every γ a little below plain
    model = PolicyModel("t", {"ngram": DraftModel(w, None, [0.0, 0.06, 0.005], overhead_steps=30.0)}, explore=1.0)
    rules = parse_rules("default: {drafts: [ngram], explore: 1.0}")
    base = dict(category="chat", temperature=0.0, top_p=1.0, prompt_tokens=200, expected_output_tokens=200,
                copy_signal=0.1)
    below = {0: 0, 8: 0}  # requests in the engine besides this one
    for seed in range(300):
        for running in below:
            d = decide(RequestFeatures(running=running, **base), rules, model, random.Random(seed), ARMS)
            below[running] += d.predicted_speedup[d.arm.name] < 1.0
    assert below[0] > 0 and below[8] == 0, below


def test_force_of_an_arm_no_engine_serves_falls_back_to_plain():
    rules = parse_rules("default: {force: 'eagle:3'}")
    d = decide(RequestFeatures("chat", 0, 1, 10, 100, 0.1), rules, None, random.Random(0), ARMS)
    assert d.arm.is_plain and d.source == "fallback" and "eagle:3" in d.reason


def test_the_guard_counts_rounds_of_evidence_not_drafted_tokens():
    """min_samples is rounds: three rounds at γ=8 (24 drafted tokens) are not
    the 20 samples the guard asks for; twenty rounds are."""
    rules = parse_rules("default: {explore: 0.0, guard: {min_acceptance: 0.5, min_samples: 20, reprobe: 0.0}}")
    base = RequestFeatures(category="chat", temperature=0.0, top_p=1.0, prompt_tokens=50,
                           expected_output_tokens=200, copy_signal=0.9)
    menu = ArmMenu(("ngram",), 1, 8)
    few = decide(dataclasses.replace(base, rolling_acceptance={"ngram": (0.1, 3.0)}),
                 rules, prior_model(), random.Random(0), menu)
    many = decide(dataclasses.replace(base, rolling_acceptance={"ngram": (0.1, 20.0)}),
                  rules, prior_model(), random.Random(0), menu)
    assert "guard" not in few.reason
    assert many.arm.is_plain and "guard" in many.reason
    # a request that asks for the guarded draft gets it: the guard steers the policy, not the client
    asked = decide(dataclasses.replace(base, rolling_acceptance={"ngram": (0.1, 20.0)}, requested_arm="ngram:8"),
                   rules, prior_model(), random.Random(0), menu)
    assert asked.arm == Arm("ngram", 8) and asked.source == "request"


def test_an_explicit_menu_offers_exactly_its_arms_within_the_rules_bounds():
    menu = ArmMenu.parse("plain,ngram:2,ngram:6,draft:5")  # servers configured per arm
    f = RequestFeatures("code", 0.0, 1.0, 100, 128, 0.5)
    d = decide(f, parse_rules("default: {gamma: {max: 5}, explore: 0.0}"), prior_model(), random.Random(0), menu)
    assert set(d.predicted_speedup) == {"plain", "ngram:2", "draft:5"}


def test_idle_requests_try_the_drafts_the_model_has_no_outcomes_for():
    """Thompson draws around a fit that far prefers one draft never reach a draft the
    model prices by the prior alone, and the judge promotes only on outcomes: a small
    share of idle requests tries each such draft (at its best γ, if predicted worth
    trying), with the mixture's propensity logged. Under load, with exploration off,
    or once the draft has outcomes behind it, none is tried."""
    from policy.decide import EXPLORE_UNTRIED, UNTRIED_FLOOR
    from policy.model import N_FEATURES, DraftModel, PolicyModel

    sure = [0.0] * N_FEATURES
    sure[-1] = 3.0  # α ≈ 0.95: prompt lookup far ahead of the head's prior
    fitted = DraftModel(sure, None, [0.0, 0.06, 0.02], samples=500)
    menu = ArmMenu(("ngram", "eagle", "selfspec"), 1, 8, adaptive=True)
    f = RequestFeatures("chat", 1.0, 1.0, 300, 200, 0.1)
    on = parse_rules("default: {explore: 1.0}")

    def served(model, rules=on, running=0, n=2000):
        ds = [decide(dataclasses.replace(f, running=running), rules, model, random.Random(s), menu) for s in range(n)]
        return ds, {d.arm: d.propensity for d in ds}

    model = PolicyModel("t", {"ngram": fitted}, explore=1.0)
    ds, propensity = served(model)
    speed = ds[0].predicted_speedup
    assert speed["eagle:8"] >= UNTRIED_FLOOR > max(v for a, v in speed.items() if a.startswith("selfspec"))
    tried = [d for d in ds if d.arm.draft == "eagle"]  # the layers draft is not worth a try
    assert 0.5 * EXPLORE_UNTRIED * len(ds) < len(tried) < 1.5 * EXPLORE_UNTRIED * len(ds)
    assert {d.arm for d in tried} == {Arm("eagle", 8)} and all("no outcomes" in d.reason for d in tried)
    assert set(propensity) == {Arm("ngram", 8), Arm("eagle", 8)}
    assert propensity[Arm("eagle", 8)] == pytest.approx(EXPLORE_UNTRIED)
    assert sum(propensity.values()) == pytest.approx(1.0)
    for _, propensity in (served(model, running=2, n=300), served(model, parse_rules("default: {explore: 0}"), n=300),
                           served(PolicyModel("t", {"ngram": fitted, "eagle": dataclasses.replace(
                               prior_model().draft("eagle"), samples=500)}), n=300)):
        assert propensity == {Arm("ngram", 8): 1.0}
