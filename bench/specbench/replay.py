"""Replay a `specgate bench` run's concurrency-1 requests through a policy, offline.

At concurrency 1 every request was measured under every fixed arm, so what
any policy would have realised on that run is known without running it: each
request's tokens and seconds under the arm it chooses, averaged over its
choice probabilities (Thompson sampling draws an arm at random). The result
is the policy's speed over plain, the best fixed arm and the per-request
oracle (and, for a run of two passes or more, the held-out oracle), as the
bench reports them, over every pass, in seconds instead of the bench's 15-40
minutes: a prior or a learned model can be judged on a run it did not see.

`--fit-prior` also fits each fixed draft's prior intercept and temperature
slope (policy/model.py::prior_draft) to the runs given, each draft on its own. A
fit is a candidate, not a verdict: 31-39 noisy requests leave the drafts' levels
loosely identified, and a fit that prices each draft's speed well can still
rank them badly (one put the head alone above the hybrid that contains it).
`--fit-prior-value` chooses them for every draft together by what the policy
they make would have realised, averaged over the runs, instead. Fit on some
runs; judge by replaying others.

Its limits: the menu is the run's fixed drafts (each with the engine adapting
γ within its bound, so a draft chosen at any γ reads as that draft's measured
arm), decisions see no load and no live guard, and the ratios carry the run's
own noise (a bench run gives their intervals).
"""

from __future__ import annotations

import json
import random
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from bench.specbench.analysis import held_out_picks, ok, oracle_picks, s_per_token, timing_noise, totals
from bench.specbench.workload import ADAPTIVE, WorkloadError, build_workload, read_rows


def measured(bench: dict) -> dict[tuple[int, str], dict[int, dict]]:
    """(request idx, fixed mode) -> its concurrency-1 measurements by pass (a run with
    two passes replays both: a choice is priced by its arm's every pass)."""
    out: dict[tuple[int, str], dict[int, dict]] = {}
    for m in bench["measurements"]:
        if m.get("concurrency") == 1 and m["mode"] != ADAPTIVE and ok(m):
            out.setdefault((m["idx"], m["mode"]), {}).setdefault(m.get("repeat", 0), m)
    return out


def first_passes(bench: dict) -> dict[tuple[int, str], dict]:
    """(request idx, fixed mode) -> its first pass's concurrency-1 measurement (what
    `specgate bench-gate` draws a request's outcome from, one run at a time)."""
    return {k: by_pass[min(by_pass)] for k, by_pass in measured(bench).items()}


def workload_of(bench: dict, data: str | None = None):
    """The run's requests with their prompts (bench.json keeps only their sizes)."""
    st = bench["settings"]
    requests = build_workload(read_rows(data or st["data"]), st["per_category"] or None, st["temperatures"],
                              st["seed"], skip=st.get("skip", 0))  # skip: absent in runs recorded before it
    recorded = {r["idx"]: r["question_id"] for r in bench["requests"]}
    if {r.idx: r.question_id for r in requests} != recorded:
        raise WorkloadError("the data file does not give the run's requests (pass the run's --data)")
    return requests


def features_of(r, settings: dict, classifier, model):
    """What the gateway's policy saw for a request at concurrency 1 (gateway/service.py)."""
    from policy.features import build_features, estimate_prompt_tokens

    return build_features(r.prompt, prompt_tokens=estimate_prompt_tokens(r.prompt), temperature=r.temperature,
                          top_p=1.0, max_tokens=settings["max_tokens"], classifier=classifier, model=model,
                          category_hint=r.category if settings.get("category_hints") else None)


def fixed_menu(modes) -> tuple[list[str], dict, object]:
    """A run's fixed arms, the one measured arm each draft's choice reads as (None:
    plain), and the menu a policy chooses from over them (each draft with the engine
    adapting γ up to the largest bound measured)."""
    from engines.arms import Arm, ArmMenu

    fixed = [a for a in modes if a != ADAPTIVE]
    by_draft = {Arm.parse(a).draft: a for a in fixed}
    if len(by_draft) < len(fixed):  # a draft chosen at any γ reads as its one measured arm
        raise ValueError(f"two fixed arms of one draft among {fixed}: which would a choice of it read as?")
    drafts = tuple(d for d in by_draft if d is not None)
    return fixed, by_draft, ArmMenu(drafts, 1, max(Arm.parse(a).gamma for a in fixed), adaptive=True)


def replay(bench: dict, requests, model, rules, classifier, draws: int = 200, seed: int = 0) -> dict:
    """The policy's expected tokens and seconds per request, and its ratios."""
    from policy.decide import decide

    fixed, by_draft, arms = fixed_menu(bench["settings"]["modes"])
    ms = measured(bench)
    rng = random.Random(seed)
    st = bench["settings"]
    full = [r for r in requests if all((r.idx, a) in ms for a in fixed)]  # failed under no arm
    if not full:
        raise ValueError("no request of the run was measured under every fixed arm at concurrency 1")
    tokens = seconds = 0.0
    shares: Counter = Counter()
    for r in full:
        f = features_of(r, st, classifier, model)
        chosen = Counter(by_draft[decide(f, rules, model, rng, arms).arm.draft] for _ in range(draws))
        for arm, n in chosen.items():
            for m in ms[(r.idx, arm)].values():
                tokens += n / draws * m["output_tokens"]
                seconds += n / draws * m["latency_s"]
            shares[arm] += n / draws
    every = {a: [m for r in full for m in ms[(r.idx, a)].values()] for a in fixed}
    speed = {a: totals(every[a])["tok_s"] for a in fixed}
    # the oracles, by the bench's own rules (analysis.py): each (request, pass)'s fastest fixed arm
    # per token, and, with two passes or more, the one fastest for the request on its other passes
    pooled = [m for a in fixed for m in every[a]]
    oracle = totals(list(oracle_picks(pooled, fixed).values()))["tok_s"]
    held = held_out_picks(pooled, fixed)
    policy = tokens / seconds
    best = max(fixed, key=speed.get)
    out = dict(requests=len(full), vs_plain=policy / speed["plain"],
               vs_best_fixed=policy / speed[best], vs_oracle=policy / oracle, best_fixed=best,
               oracle_vs_plain=oracle / speed["plain"],
               fixed_vs_plain={a: speed[a] / speed["plain"] for a in fixed},
               choices={a: round(n, 1) for a, n in shares.most_common()})
    if held:
        held_speed = totals(held)["tok_s"]
        out.update(vs_held_out_oracle=policy / held_speed, held_out_oracle_vs_plain=held_speed / speed["plain"])
    return out


def with_level(prior, intercept: float, slope: float):
    """The prior draft model with its acceptance intercept and temperature slope replaced
    (what both fits search over; its other coefficients stay)."""
    import dataclasses

    from policy.model import INTERCEPT, TEMPERATURE

    w = list(prior.accept_coef)
    w[INTERCEPT], w[TEMPERATURE] = intercept, slope
    return dataclasses.replace(prior, accept_coef=w, accept_cov=None)


def fit_prior(runs, classifier, model) -> dict[str, dict]:
    """Each fixed draft's prior intercept and temperature slope (policy/model.py::prior_draft),
    fit by least squares on log speedup over plain to the runs' measurements (`runs`: pairs
    of a bench.json and its requests, pooled); the prior's other coefficients stay. Each
    request's squared error is capped at 0.16 (a ratio of 1.5): a sampled answer that ends
    early reads slow for its prefill, not its draft."""
    from scipy.optimize import minimize

    from engines.arms import Arm, DraftKind
    from policy.model import INTERCEPT, TEMPERATURE, prior_of, speedups_at

    out = {}
    seen = [(measured(bench), [(r, features_of(r, bench["settings"], classifier, model)) for r in requests])
            for bench, requests in runs]
    for arm in fixed_drafts(runs):
        a = Arm.parse(arm)
        kind = DraftKind.guess(a.draft)  # a run records its arms' names only
        prior = prior_of(kind)
        rows = [(f, mine, ms[(r.idx, "plain")][rep]) for ms, feats in seen for r, f in feats
                for rep, mine in ms.get((r.idx, arm), {}).items() if rep in ms.get((r.idx, "plain"), {})]

        def loss(p, prior=prior, rows=rows, gamma=a.gamma):
            m = with_level(prior, *p)
            err = 0.0
            for f, mine, plain in rows:
                real = s_per_token(plain) / s_per_token(mine)
                e = np.log(speedups_at(m, m.alpha(f), f, [gamma])[0]) - np.log(real)
                err += min(e * e, 0.16)
            return err

        start = [prior.accept_coef[INTERCEPT], prior.accept_coef[TEMPERATURE]]
        best = minimize(loss, start, method="Nelder-Mead")
        out[arm] = dict(kind=kind.kind, requests=len(rows), intercept=round(float(best.x[0]), 3),
                        temperature=round(float(best.x[1]), 3), prior=[round(v, 3) for v in start],
                        loss=round(float(best.fun), 4), prior_loss=round(float(loss(start)), 4))
    return out


def fixed_drafts(runs) -> list[str]:
    """The fixed speculative arms every run measured (a fit over runs prices the same menu)."""
    modes = [[a for a in bench["settings"]["modes"] if a not in ("plain", ADAPTIVE)] for bench, _ in runs]
    if any(set(m) != set(modes[0]) for m in modes):
        raise ValueError(f"the runs measured different fixed arms ({' / '.join(', '.join(m) for m in modes)}): "
                         "fit runs of one menu")
    return modes[0]


def fit_prior_by_value(runs, classifier, model, rules, draws: int = 60, rounds: int = 3,
                       start: dict[str, tuple[float, float]] | None = None, log=None) -> dict:
    """Every fixed draft's prior intercept and temperature slope chosen together by
    the replayed speed of the policy they make (Thompson draws included), averaged over
    the runs (pairs of a bench.json and its requests: runs on different machines of one
    CPU model measured the drafts' costs differently, and a prior has to serve them all):
    a coordinate search from `start` (arm -> intercept and slope; by default the
    prior's values), steps of 0.2-0.8 in logit divided by the round's number,
    keeping any step that raises the speed. Least squares
    (fit_prior) prices each draft's speed on its own and can still rank the drafts
    badly; this ranks them for the decisions the runs measured, and so fits their
    luck more readily: judge it by replaying other runs."""
    from engines.arms import Arm, DraftKind
    from policy.model import INTERCEPT, TEMPERATURE, PolicyModel, prior_of

    arms = {Arm.parse(a).draft: a for a in fixed_drafts(runs)}
    priors = {d: prior_of(DraftKind.guess(d)) for d in arms}
    start = {d: (start or {}).get(arms[d], (m.accept_coef[INTERCEPT], m.accept_coef[TEMPERATURE]))
             for d, m in priors.items()}

    def value(params: dict) -> float:
        drafts = {d: with_level(priors[d], i, t) for d, (i, t) in params.items()}
        policy = PolicyModel(model.version, drafts, model.explore, output_tokens=model.output_tokens)
        return float(np.mean([replay(bench, requests, policy, rules, classifier, draws)["vs_plain"]
                              for bench, requests in runs]))

    best, before = dict(start), value(start)
    best_v = before
    for r in range(rounds):
        for d in arms:
            for j in (0, 1):
                for step in (-0.8, -0.4, -0.2, 0.2, 0.4, 0.8):
                    trial = dict(best)
                    trial[d] = tuple(v + step / (r + 1) if k == j else v for k, v in enumerate(best[d]))
                    v = value(trial)
                    if v > best_v + 1e-4:  # a real gain, not the draws' rounding
                        best, best_v = trial, v
        if log:
            log(f"round {r + 1}/{rounds}: {best_v:.4f}x plain")
    return dict(replayed=best_v, prior_replayed=before, drafts={
        arms[d]: dict(kind=DraftKind.guess(d).kind, intercept=round(best[d][0], 3), temperature=round(best[d][1], 3),
                      prior=[round(v, 3) for v in start[d]]) for d in arms})


def add_arguments(p) -> None:
    p.add_argument("bench_json", nargs="+", help="`specgate bench` runs' bench.json (they need concurrency 1); "
                                                 "the fits below fit all of them together")
    p.add_argument("--policy", help="policy model JSON (default: the prior, as a cold gateway starts)")
    p.add_argument("--rules", help="operator rules YAML (default: the shipped default rules)")
    p.add_argument("--data", help="the runs' workload JSONL, if not where the runs read it")
    p.add_argument("--explore", type=float, help="override the model's exploration strength (0 = its mean's choice)")
    p.add_argument("--draws", type=int, default=200, help="decisions per request (default: %(default)s)")
    p.add_argument("--fit-prior", action="store_true",
                   help="also fit each fixed draft's prior intercept and temperature slope to the runs (fit on runs "
                        "the replays do not judge)")
    p.add_argument("--fit-prior-value", action="store_true",
                   help="also choose every fixed draft's prior intercept and temperature slope together by the "
                        "replayed speed of the policy they make, averaged over the runs (a coordinate search from "
                        "the prior, or from --fit-prior's fit when both are given: a minute or two per run)")


def main(args) -> int:
    from policy.classifier import CategoryClassifier
    from policy.model import PolicyModel, prior_model
    from policy.rules import SHIPPED_RULES, load_rules

    try:
        runs = []
        for path in args.bench_json:
            bench = json.loads(Path(path).read_text())
            runs.append((bench, workload_of(bench, args.data)))
        model = PolicyModel.from_json(Path(args.policy).read_text()) if args.policy else prior_model()
        rules = load_rules(args.rules or SHIPPED_RULES)
    except (OSError, ValueError, KeyError, WorkloadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.explore is not None:
        model.explore = args.explore
    classifier = CategoryClassifier.load()
    try:
        for path, (bench, requests) in zip(args.bench_json, runs):
            out = replay(bench, requests, model, rules, classifier, max(args.draws, 1))
            print(f"{out['requests']} requests of {path} replayed through policy {model.version} "
                  f"(explore {model.explore:g})")
            print(f"  {out['vs_plain']:.4f}x plain, {out['vs_best_fixed']:.4f}x the best fixed arm "
                  f"({out['best_fixed']}), {out['vs_oracle']:.4f}x the oracle ({out['oracle_vs_plain']:.4f}x plain)"
                  + (f", {out['vs_held_out_oracle']:.4f}x the held-out oracle "
                     f"({out['held_out_oracle_vs_plain']:.4f}x plain)" if "vs_held_out_oracle" in out else ""))
            print("  fixed arms: " + ", ".join(f"{a} {v:.4f}x" for a, v in out["fixed_vs_plain"].items()))
            print("  requests served: " + ", ".join(f"{a} {n:g}" for a, n in out["choices"].items()))
            c1 = [m for m in bench["measurements"] if m.get("concurrency") == 1]
            if noise := timing_noise(c1):
                print(f"  timing noise: {noise['pairs']} greedy requests adaptive served with a fixed mode's arm and "
                      f"text, sd of the log time ratio {noise['sd_log_ratio']:.3f} (decode phase "
                      f"{noise['decode_sd_log_ratio']})")
        start = None
        if args.fit_prior:
            fits = fit_prior(runs, classifier, model)
            start = {arm: (fit["intercept"], fit["temperature"]) for arm, fit in fits.items()}
            for arm, fit in fits.items():
                print(f"prior for {arm} ({fit['kind']}, {fit['requests']} requests): intercept "
                      f"{fit['intercept']:g}, temperature slope {fit['temperature']:g} (now {fit['prior'][0]:g}, "
                      f"{fit['prior'][1]:g}; squared log error {fit['loss']:g} against {fit['prior_loss']:g})")
        if args.fit_prior_value:
            fit = fit_prior_by_value(runs, classifier, model, rules, start=start,
                                     log=lambda m: print(m, file=sys.stderr))
            for arm, d in fit["drafts"].items():
                print(f"prior by value for {arm} ({d['kind']}): intercept {d['intercept']:g}, temperature slope "
                      f"{d['temperature']:g} (from {d['prior'][0]:g}, {d['prior'][1]:g})")
            print(f"replayed with them: {fit['replayed']:.4f}x plain against {fit['prior_replayed']:.4f}x "
                  f"(the mean over {len(runs)} run{'s' * (len(runs) > 1)})")
    except ValueError as e:  # a run without full information, or runs of different menus
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
