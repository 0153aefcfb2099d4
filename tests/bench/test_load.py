"""bench-load's summary: ratios paired within a repeat, intervals over repeats."""

import math

from bench.load import summarise


def _run(arm, c, rep, tok_s, p99=1.0):
    return dict(arm=arm, concurrency=c, repeat=rep, tok_s=tok_s, p99_s=p99)


def test_ratios_are_paired_within_a_repeat_and_intervals_span_the_repeats():
    # plain drifts 2x between repeats; the arm keeps 0.9x of it in each: the ratio must not see the drift
    results = [_run("plain", 4, 0, 100.0), _run("ngram:8", 4, 0, 90.0),
               _run("plain", 4, 1, 50.0), _run("ngram:8", 4, 1, 45.0),
               _run("plain", 4, 2, 80.0), _run("ngram:8", 4, 2, 76.0)]
    s = summarise(results, ["plain", "ngram:8"], [4])[4]
    point, low, high = s["ngram:8"]["ratio"]
    assert point == round((0.9 + 0.9 + 0.95) / 3, 4)
    assert low < 0.9 < 0.95 < high
    assert s["plain"]["ratio"][0] == 1.0
    assert s["ngram:8"]["tok_s"] == (90 + 45 + 76) / 3
    assert s["ngram:8"]["p99_ratio"][0] == 1.0  # every repeat's tail equal to plain's


def test_the_tail_is_compared_with_plains_in_the_same_repeat():
    results = [_run("plain", 16, 0, 100.0, p99=4.0), _run("ngram:8", 16, 0, 100.0, p99=5.0),
               _run("plain", 16, 1, 100.0, p99=8.0), _run("ngram:8", 16, 1, 100.0, p99=10.0)]
    point, low, high = summarise(results, ["plain", "ngram:8"], [16])[16]["ngram:8"]["p99_ratio"]
    assert point == 1.25 and low == high == 1.25  # 25% above plain's in both, though plain's moved 2x


def test_one_repeat_has_a_point_and_no_interval():
    s = summarise([_run("plain", 1, 0, 10.0), _run("eagle:6", 1, 0, 12.0, p99=3.0)], ["plain", "eagle:6"], [1])[1]
    point, low, high = s["eagle:6"]["ratio"]
    assert point == 1.2 and math.isnan(low) and math.isnan(high)
    assert s["eagle:6"]["p99_s"] == 3.0


def test_a_mode_names_its_step_stretch_or_keeps_the_configured_one():
    from bench.load import stretch_of

    assert stretch_of("ngram:8@0.05", None) == 0.05
    assert stretch_of("ngram:8@none", 0.03) is None
    assert stretch_of("eagle:6", 0.2) == 0.2
    assert stretch_of("plain", None) is None


def test_bystanders_are_the_requests_that_accepted_nothing_against_plain_on_the_same_slot():
    plain = _run("plain", 16, 0, 100.0) | dict(slots={"0-0": [4.0, 0], "1-0": [5.0, 0], "2-0": [6.0, 0]})
    spec = _run("ngram:8", 16, 0, 100.0) | dict(slots={"0-0": [2.0, 30], "1-0": [5.5, 0], "2-0": [6.6, 0]})
    point, low, high = summarise([plain, spec], ["plain", "ngram:8"], [16])[16]["ngram:8"]["bystanders"]
    assert point == 1.1 and math.isnan(low)  # the copier (2.0 against 4.0) is not a bystander; one repeat


def test_bystanders_interval_is_over_repeats_not_over_requests():
    """Every request of a repeat shares its spell: 1.2x in one repeat, 1.0x in the next.
    Over 40 requests an interval would read 1.1 [1.04, 1.16]; over the two repeats it
    cannot exclude 1.0."""
    runs = []
    for rep, slow in ((0, 1.2), (1, 1.0)):
        slots = {f"{c}-0": [4.0, 0] for c in range(20)}
        runs += [_run("plain", 16, rep, 100.0) | dict(slots=slots),
                 _run("ngram:8", 16, rep, 100.0) | dict(slots={k: [v[0] * slow, 0] for k, v in slots.items()})]
    point, low, high = summarise(runs, ["plain", "ngram:8"], [16])[16]["ngram:8"]["bystanders"]
    assert point == 1.1 and low < 1.0 < high


def test_the_draft_tokens_an_arm_spent_are_summed_over_its_repeats():
    """What an arm drafted, verified and accepted at a level says why it ran as it did
    (a draft that never reached verification under load costs only its drafting)."""
    runs = [_run("plain", 16, r, 100.0) | dict(drafted=0, verified=0, accepted=0) for r in range(2)] + \
           [_run("ngram:8", 16, r, 100.0) | dict(drafted=40 + r, verified=3, accepted=2 * r) for r in range(2)]
    s = summarise(runs + [_run("eagle:6", 16, 0, 99.0)], ["plain", "ngram:8", "eagle:6"], [16])[16]
    assert (s["ngram:8"]["drafted"], s["ngram:8"]["verified"], s["ngram:8"]["accepted"]) == (81, 6, 2)
    assert s["plain"]["drafted"] == 0 and s["eagle:6"]["verified"] is None  # a run recorded without the counts
