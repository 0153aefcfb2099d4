"""bench-engine's hindsight: the adaptive mode against the draft's best fixed γ
per category, with a 95% interval from a bootstrap over prompts, and where the
best fixed γ differs between a category's prompts; and each adaptive mode against
plain, on the same kind of interval.

Speed is each run's tokens over its time (`request`), or its tokens after the first
over its time after the first token (`decode`: what a decoding mode changes; a
sampled answer that ends after a few tokens is mostly its prompt's prefill, which
no mode speeds, and would read as a slowdown of the mode that wrote it)."""

from __future__ import annotations

import random
from collections import defaultdict

from bench.specbench.intervals import BOOTSTRAP, percentile_interval, verdict

SPEEDS = {"request": ("tokens", "seconds"), "decode": ("decode_tokens", "decode_s")}  # a run's fields


def hindsight(table: dict, runs: dict, temp: str, draft: str, adaptive: str, speed: str = "request") -> dict:
    """Per category (and ALL): the draft's best fixed γ in hindsight against its
    adaptive mode, with `interval` [point, low, high] over prompts, and how many
    prompts each fixed γ was best on (`best_per_prompt`: where the best γ differs
    between prompts, no fixed γ serves them all, and the adaptive mode should beat
    the best of them), and what choosing the fixed γ per prompt would give over the
    category's best one (`per_prompt_x`: the room a per-prompt choice has there)."""
    out = {}
    for cat, row in table.items():
        fixed = {m: v["vs_plain"] for m, v in row.items() if m.startswith(draft + ":") and m.endswith("/fixed")}
        if not fixed or adaptive not in row:
            continue
        best = max(fixed, key=fixed.get)
        ratio = row[adaptive]["vs_plain"] / fixed[best]
        per = _per_prompt(runs, temp, cat, [*fixed, adaptive], speed)
        out[cat] = dict(best_fixed=best, best_fixed_x=fixed[best], adaptive_x=row[adaptive]["vs_plain"],
                        ratio=ratio, interval=_ratio_interval(per, list(fixed), adaptive, ratio),
                        best_per_prompt=_best_per_prompt(per, list(fixed)),
                        per_prompt_x=_per_prompt_x(per, list(fixed), best))
    return out


def _per_prompt(runs: dict, temp: str, cat: str, modes: list[str], speed: str = "request") -> dict | None:
    """(category, prompt) -> mode -> [tokens, seconds] over its samples, as `speed`
    counts them; None for runs of an older bench, which kept no prompt to pair them
    by (or no decode phase)."""
    tokens, seconds = SPEEDS[speed]
    per: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0]))
    for key, rs in runs.items():
        t, c, mode = key.split("|")
        if t != temp or (cat != "ALL" and c != cat) or mode not in modes:
            continue
        for r in rs:
            if "prompt" not in r or seconds not in r:
                return None
            acc = per[(c, r["prompt"])][mode]
            acc[0] += r[tokens]
            acc[1] += r[seconds]
    return per


def _fastest(modes: dict[str, list[float]], fixed: list[str]) -> str | None:
    """One prompt's fastest fixed mode over its samples (None: it ran none)."""
    rates = {m: tok / sec for m, (tok, sec) in modes.items() if m in fixed and sec > 0}
    return max(rates, key=rates.get) if rates else None


def _best_per_prompt(per: dict | None, fixed: list[str]) -> dict[str, int]:
    """How many prompts each fixed mode was the fastest on (over its samples)."""
    wins: dict[str, int] = defaultdict(int)
    for modes in (per or {}).values():
        if (m := _fastest(modes, fixed)) is not None:
            wins[m] += 1
    return dict(sorted(wins.items()))


def _per_prompt_x(per: dict | None, fixed: list[str], best: str) -> float:
    """Each prompt at its own fastest fixed mode, over every prompt at `best` (NaN without prompts)."""
    chosen, at_best = [0.0, 0.0], [0.0, 0.0]
    for modes in (per or {}).values():
        if modes.get(best, (0, 0))[1] <= 0:
            continue
        for acc, m in ((chosen, _fastest(modes, fixed)), (at_best, best)):
            acc[0] += modes[m][0]
            acc[1] += modes[m][1]
    if not at_best[1]:
        return float("nan")
    return round((chosen[0] / chosen[1]) / (at_best[0] / at_best[1]), 4)


def over_plain(table: dict, runs: dict, temp: str, mode: str, speed: str = "request") -> dict[str, list[float]]:
    """Per category (and ALL): `mode`'s speed over plain's, [point, low, high] with
    prompts resampled (a draft that must never cost more than 3% against plain is
    judged on the low end, not on three prompts' point)."""
    return {cat: _ratio_interval(_per_prompt(runs, temp, cat, ["plain", mode], speed), ["plain"], mode,
                                 row[mode]["vs_plain"])
            for cat, row in table.items() if row.get(mode, {}).get("vs_plain")}


def _ratio_interval(per: dict | None, fixed: list[str], adaptive: str,
                    point: float, b: int = BOOTSTRAP, seed: int = 0) -> list[float]:
    """[point, low, high]: 2.5th and 97.5th percentiles of the adaptive mode's rate over
    the best of the `fixed` modes' (plain alone: over plain), prompts resampled within
    each category."""
    if per is None:
        return [round(point, 4), float("nan"), float("nan")]
    strata: dict[str, list[dict]] = defaultdict(list)
    for (c, _), modes in per.items():
        strata[c].append(modes)
    rng, draws = random.Random(seed), []
    for _ in range(b):
        total: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for prompts in strata.values():
            for _ in prompts:
                for mode, (tok, sec) in rng.choice(prompts).items():
                    total[mode][0] += tok
                    total[mode][1] += sec
        rate = {m: tok / sec for m, (tok, sec) in total.items() if sec > 0}
        if adaptive in rate and any(m in rate for m in fixed):
            draws.append(rate[adaptive] / max(rate[m] for m in fixed if m in rate))
    if len(draws) < 2:
        return [round(point, 4), float("nan"), float("nan")]
    return percentile_interval(point, draws)


def hindsight_line(adaptive: str, draft: str, h: dict) -> str:
    """hindsight()'s figures: how many categories the adaptive mode is within 3% of (or
    better than) the draft's best fixed γ in, by the point and by the interval."""
    cats = {c: v for c, v in h.items() if c != "ALL"}
    verdicts = [verdict(v["interval"], 0.97) for v in cats.values()]
    return (f"{adaptive} (adaptive) vs {draft}'s best fixed γ in hindsight, per category [95% interval over "
            f"prompts]: within 3% or better in {sum(v['ratio'] >= 0.97 for v in cats.values())}/{len(cats)} "
            f"(interval: met {verdicts.count('met')}, undecided {verdicts.count('undecided')}, missed "
            f"{verdicts.count('missed')}); " + ", ".join(
                f"{c} {v['ratio']:.2f} [{v['interval'][1]:.2f}, {v['interval'][2]:.2f}]" for c, v in h.items()))


def differing_line(adaptive: str, cats: dict) -> str:
    """Where the best fixed γ differs between a category's prompts, the adaptive
    mode should beat the category's best one: a verdict against 1.0 on its interval,
    beside what each prompt at its own best fixed γ gives (how much room there is
    to beat it; a few percent is within a few prompts' noise). Sampled, a prompt's
    best γ is partly its luckiest text: take it with samples."""
    differ = {c: v for c, v in cats.items() if len(v["best_per_prompt"]) > 1}
    if not any(v["best_per_prompt"] for v in cats.values()):
        return f"{adaptive}: no prompts kept with the runs (an older bench), so no best γ per prompt"
    if not differ:
        return f"{adaptive}: one fixed γ was best on every prompt of every category"
    verdicts = [verdict(v["interval"], 1.0) for v in differ.values()]
    return (f"{adaptive} where the best fixed γ differs between prompts: better in "
            f"{sum(v['ratio'] > 1.0 for v in differ.values())}/{len(differ)} (interval: met "
            f"{verdicts.count('met')}, undecided {verdicts.count('undecided')}, missed {verdicts.count('missed')}); "
            + ", ".join(f"{c} {v['ratio']:.2f} (best per prompt: " +
                        " ".join(f"{m.removesuffix('/fixed')}×{n}" for m, n in v["best_per_prompt"].items()) +
                        f"; each at its own {v['per_prompt_x']:.3f}x)" for c, v in differ.items()))


def over_plain_line(mode: str, ratios: dict[str, list[float]], floor: float = 0.97) -> str:
    """An adaptive mode against plain per category: how many are no more than 3% below
    it, by the point and by the interval."""
    cats = {c: v for c, v in ratios.items() if c != "ALL"}
    verdicts = [verdict(v, floor) for v in cats.values()]
    return (f"{mode} over plain, per category [95% interval over prompts]: at least {floor:g}x in "
            f"{sum(v[0] >= floor for v in cats.values())}/{len(cats)} (interval: met {verdicts.count('met')}, "
            f"undecided {verdicts.count('undecided')}, missed {verdicts.count('missed')}); "
            + ", ".join(f"{c} {v[0]:.2f} [{v[1]:.2f}, {v[2]:.2f}]" for c, v in ratios.items()))
