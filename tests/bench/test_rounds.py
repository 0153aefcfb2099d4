"""bench/rounds.py: every speculative round is counted by what happened to it,
and the ratios are taken against the first mode."""

from collections import Counter

from bench.rounds import kinds, main, over, report, run
from tests.helpers import tiny_engine


def test_rounds_are_counted_by_what_happened_to_them():
    # nothing drafted; drafted 3 and none verified; 2 of 2 verified; 1 of 4 verified
    assert kinds([0, 3, 2, 4], [0, 0, 2, 1]) == Counter({"none": 1, "declined": 1, "2": 1, "1": 1})


def test_a_run_counts_every_speculative_round_against_the_first_mode():
    engine = tiny_engine()
    try:
        rows = [{"question_id": i, "category": c, "turns": [t]}
                for i, (c, t) in enumerate([("coding", "w1 w2 w3 w1 w2 w3 w1 w2"), ("qa", "hello world the cat sat")])]
        modes = ["ngram:2/fixed", "ngram:4", "plain"]
        out = run(engine, rows, modes, temperature=0.0, max_tokens=12, repeats=2)
    finally:
        engine.close()
    assert out["plain"]["rounds"] == Counter()  # plain decoding has no speculative rounds
    assert out["ngram:2/fixed"]["rounds"]["declined"] == 0  # a fixed γ verifies whatever it drafts
    assert all(sum(out[m]["rounds"].values()) > 0 for m in modes[:2])
    # greedy and lossless: every mode emits the same tokens, prompt by prompt
    assert (out["ngram:4"]["tokens"] == out["plain"]["tokens"]).all() and out["plain"]["tokens"].min() > 0
    assert over(out[modes[0]], out[modes[0]]) == [1.0, 1.0, 1.0]
    lines = report(out, modes)
    assert lines[0].startswith("ngram:2/fixed    1.000x ngram:2/fixed [1.000, 1.000]")
    assert lines[2].endswith("no speculative rounds")


def test_a_mode_it_cannot_parse_is_refused_before_any_model_is_loaded(capsys):
    assert main(["--modes", "eagle:6/sometimes"]) == 2
    assert "eagle:6/sometimes" in capsys.readouterr().err


def test_modes_error_names_the_first_mode_it_refuses():
    from bench.engine import modes_error

    assert modes_error(["plain", "ngram:4", "eagle:6/fixed"]) is None
    assert "eagle:6/sometimes" in modes_error(["plain", "eagle:6/sometimes", "ngram:x"])
