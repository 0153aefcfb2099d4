"""The step-cost model: fitted at start-up, refitted from steps, and a lone
row's measured table kept monotone."""

import numpy as np
import pytest

from engines.layouts import runs_packed
from engines.stepcost import StepCost, features, fit, further_passes, leaves_columns


def test_the_step_cost_model_is_refitted_from_steps():
    cost = StepCost(a=0.01, b=0.01, c=0.0)
    for tokens in range(1, 40):
        for rows in (1, 4, 8):
            if rows <= tokens:
                cost.observe(tokens, rows, 0.035 + 0.003 * tokens + 0.002 * rows)
    assert cost.a == pytest.approx(0.035, abs=0.003) and cost.b == pytest.approx(0.003, abs=0.0005)


def test_the_start_up_fit_recovers_the_model_and_keeps_every_price_non_negative():
    shapes = [(t, 1, int(t > 1)) for t in range(1, 10)] + [(2, 2, 0), (8, 8, 0), (16, 16, 0), (12, 4, 4),
                                                           (14, 8, 2), (24, 16, 4), (36, 5, 1)]
    x = np.array([features(*s) for s in shapes])
    true = np.array([0.02, 0.001, 0.0005, 0.002, 0.003, 0.0, 0.0, 0.0, 0.0])  # a, b, c, e, d, g, h, k, p
    cost = fit(x, x @ true, lone={1: 0.03})
    assert [cost.a, cost.b, cost.c, cost.e, cost.d, cost.g, cost.h] == pytest.approx(list(true[:7]), abs=1e-9)
    assert cost.k == cost.b  # no forward ran as W @ xᵀ: those would be priced as any other
    assert cost.lone == {1: 0.03}
    # rows that got cheaper as they were added (noise on a busy machine): unconstrained, c would be
    # negative and every other price bent to match; here it is zero
    cost = fit(x, x @ np.array([0.02, 0.001, -0.0004, 0.002, 0.003, 0.0, 0.0, 0.0, 0.0]))
    assert cost.c == 0.0 and min(cost.a, cost.b, cost.e, cost.d) >= 0.0


def test_the_price_jumps_where_forwards_move_to_the_packed_copies():
    assert [runs_packed(t, 4) for t in (1, 3, 4, 40)] == [False, False, True, True] and not runs_packed(40, None)
    shapes = [(t, 1, int(t > 1)) for t in range(1, 10)] + [(2, 2, 0), (3, 2, 1), (4, 4, 0), (8, 8, 0), (16, 16, 0),
                                                           (12, 4, 4), (16, 8, 2), (28, 16, 4), (36, 5, 1),
                                                           (136, 9, 1)]
    true = np.array([0.02, 0.0007, 0.0013, 0.001, 0.003, 0.006, 0.0, 0.0, 0.0])  # a, b, c, e, d, g, h, k, p
    x = np.array([features(*s, 4) for s in shapes])
    cost = fit(x, x @ true, packed_from=4)
    assert [cost.a, cost.b, cost.c, cost.e, cost.d, cost.g, cost.h] == pytest.approx(list(true[:7]), abs=1e-9)
    # 2 rows: the fourth token leaves the small-matrix kernels for the packed copies (g) ...
    assert cost.step(4, 2, 1) - cost.step(3, 2, 1) == pytest.approx(0.0007 + 0.006)
    # ... and from there every token costs b (and a row's first, e)
    assert cost.step(17, 16, 1) - cost.step(16, 16) == pytest.approx(0.0007 + 0.001)
    assert cost.step(33, 16, 1) - cost.step(32, 16, 1) == pytest.approx(0.0007)
    # without packed copies the same coefficients have no jump
    flat = StepCost(a=0.02, b=0.0007, c=0.0013, e=0.001, d=0.003, g=0.006)
    assert flat.step(4, 2, 1) - flat.step(3, 2, 1) == pytest.approx(0.0007)
    for _ in range(60):  # refitted from steps with the same copies: the jump is kept
        for t, r, m in shapes[9:]:
            cost.observe(t, r, float(np.dot(true, features(t, r, m, 4))), m)
    assert cost.b == pytest.approx(0.0007, rel=0.01) and cost.g == pytest.approx(0.006, rel=0.01)


def test_the_price_jumps_where_forwards_leave_the_route_as_w_x_transposed():
    assert [leaves_columns(t, 5) for t in (1, 5, 6, 40)] == [False, False, True, True]
    assert not leaves_columns(40, 0)  # no route: nothing to leave
    shapes = [(t, 1, int(t > 1)) for t in range(1, 10)] + [(2, 2, 0), (4, 4, 0), (8, 8, 0), (16, 16, 0), (12, 4, 4),
                                                           (16, 8, 2), (28, 16, 4), (36, 5, 1)]
    true = np.array([0.012, 0.0012, 0.0013, 0.001, 0.0005, 0.0, 0.007, 0.0031, 0.0])  # a, b, c, e, d, g, h, k, p
    x = np.array([features(*s, None, 5) for s in shapes])
    cost = fit(x, x @ true, columns_upto=5)
    assert [cost.a, cost.b, cost.c, cost.e, cost.d, cost.g, cost.h, cost.k] == pytest.approx(list(true[:8]), abs=1e-9)
    # 4 rows decoding: the sixth token's forward leaves the route (h), and every token on it costs b, not k ...
    assert cost.step(6, 4, 1) - cost.step(5, 4, 1) == pytest.approx(0.007 + 6 * 0.0012 - 5 * 0.0031)
    assert cost.step(5, 4, 1) - cost.step(4, 4, 1) == pytest.approx(0.0031)
    assert cost.step(8, 4, 1) - cost.step(7, 4, 1) == pytest.approx(0.0012)
    assert StepCost.from_dict(cost.to_dict()).step(6, 4, 1) == pytest.approx(cost.step(6, 4, 1))
    for _ in range(60):  # refitted from steps on the same route: the jump is kept
        for t, r, m in shapes[9:]:
            cost.observe(t, r, float(np.dot(true, features(t, r, m, None, 5))), m)
    assert cost.b == pytest.approx(0.0012, rel=0.01) and cost.h == pytest.approx(0.007, rel=0.01)
    assert cost.k == pytest.approx(0.0031, rel=0.01)


def test_a_further_pass_of_the_panels_over_the_weights_is_priced_where_a_forward_takes_one():
    assert [further_passes(t, 32, 4) for t in (1, 4, 5, 8, 9, 32, 33)] == [0, 0, 1, 1, 2, 7, 0]
    assert further_passes(9, 32, 0) == 0  # no panels run the route: no passes to price
    shapes = [(t, 1, int(t > 1)) for t in range(1, 10)] + [(2, 2, 0), (4, 4, 0), (8, 8, 0), (16, 16, 0), (12, 4, 4),
                                                           (16, 8, 2), (28, 16, 4), (36, 5, 1)]
    # the panels taking 4 tokens a pass: a token on the route 1.9 ms, a further pass over the weights 2.5 ms
    true = np.array([0.005, 0.0012, 0.0, 0.0, 0.0, 0.0, 0.01, 0.0019, 0.0025])  # a, b, c, e, d, g, h, k, p
    x = np.array([features(*s, None, 32, 4) for s in shapes])
    cost = fit(x, x @ true, columns_upto=32, pass_rows=4)
    assert cost.p == pytest.approx(0.0025, abs=1e-9) and cost.k == pytest.approx(0.0019, abs=1e-9)
    # 8 rows decoding: a first verified draft is a ninth token and a third pass; a second draft only a token
    ninth = cost.step(9, 8, 1) - cost.step(8, 8)
    assert ninth == pytest.approx(0.0019 + 0.0025)
    assert cost.step(10, 8, 1) - cost.step(9, 8, 1) == pytest.approx(0.0019)
    # linear in tokens alone, the same forwards price the ninth token at about its mean slope
    linear = fit(np.array([features(*s, None, 32) for s in shapes]), x @ true, columns_upto=32)
    assert linear.step(9, 8, 1) - linear.step(8, 8) < 0.8 * ninth
    # kept in a profile, and refitted from steps with the pass's price kept
    assert StepCost.from_dict(cost.to_dict()).step(9, 8, 1) == pytest.approx(cost.step(9, 8, 1))
    for _ in range(60):
        for t, r, m in shapes[9:]:
            cost.observe(t, r, float(np.dot(true, features(t, r, m, None, 32, 4))), m)
    assert cost.p == pytest.approx(0.0025, rel=0.01) and cost.k == pytest.approx(0.0019, rel=0.01)


def test_prefill_chunks_do_not_lower_the_price_of_a_draft_verified_in_a_batch():
    # as measured on an AMD EPYC: as W @ xᵀ (up to 24 tokens) a token costs 4.8 ms, laid out 2.4
    true = np.array([0.0077, 0.0024, 0.0019, 0.0024, 0.0, 0.0, 0.036, 0.0048, 0.0])  # a, b, c, e, d, g, h, k, p
    cost = StepCost(a=0.0077, b=0.0024, c=0.0019, e=0.0024, h=0.036, columns_upto=24, k=0.0048)
    rng = np.random.default_rng(0)
    # serving at 8 rows: mostly decode steps, a few verifying drafts, a newcomer's 128-token chunk now and then
    steps = [(8, 8, 0)] * 30 + [(12, 8, 1), (16, 8, 2), (11, 8, 1)] * 3 + [(135, 8, 1), (71, 8, 1)] * 3
    for _ in range(8):
        for i in rng.permutation(len(steps)):
            t, r, m = steps[i]
            cost.observe(t, r, float(true @ features(t, r, m, None, 24)) * rng.uniform(0.97, 1.03), m)
    # one row verifying 1 draft, or 4: one slope for both routes, pulled toward the chunks' cheap tokens,
    # could price only one of the two right (the row's first draft carrying the rest)
    assert cost.step(9, 8, 1) - cost.step(8, 8) == pytest.approx(0.0048 + 0.0024, rel=0.15)
    assert cost.step(12, 8, 1) - cost.step(8, 8) == pytest.approx(4 * 0.0048 + 0.0024, rel=0.15)


def test_the_jump_beyond_one_token_is_fitted_and_kept_when_not_observable():
    cost = StepCost(a=0.01, b=0.01, c=0.0, d=0.0)
    for tokens in range(1, 12):
        for _ in range(10):
            cost.observe(tokens, 1, 0.036 + 0.0025 * tokens + 0.0064 * (tokens > 1))
    assert cost.d == pytest.approx(0.0064, abs=0.001) and cost.b == pytest.approx(0.0025, abs=0.0003)
    cost = StepCost(a=0.03, b=0.0025, c=0.0, d=0.0064)
    for _ in range(100):  # only one-token steps: d (and b, c) are not observable and stay
        cost.observe(1, 1, 0.04)
    assert cost.d == 0.0064 and cost.b == 0.0025 and cost.a + cost.b == pytest.approx(0.04, abs=0.001)


def test_one_noisy_entry_of_the_lone_table_does_not_raise_every_longer_forward():
    # measured at start-up on a busy machine: 3 tokens read high, 5 low
    cost = StepCost(lone={1: 0.076, 2: 0.151, 3: 0.184, 4: 0.164, 5: 0.134, 6: 0.161})
    steps = [cost.step(t, 1) for t in range(1, 8)]
    assert steps == sorted(steps)  # never cheaper than a shorter forward
    assert steps[2] == steps[3] == steps[4] == pytest.approx((0.184 + 0.164 + 0.134) / 3)  # pooled, not the max
    assert steps[5] == 0.161 and steps[6] >= 0.161
    cost.observe(3, 1, 0.134)  # the table moves, and its fit with it
    assert cost.step(3, 1) < steps[2]
