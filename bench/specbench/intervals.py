"""Telling signal from noise: 95% intervals for the bench's ratios.

Concurrency 1: a bootstrap over requests (each request's every mode and repeat
resampled together, so a ratio keeps its pairing). Higher concurrency: each
rotated repeat gives one ratio; the interval is a t interval over repeats.
A target holds when the interval's lower end clears it, is missed when its
upper end falls short, and is undecided in between.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict

from bench.specbench.analysis import held_out_picks, ok, oracle_picks
from bench.specbench.workload import ADAPTIVE  # not the runner: the engine bench needs no gRPC

BOOTSTRAP = 1000
# two-sided 95% t quantiles by degrees of freedom
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}


def _rate(cells: list[dict]) -> float:
    tokens = sum(m["output_tokens"] for m in cells)
    seconds = sum(m["latency_s"] for m in cells)
    return tokens / seconds if seconds > 0 else float("nan")


def c1_ratios(ms: list[dict], fixed: list[str]) -> dict[str, float]:
    """The concurrency-1 ratios of one (re)sample: every mode over plain, adaptive
    over the best fixed mode and over the oracle (and, with two passes or more, over
    the oracle whose arms were chosen on other passes: analysis.held_out_picks)."""
    by_mode: dict[str, list[dict]] = defaultdict(list)
    for m in ms:
        by_mode[m["mode"]].append(m)
    rate = {mode: _rate(cells) for mode, cells in by_mode.items()}

    def unit(m: dict) -> tuple:  # a request drawn twice by the bootstrap is two requests
        return m["idx"], m.get("boot", 0)

    rate["oracle"] = _rate(list(oracle_picks(ms, fixed, unit).values()))
    held_out = held_out_picks(ms, fixed, unit=unit)
    plain = rate.get("plain", float("nan"))
    out = {f"{mode}/plain": r / plain for mode, r in rate.items() if mode != "plain"}
    top = max((rate[m] for m in fixed if m in rate), default=float("nan"))
    if ADAPTIVE in rate:
        out["adaptive/best_fixed"] = rate[ADAPTIVE] / top
        out["adaptive/oracle"] = rate[ADAPTIVE] / rate["oracle"]
    if held_out:
        held = _rate(held_out)
        out["oracle, held out/plain"] = held / plain
        if ADAPTIVE in rate:
            out["adaptive/oracle, held out"] = rate[ADAPTIVE] / held
    return out


def bootstrap_c1(ms: list[dict], fixed: list[str], seed: int = 0, b: int = BOOTSTRAP) -> dict[str, list[float]]:
    """ratio -> [point, low, high] (2.5th and 97.5th percentiles of the bootstrap)."""
    good = [m for m in ms if ok(m)]
    by_req: dict[int, list[dict]] = defaultdict(list)
    for m in good:
        by_req[m["idx"]].append(m)
    ids = sorted(by_req)
    if not ids:
        return {}
    point = c1_ratios(good, fixed)
    rng = random.Random(seed)
    draws: dict[str, list[float]] = defaultdict(list)
    for _ in range(b):
        sample = []
        for n, i in enumerate(rng.choice(ids) for _ in ids):
            sample += [{**m, "boot": n} for m in by_req[i]]  # a request drawn twice counts twice
        for k, v in c1_ratios(sample, fixed).items():
            if math.isfinite(v):
                draws[k].append(v)
    return {k: percentile_interval(v, draws[k]) for k, v in point.items() if draws.get(k)}


def percentile_interval(point: float, draws: list[float]) -> list[float]:
    """[point, low, high]: the 2.5th and 97.5th percentiles of bootstrap draws."""
    d = sorted(draws)
    return [round(point, 4), round(d[int(0.025 * len(d))], 4), round(d[min(len(d) - 1, int(0.975 * len(d)))], 4)]


def repeats_interval(values: list[float]) -> list[float]:
    """[mean, low, high]: a t interval over per-repeat ratios (one repeat: no interval)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return [round(mean, 4), float("nan"), float("nan")]
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = _T95.get(n - 1, 2.0) * sd / math.sqrt(n)
    return [round(mean, 4), round(mean - half, 4), round(mean + half, 4)]


def per_repeat_ratios(runs: list[dict], level: int) -> dict[str, list[float]]:
    """At one concurrency level: per repeat, every mode's throughput over plain's,
    and adaptive's over the best fixed configuration: the one fastest against plain
    over all repeats, chosen once in hindsight as at concurrency 1. (Taking the
    fastest fixed mode of each repeat instead, `adaptive/each_repeat_best`, compares
    adaptive with the luckiest of several near-equal draws every time: biased
    against it by about a repeat's spread. Kept beside it, not judged.)"""
    reps: dict[int, dict[str, float]] = defaultdict(dict)
    for r in runs:
        if r["concurrency"] != level:
            continue
        good = [m for m in r["measurements"] if "error" not in m]
        tokens = sum(m.get("output_tokens", 0) for m in good)
        reps[r["repeat"]][r["mode"]] = tokens / r["wall_s"] if r["wall_s"] > 0 else float("nan")
    out: dict[str, list[float]] = defaultdict(list)
    paired = [modes for modes in reps.values() if modes.get("plain")]
    for modes in paired:
        for mode, v in modes.items():
            if mode != "plain":
                out[f"{mode}/plain"].append(v / modes["plain"])
    fixed = {m for modes in paired for m in modes} - {ADAPTIVE}
    if not fixed or not any(ADAPTIVE in modes for modes in paired):
        return out
    # plain's ratio is 1 in every repeat; a mode missing from a repeat is not compared there
    mean = {f: 1.0 if f == "plain" else sum(out[f"{f}/plain"]) / len(out[f"{f}/plain"]) for f in fixed}
    best = max(sorted(fixed), key=mean.__getitem__)
    for modes in paired:
        if ADAPTIVE in modes and best in modes:
            out["adaptive/best_fixed"].append(modes[ADAPTIVE] / modes[best])
        if ADAPTIVE in modes:
            out["adaptive/each_repeat_best"].append(modes[ADAPTIVE] / max(v for m, v in modes.items() if m != ADAPTIVE))
    return out


def verdict(interval: list[float], target: float) -> str:
    """'met' (the lower end clears the target), 'missed' (the upper end falls short), or 'undecided'."""
    point, low, high = interval
    if math.isnan(low):
        return "met (one pass)" if point >= target else "missed (one pass)"
    if low >= target:
        return "met"
    if high < target:
        return "missed"
    return "undecided"
