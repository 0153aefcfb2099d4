"""Decision latency: features (classifier included) + decide(), on Spec-Bench prompts
(p50, p99 and max over every prompt, repeated)."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path


def run(data: Path, repeats: int, rules_file: Path | None) -> dict:
    from engines.config import EngineConfig
    from policy.classifier import CategoryClassifier
    from policy.decide import decide
    from policy.features import build_features, estimate_prompt_tokens
    from policy.model import prior_model
    from policy.rules import NO_RULES, load_rules

    rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    clf, model = CategoryClassifier.load(), prior_model()
    rules = load_rules(rules_file) if rules_file else NO_RULES
    arms = EngineConfig().arm_menu()  # the built-in engine's default menu: every draft, every γ it serves
    rng = random.Random(0)
    feat_s, decide_s, total_s = [], [], []
    for _ in range(repeats):
        for r in rows:
            text = r["turns"][0]
            t0 = time.perf_counter()
            f = build_features(text, prompt_tokens=estimate_prompt_tokens(text),
                               temperature=rng.choice([0.0, 0.7, 1.0]), top_p=1.0, max_tokens=128, classifier=clf,
                               model=model, running=1, waiting=rng.randint(0, 8))
            t1 = time.perf_counter()
            decide(f, rules, model, rng, arms)
            t2 = time.perf_counter()
            feat_s.append(t1 - t0)
            decide_s.append(t2 - t1)
            total_s.append(t2 - t0)

    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3

    return {name: {"p50_ms": pct(xs, 0.5), "p99_ms": pct(xs, 0.99), "max_ms": max(xs) * 1e3}
            for name, xs in (("features", feat_s), ("decide", decide_s), ("total", total_s))} | {"n": len(total_s)}


def add_arguments(b) -> None:
    from bench import default_data_path

    b.add_argument("--data", default=str(default_data_path()), help="Spec-Bench JSONL (default: %(default)s)")
    b.add_argument("--repeats", type=int, default=20, help="passes over the prompts (default: %(default)s)")
    b.add_argument("--rules", help="rules file (default: no rules)")


def main(args) -> int:
    from bench import cpu_model

    res = run(Path(args.data), args.repeats, Path(args.rules) if args.rules else None)
    print(f"machine: {cpu_model()}")
    print(f"{res['n']} decisions (features incl. classifier + decide)")
    for k in ("features", "decide", "total"):
        print(f"  {k:<9} p50 {res[k]['p50_ms']:.3f} ms   p99 {res[k]['p99_ms']:.3f} ms   max {res[k]['max_ms']:.2f} ms")
    return 0
