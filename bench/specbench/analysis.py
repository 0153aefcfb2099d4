"""The bench's arithmetic, pure: measurements in, figures out.

Speed is output tokens per second of request time: at temperature > 0 the arms
sample different continuations of different lengths, so totals are compared
per token (at temperature 0 outputs are identical and this equals the ratio of
total times). The oracle serves each request with the fixed arm that was
fastest per token for it in this run; with two passes or more, the held-out
oracle chooses each pass's arm on the others (held_out_picks): the first is
biased up by the noise it chooses on, the second is not, and the true
per-request best lies between them.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable

from bench.specbench.workload import ADAPTIVE

HELD_OUT = "oracle, held out"  # the oracle whose arms were chosen on other passes (held_out_picks)


def ok(m: dict) -> bool:
    return "error" not in m and m.get("output_tokens", 0) > 0


def decoding(ms: list[dict]) -> list[dict]:
    """Each measurement's decode phase: its tokens after the first over its time after
    the first token. No arm speeds the prefill, which comes first in every request (~23%
    of plain's request time at 128 tokens and prompts of up to ~800, most of it where a
    sampled answer ends after a few tokens): the same ratios over this phase are what
    decoding changes. Measurements of one token, or without a first token's time, are left out."""
    return [{**m, "output_tokens": m["output_tokens"] - 1, "latency_s": m["latency_s"] - m["ttft_s"]}
            for m in ms if ok(m) and m["output_tokens"] > 1 and 0 < m.get("ttft_s", 0.0) < m["latency_s"]]


def s_per_token(m: dict) -> float:
    return m["latency_s"] / m["output_tokens"]


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def totals(ms: list[dict], wall_s: float | None = None) -> dict:
    """Tokens, time and latency percentiles of some measurements. `wall_s`: the
    elapsed time of a concurrent run (else the sum of request times)."""
    good = [m for m in ms if ok(m)]
    tokens = sum(m["output_tokens"] for m in good)
    seconds = wall_s if wall_s is not None else sum(m["latency_s"] for m in good)
    lat = [m["latency_s"] for m in good]
    return dict(requests=len(ms), errors=len(ms) - len(good), tokens=tokens, seconds=round(seconds, 4),
                tok_s=tokens / seconds if seconds > 0 else 0.0,
                p50_s=round(pct(lat, 0.5), 4), p99_s=round(pct(lat, 0.99), 4))


def oracle_picks(ms: list[dict], fixed: list[str], unit: Callable[[dict], object] = lambda m: m["idx"]
                 ) -> dict[tuple, dict]:
    """(request, repeat) -> the fixed-arm measurement fastest per token for it; `unit`
    keys a request, as in held_out_picks."""
    best: dict[tuple, dict] = {}
    for m in ms:
        if m["mode"] in fixed and ok(m):
            k = (unit(m), m.get("repeat", 0))
            if k not in best or s_per_token(m) < s_per_token(best[k]):
                best[k] = m
    return best


def held_out_picks(ms: list[dict], fixed: list[str], unit: Callable[[dict], object] = lambda m: m["idx"]
                   ) -> list[dict] | None:
    """The oracle with its arms chosen on other passes: each (request, pass) served by
    the fixed arm fastest per token for that request on its *other* passes, and measured
    on this one. None unless every request ran at least two passes.

    `oracle_picks` chooses and measures on one measurement, so it takes the luckiest of
    near-equal draws: its expected speed is above the true per-request best (a greedy
    request timed twice under one arm, writing one text, differs by 7-12% on a 2-core
    EPYC: timing_noise). Chosen on one pass
    and measured on another, the choice is blind to the noise it is measured with, and
    the expected speed is at most the true best's. The true oracle lies between the two.
    `unit` keys a request (the bootstrap's resampled copies are distinct units)."""
    cells: dict[object, dict[str, dict[int, dict]]] = defaultdict(lambda: defaultdict(dict))
    for m in ms:
        if m["mode"] in fixed and ok(m):
            cells[unit(m)][m["mode"]][m.get("repeat", 0)] = m
    out = []
    for arms in cells.values():
        passes = sorted({rep for by_rep in arms.values() for rep in by_rep})
        if len(passes) < 2:
            return None
        for rep in passes:
            # each arm measured on this pass, by its mean seconds per token on the other passes
            elsewhere = {a: [s_per_token(m) for r, m in by_rep.items() if r != rep]
                         for a, by_rep in arms.items() if rep in by_rep}
            scored = [(sum(spt) / len(spt), fixed.index(a), a) for a, spt in elsewhere.items() if spt]
            if scored:
                out.append(arms[min(scored)[2]][rep])
    return out


def timing_noise(ms: list[dict]) -> dict | None:
    """How much one request's time moves when nothing but the timing differs: greedy
    requests served by adaptive with the arm of a fixed mode, writing that mode's text
    in the same pass, the sd of log(adaptive's time / the fixed mode's), over the
    request and over its decode phase (the oracle picks among timings this noisy).
    None with fewer than 3 such pairs."""
    fixed = {(m["idx"], m.get("repeat", 0), m["mode"]): m for m in ms
             if m["mode"] != ADAPTIVE and m.get("temperature") == 0 and ok(m)}
    pairs = [(m, f) for m in ms if m["mode"] == ADAPTIVE and m.get("temperature") == 0 and ok(m)
             for f in [fixed.get((m["idx"], m.get("repeat", 0), m.get("arm")))]
             if f is not None and f.get("text_sha") is not None and f.get("text_sha") == m.get("text_sha")]
    if len(pairs) < 3:
        return None
    whole = [math.log(a["latency_s"] / f["latency_s"]) for a, f in pairs]
    decode = [math.log((a["latency_s"] - a["ttft_s"]) / (f["latency_s"] - f["ttft_s"])) for a, f in pairs
              if 0 < a.get("ttft_s", 0) < a["latency_s"] and 0 < f.get("ttft_s", 0) < f["latency_s"]]
    return dict(pairs=len(pairs), sd_log_ratio=round(statistics.stdev(whole), 4),
                decode_sd_log_ratio=round(statistics.stdev(decode), 4) if len(decode) > 2 else None)


def compare(ms: list[dict], modes: list[str]) -> dict:
    """Concurrency 1: every mode's totals, the oracle's, and the ratios the
    targets are stated in."""
    fixed = [m for m in modes if m != ADAPTIVE]
    by_mode = {mode: totals([m for m in ms if m["mode"] == mode]) for mode in modes}
    picks = oracle_picks(ms, fixed)
    by_mode["oracle"] = totals(list(picks.values()))
    held_out = held_out_picks(ms, fixed)
    if held_out:
        by_mode[HELD_OUT] = totals(held_out)
    plain = by_mode.get("plain", {}).get("tok_s") or 0.0
    for t in by_mode.values():
        t["vs_plain"] = round(t["tok_s"] / plain, 4) if plain else None
    out = dict(modes=by_mode, oracle_arms=dict(Counter(m["mode"] for m in picks.values()).most_common()))
    if fixed:
        best = max(fixed, key=lambda mode: by_mode[mode]["tok_s"])
        out["best_fixed"] = best
        if ADAPTIVE in by_mode and by_mode[best]["tok_s"]:
            a = by_mode[ADAPTIVE]["tok_s"]
            out["adaptive_vs_best_fixed"] = round(a / by_mode[best]["tok_s"], 4)
            out["adaptive_vs_oracle"] = round(a / by_mode["oracle"]["tok_s"], 4) if by_mode["oracle"]["tok_s"] else None
            if by_mode.get(HELD_OUT, {}).get("tok_s"):
                out["adaptive_vs_held_out_oracle"] = round(a / by_mode[HELD_OUT]["tok_s"], 4)
            out["adaptive_arms"] = dict(Counter(m.get("arm") for m in ms if m["mode"] == ADAPTIVE and ok(m))
                                        .most_common())
    noise = timing_noise(ms)
    if noise:
        out["timing_noise"] = noise
    return out


def by_category(ms: list[dict], modes: list[str]) -> dict[str, dict]:
    cats = sorted({m["category"] for m in ms})
    return {c: compare([m for m in ms if m["category"] == c], modes) for c in cats}


def by_temperature(ms: list[dict], modes: list[str]) -> dict[str, dict]:
    temps = sorted({m["temperature"] for m in ms})
    return {f"{t:g}": compare([m for m in ms if m["temperature"] == t], modes) for t in temps}


def concurrency_table(runs: list[dict]) -> dict[str, dict[str, dict]]:
    """runs: [{concurrency, mode, wall_s, measurements}] (repeats summed)
    -> {concurrency: {mode: totals + vs_plain}}."""
    grouped: dict[int, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        grouped[run["concurrency"]][run["mode"]].append(run)
    out: dict[str, dict[str, dict]] = {}
    for c, modes in sorted(grouped.items()):
        row = {}
        for mode, rs in modes.items():
            row[mode] = totals([m for r in rs for m in r["measurements"]], wall_s=sum(r["wall_s"] for r in rs))
        plain = row.get("plain", {}).get("tok_s")
        for t in row.values():
            t["vs_plain"] = round(t["tok_s"] / plain, 4) if plain else None
        out[str(c)] = row
    return out


def greedy_mismatches(ms: list[dict]) -> list[dict]:
    """Temperature-0 requests whose outputs differ between modes (at one
    concurrency level and repeat). Lossless decoding makes this empty."""
    groups: dict[tuple, dict[str, str]] = defaultdict(dict)
    for m in ms:
        if m["temperature"] == 0 and ok(m):
            groups[(m["concurrency"], m["idx"], m.get("repeat", 0))][m["mode"]] = m["text_sha"]
    bad = []
    for (c, idx, rep), shas in sorted(groups.items()):
        if len(set(shas.values())) > 1:
            bad.append(dict(concurrency=c, idx=idx, repeat=rep, outputs=shas))
    return bad


def sampled_lookup_mismatches(ms: list[dict], lookup: Callable[[str], bool]) -> tuple[int, list[dict]]:
    """Sampled requests (temperature > 0) whose outputs differ between the
    measurements served plain or by prompt lookup (`lookup(arm)`), whichever mode
    asked for them, adaptive included. The built-in engine draws the target's
    tokens by seed and output position (engines/sampling.py: Draws), so they all
    write one text; an engine that draws otherwise need not, so this is reported,
    not failed on. Returns (requests compared, the ones that differ)."""
    groups: dict[tuple, dict[str, str]] = defaultdict(dict)
    for m in ms:
        arm = m.get("arm") or m["mode"]
        if m["temperature"] > 0 and ok(m) and (arm == "plain" or lookup(arm)):
            groups[(m["concurrency"], m["idx"], m.get("repeat", 0))][m["mode"]] = m["text_sha"]
    compared = {k: shas for k, shas in groups.items() if len(shas) > 1}
    bad = [dict(concurrency=c, idx=idx, repeat=rep, outputs=shas) for (c, idx, rep), shas in sorted(compared.items())
           if len(set(shas.values())) > 1]
    return len(compared), bad


def acceptance(ms: list[dict]) -> dict[str, dict[str, dict]]:
    """Acceptance (accepted / drafted) by category and temperature, per draft,
    over speculative fixed-arm requests."""
    acc: dict[str, dict[str, dict[str, list[int]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(
        lambda: [0, 0])))
    for m in ms:
        if ok(m) and m["mode"] not in ("plain", ADAPTIVE) and m.get("drafted"):
            draft = m["mode"].split(":")[0]
            cell = acc[draft][m["category"]][f"{m['temperature']:g}"]
            cell[0] += m["accepted"]
            cell[1] += m["drafted"]
    return {d: {c: {t: round(a / n, 4) for t, (a, n) in temps.items()} for c, temps in cats.items()}
            for d, cats in acc.items()}


def per_request_rates(ms: list[dict], fixed: list[str]) -> tuple[dict[int, float], dict[int, float]]:
    """Per workload item: the oracle's and plain's seconds per token (mean over repeats)."""
    picks = oracle_picks(ms, fixed)
    o, p = defaultdict(list), defaultdict(list)
    for (idx, _), m in picks.items():
        o[idx].append(s_per_token(m))
    for m in ms:
        if m["mode"] == "plain" and ok(m):
            p[m["idx"]].append(s_per_token(m))
    mean = lambda d: {k: sum(v) / len(v) for k, v in d.items()}  # noqa: E731
    return mean(o), mean(p)


def learning_curve(stream: list[dict], oracle_spt: dict[int, float], plain_spt: dict[int, float],
                   window: int) -> dict:
    """Rolling speed of the adaptive stream relative to the oracle and to plain:
    Σ tokens x reference s/token / Σ actual seconds over the last `window`
    requests served."""
    served, vs_oracle, vs_plain = [], [], []
    for k in range(len(stream)):
        win = [m for m in stream[max(0, k + 1 - window):k + 1] if ok(m) and m["idx"] in oracle_spt]
        actual = sum(m["latency_s"] for m in win)
        if not win or actual <= 0:
            continue
        served.append(k + 1)
        vs_oracle.append(round(sum(m["output_tokens"] * oracle_spt[m["idx"]] for m in win) / actual, 4))
        vs_plain.append(round(sum(m["output_tokens"] * plain_spt.get(m["idx"], 0) for m in win) / actual, 4))
    reached = next((n for n, v in zip(served, vs_oracle) if n >= window and v >= 0.9), None)
    return dict(window=window, served=served, vs_oracle=vs_oracle, vs_plain=vs_plain, reached_0_9_at=reached,
                final_vs_oracle=vs_oracle[-1] if vs_oracle else None,
                final_vs_plain=vs_plain[-1] if vs_plain else None,
                arms=[m.get("arm") for m in stream], policy_versions=[m.get("policy_version") for m in stream])


def targets(intervals_c1: dict, intervals_high: dict, curve: dict | None, high_c: int) -> list[dict]:
    """The targets, each judged on its 95% interval (bench/specbench/intervals.py)."""
    from bench.specbench.intervals import verdict

    intervals_c1, intervals_high = intervals_c1 or {}, intervals_high or {}
    out = []
    for key, goal, text in (("adaptive/plain", 1.3, "c=1: adaptive ≥ 1.3x plain"),
                            ("adaptive/best_fixed", 1.15, "c=1: adaptive ≥ 1.15x the best fixed configuration"),
                            ("adaptive/oracle", 0.95, "c=1: adaptive ≥ 0.95x the per-request oracle"),
                            ("adaptive/oracle, held out", 0.95, "c=1: adaptive ≥ 0.95x the per-request oracle, "
                                                                "its arms chosen on other passes")):
        if key in intervals_c1:
            out.append(dict(target=text, measured=intervals_c1[key], verdict=verdict(intervals_c1[key], goal)))
    for key, goal, text in (("adaptive/plain", 1.0, f"c={high_c}: adaptive ≥ 1.0x plain"),
                            ("adaptive/best_fixed", 1.0, f"c={high_c}: adaptive ≥ every fixed configuration")):
        if key in intervals_high:
            out.append(dict(target=text, measured=intervals_high[key], verdict=verdict(intervals_high[key], goal)))
    if curve and curve.get("served"):
        n = curve["reached_0_9_at"]
        out.append(dict(target="cold start reaches 0.9x the oracle within 150 requests", measured=[n, n, n],
                        verdict="met" if n is not None and n <= 150 else "missed"))
    return out
