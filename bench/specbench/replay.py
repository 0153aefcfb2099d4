"""Replay a `specgate bench` run's concurrency-1 requests through a policy, offline.

At concurrency 1 every request was measured under every fixed arm, so what
any policy would have realised on that run is known without running it: each
request's tokens and seconds under the arm it chooses, averaged over its
choice probabilities (Thompson sampling draws an arm at random). The result
is the policy's speed over plain, the best fixed arm and the per-request
oracle, as the bench reports them, in seconds instead of the bench's 15-40
minutes: a prior or a learned model can be judged on a run it did not see.

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

from bench.specbench.analysis import ok
from bench.specbench.runner import ADAPTIVE
from bench.specbench.workload import WorkloadError, build_workload, read_rows


def measured(bench: dict) -> dict[tuple[int, str], dict]:
    """(request idx, fixed mode) -> its concurrency-1 measurement (the first repeat)."""
    out = {}
    for m in bench["measurements"]:
        if m.get("concurrency") == 1 and m.get("repeat", 0) == 0 and "served" not in m and \
                m["mode"] != ADAPTIVE and ok(m):
            out.setdefault((m["idx"], m["mode"]), m)
    return out


def workload_of(bench: dict, data: str | None = None):
    """The run's requests with their prompts (bench.json keeps only their sizes)."""
    st = bench["settings"]
    requests = build_workload(read_rows(data or st["data"]), st["per_category"] or None, st["temperatures"],
                              st["seed"])
    recorded = {r["idx"]: r["question_id"] for r in bench["requests"]}
    if {r.idx: r.question_id for r in requests} != recorded:
        raise WorkloadError("the data file does not give the run's requests (pass the run's --data)")
    return requests


def replay(bench: dict, requests, model, rules, classifier, draws: int = 200, seed: int = 0) -> dict:
    """The policy's expected tokens and seconds per request, and its ratios."""
    from engines.arms import Arm, ArmMenu
    from policy.decide import decide
    from policy.features import build_features

    fixed = [a for a in bench["settings"]["modes"] if a != ADAPTIVE]
    by_draft = {Arm.parse(a).draft: a for a in fixed}  # None: plain
    drafts = tuple(d for d in by_draft if d is not None)
    gamma_max = max(Arm.parse(a).gamma for a in fixed)
    arms = ArmMenu(drafts, 1, gamma_max, adaptive=True)
    ms = measured(bench)
    rng = random.Random(seed)
    st = bench["settings"]
    totals = Counter()
    shares: Counter = Counter()
    for r in requests:
        if any((r.idx, a) not in ms for a in fixed):
            continue  # a failed request under some arm: no full information for it
        f = build_features(r.prompt, prompt_tokens=max(1, len(r.prompt) // 4), temperature=r.temperature,
                           top_p=1.0, max_tokens=st["max_tokens"], classifier=classifier, model=model,
                           category_hint=r.category if st.get("category_hints") else None)
        chosen = Counter(by_draft[decide(f, rules, model, rng, arms).arm.draft] for _ in range(draws))
        for arm, n in chosen.items():
            m = ms[(r.idx, arm)]
            totals["tokens"] += n / draws * m["output_tokens"]
            totals["seconds"] += n / draws * m["latency_s"]
            shares[arm] += n / draws
        best = min((ms[(r.idx, a)] for a in fixed), key=lambda m: m["latency_s"] / m["output_tokens"])
        totals["oracle_tokens"] += best["output_tokens"]
        totals["oracle_seconds"] += best["latency_s"]
        for a in fixed:
            totals[f"{a}/tokens"] += ms[(r.idx, a)]["output_tokens"]
            totals[f"{a}/seconds"] += ms[(r.idx, a)]["latency_s"]
    speed = {a: totals[f"{a}/tokens"] / totals[f"{a}/seconds"] for a in fixed}
    policy = totals["tokens"] / totals["seconds"]
    oracle = totals["oracle_tokens"] / totals["oracle_seconds"]
    best = max(fixed, key=speed.get)
    return dict(requests=round(sum(shares.values())), vs_plain=policy / speed["plain"],
                vs_best_fixed=policy / speed[best], vs_oracle=policy / oracle, best_fixed=best,
                oracle_vs_plain=oracle / speed["plain"],
                fixed_vs_plain={a: speed[a] / speed["plain"] for a in fixed},
                choices={a: round(n, 1) for a, n in shares.most_common()})


def add_arguments(p) -> None:
    p.add_argument("bench_json", help="a `specgate bench` run's bench.json (it needs concurrency 1)")
    p.add_argument("--policy", help="policy model JSON (default: the prior, as a cold gateway starts)")
    p.add_argument("--rules", help="operator rules YAML (default: the shipped default rules)")
    p.add_argument("--data", help="the run's workload JSONL, if not where the run read it")
    p.add_argument("--explore", type=float, help="override the model's exploration strength (0 = its mean's choice)")
    p.add_argument("--draws", type=int, default=200, help="decisions per request (default: %(default)s)")


def main(args) -> int:
    from policy.classifier import CategoryClassifier
    from policy.model import PolicyModel, prior_model
    from policy.rules import SHIPPED_RULES, load_rules

    try:
        bench = json.loads(Path(args.bench_json).read_text())
        requests = workload_of(bench, args.data)
        model = PolicyModel.from_json(Path(args.policy).read_text()) if args.policy else prior_model()
        rules = load_rules(args.rules or SHIPPED_RULES)
    except (OSError, ValueError, KeyError, WorkloadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.explore is not None:
        model.explore = args.explore
    if not any(m.get("concurrency") == 1 for m in bench["measurements"]):
        print("error: the run has no concurrency-1 measurements", file=sys.stderr)
        return 2
    out = replay(bench, requests, model, rules, CategoryClassifier.load(), max(args.draws, 1))
    print(f"{out['requests']} requests of {args.bench_json} replayed through policy {model.version} "
          f"(explore {model.explore:g})")
    print(f"  {out['vs_plain']:.4f}x plain, {out['vs_best_fixed']:.4f}x the best fixed arm ({out['best_fixed']}), "
          f"{out['vs_oracle']:.4f}x the oracle ({out['oracle_vs_plain']:.4f}x plain)")
    print("  fixed arms: " + ", ".join(f"{a} {v:.4f}x" for a, v in out["fixed_vs_plain"].items()))
    print("  requests served: " + ", ".join(f"{a} {n:g}" for a, n in out["choices"].items()))
    return 0
