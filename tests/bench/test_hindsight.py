"""bench-engine's hindsight: the adaptive mode against the draft's best fixed γ,
with an interval over prompts."""

import math
import random

from bench.hindsight import differing_line, hindsight, over_plain, over_plain_line
from bench.specbench.intervals import verdict

FIXED = ("ngram:1/fixed", "ngram:2/fixed")


def _runs(speeds: dict[str, list[float]], cat: str = "writing", samples: int = 1) -> dict:
    """speeds[mode][p]: tokens per second on prompt p (100 tokens a run)."""
    return {f"0.7|{cat}|{mode}": [dict(tokens=100, seconds=100 / v, prompt=str(p), sample=k)
                                  for p, v in enumerate(vs) for k in range(samples)]
            for mode, vs in speeds.items()}


def _table(runs: dict) -> dict:
    table: dict = {}
    for key, rs in runs.items():
        _, cat, mode = key.split("|")
        table.setdefault(cat, {})[mode] = sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs)
    for row in table.values():
        plain = row.pop("plain")
        for mode in row:
            row[mode] = dict(vs_plain=row[mode] / plain)
    return table


def test_an_adaptive_mode_ahead_on_every_prompt_is_met_with_a_tight_interval():
    rng = random.Random(1)
    base = [rng.uniform(30, 60) for _ in range(8)]  # prompts differ 2x; the ratio on each does not
    runs = _runs({"plain": base, FIXED[0]: [1.1 * b for b in base], FIXED[1]: [1.05 * b for b in base],
                  "ngram:8": [1.155 * b for b in base]})
    h = hindsight(_table(runs), runs, "0.7", "ngram", "ngram:8")["writing"]
    assert h["best_fixed"] == FIXED[0]
    point, low, high = h["interval"]
    assert point == round(1.05, 4) and low == high == point  # the same 5% on every prompt: no doubt
    assert verdict(h["interval"], 0.97) == "met"


def test_text_luck_widens_the_interval_and_the_best_fixed_is_chosen_in_every_draw():
    # every mode is plain's speed on average, but each prompt's text gives any mode a lucky or unlucky run
    rng = random.Random(2)
    runs = _runs({m: [40 * rng.choice((0.8, 1.25)) for _ in range(6)] for m in ("plain", *FIXED, "ngram:8")})
    h = hindsight(_table(runs), runs, "0.7", "ngram", "ngram:8")["writing"]
    point, low, high = h["interval"]
    assert low < point < high and high - low > 0.2
    assert point == round(h["ratio"], 4)


def test_categories_are_resampled_apart_and_all_pools_them():
    # two categories, adaptive 0.9x in one and 1.1x in the other: ALL spans both, each stays put
    a = _runs({"plain": [40.0] * 4, FIXED[0]: [40.0] * 4, FIXED[1]: [40.0] * 4, "ngram:8": [36.0] * 4}, "qa")
    b = _runs({"plain": [40.0] * 4, FIXED[0]: [40.0] * 4, FIXED[1]: [40.0] * 4, "ngram:8": [44.0] * 4}, "coding")
    runs = {**a, **b}
    table = _table(runs)
    table["ALL"] = _table({f"0.7|ALL|{m}": a[f"0.7|qa|{m}"] + b[f"0.7|coding|{m}"]
                           for m in ("plain", *FIXED, "ngram:8")})["ALL"]
    h = hindsight(table, runs, "0.7", "ngram", "ngram:8")
    assert h["qa"]["interval"][1:] == [0.9, 0.9]
    assert verdict(h["qa"]["interval"], 0.97) == "missed"
    assert verdict(h["coding"]["interval"], 0.97) == "met"
    # pooled over both, and each draw keeps four prompts of each category: no spread between them
    point, low, high = h["ALL"]["interval"]
    assert point == low == high == round(2 / (1 / 36 + 1 / 44) / 40, 4)


def test_runs_without_prompts_keep_a_point_and_no_interval():
    runs = _runs({"plain": [40.0, 50.0], FIXED[0]: [44.0, 55.0], "ngram:8": [46.0, 52.0]})
    for rs in runs.values():
        for r in rs:
            del r["prompt"]
    point, low, high = hindsight(_table(runs), runs, "0.7", "ngram", "ngram:8")["writing"]["interval"]
    assert math.isfinite(point) and math.isnan(low) and math.isnan(high)


def test_where_the_best_fixed_gamma_differs_between_prompts_the_adaptive_mode_must_beat_the_best_one():
    # γ=1 wins on copy-poor prompts, γ=2 on copy-rich ones; the adaptive mode matches the winner on each
    poor, rich = [40.0] * 4, [40.0] * 4
    runs = _runs({"plain": poor + rich, FIXED[0]: [48.0] * 4 + [44.0] * 4, FIXED[1]: [42.0] * 4 + [52.0] * 4,
                  "ngram:8": [48.0] * 4 + [52.0] * 4}, samples=2)
    h = hindsight(_table(runs), runs, "0.7", "ngram", "ngram:8")
    assert h["writing"]["best_per_prompt"] == {FIXED[0]: 4, FIXED[1]: 4}
    assert h["writing"]["ratio"] > 1.0 and h["writing"]["interval"][1] > 1.0
    # each prompt at its own best (48 and 52 tok/s) over all at γ=2 (42 and 52), by total time
    at_own, at_best = 800 / (400 / 48 + 400 / 52), 800 / (400 / 42 + 400 / 52)
    assert h["writing"]["per_prompt_x"] == round(at_own / at_best, 4)
    line = differing_line("ngram:8", h)
    assert "better in 1/1" in line and "met 1" in line and "ngram:1×4 ngram:2×4" in line
    assert f"each at its own {at_own / at_best:.3f}x" in line
    # one γ best everywhere: nothing to beat
    same = _runs({"plain": [40.0] * 4, FIXED[0]: [48.0] * 4, FIXED[1]: [44.0] * 4, "ngram:8": [47.0] * 4})
    h = hindsight(_table(same), same, "0.7", "ngram", "ngram:8")
    assert h["writing"]["best_per_prompt"] == {FIXED[0]: 4} and h["writing"]["per_prompt_x"] == 1.0
    assert "one fixed γ was best" in differing_line("ngram:8", h)
    for rs in same.values():
        for r in rs:
            del r["prompt"]
    h = hindsight(_table(same), same, "0.7", "ngram", "ngram:8")
    assert h["writing"]["best_per_prompt"] == {} and "no prompts kept" in differing_line("ngram:8", h)
    assert math.isnan(h["writing"]["per_prompt_x"])


def test_a_mode_against_plain_is_judged_on_its_interval_over_prompts():
    # qa: 0.95x plain on every prompt (missed, however few prompts); coding: lucky and unlucky texts
    # around plain's speed (undecided); extraction: 1.2x on every prompt (met)
    rng = random.Random(3)
    base = [rng.uniform(30, 60) for _ in range(6)]
    qa = _runs({"plain": base, "ngram:8": [0.95 * b for b in base]}, "qa")
    coding = _runs({"plain": base, "ngram:8": [b * rng.choice((0.8, 1.25)) for b in base]}, "coding")
    extraction = _runs({"plain": base, "ngram:8": [1.2 * b for b in base]}, "extraction")
    runs = {**qa, **coding, **extraction}
    ratios = over_plain(_table(runs), runs, "0.7", "ngram:8")
    assert ratios["qa"] == [0.95, 0.95, 0.95] and verdict(ratios["qa"], 0.97) == "missed"
    assert ratios["extraction"][1] == ratios["extraction"][2] == 1.2
    low, high = ratios["coding"][1:]
    assert low < 0.97 < high and verdict(ratios["coding"], 0.97) == "undecided"
    line = over_plain_line("ngram:8", ratios)
    assert f"at least 0.97x in {1 + (ratios['coding'][0] >= 0.97)}/3" in line
    assert "(interval: met 1, undecided 1, missed 1)" in line


def test_by_the_decode_phase_an_answer_ending_early_is_not_a_slowdown():
    # on prompt 0 the mode's sampled answer ends after 3 tokens: its run is mostly the prompt's prefill (1 s)
    def run(p, tokens, decode_rate):
        return dict(tokens=tokens, seconds=1.0 + (tokens - 1) / decode_rate, decode_tokens=tokens - 1,
                    decode_s=(tokens - 1) / decode_rate, prompt=str(p), sample=0)
    runs = {"0.7|qa|plain": [run(p, 100, 50.0) for p in range(4)],
            "0.7|qa|ngram:8": [run(0, 3, 55.0)] + [run(p, 100, 55.0) for p in range(1, 4)]}
    table = {"qa": {"ngram:8": dict(vs_plain=1.0)}}  # the point; the intervals come from the runs
    by_request = over_plain(table, runs, "0.7", "ngram:8")["qa"]
    by_decode = over_plain(table, runs, "0.7", "ngram:8", "decode")["qa"]
    assert by_request[1] < 0.97 and verdict(by_request, 0.97) != "met"
    assert by_decode[1] == by_decode[2] == 1.1  # 1.1x on every prompt, whatever its length
    # runs of an older bench, without the decode phase, keep a point and no interval
    for rs in runs.values():
        for r in rs:
            del r["decode_s"]
    assert math.isnan(over_plain(table, runs, "0.7", "ngram:8", "decode")["qa"][1])
