"""Decision latency: features (classifier included) + decide(), on Spec-Bench prompts
(p50, p99 and max over every prompt, repeated).

A p99 differs more between processes than within one (0.42-0.67 ms for the same
code, one process after another, on one machine): `--processes N` runs the loop
in N fresh processes, one after another, and gives the pooled p99 a 95% interval
by resampling whole processes, so that a target is judged on it (met where the
interval's upper end is under it, missed where its lower end is over it).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

PARTS = ("features", "decide", "total")
BOOTSTRAP = 1000


def measure(data: Path, repeats: int, rules_file: Path | None) -> dict[str, list[float]]:
    """Seconds of every decision's parts, `repeats` passes over the prompts."""
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
    out: dict[str, list[float]] = {k: [] for k in PARTS}
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
            out["features"].append(t1 - t0)
            out["decide"].append(t2 - t1)
            out["total"].append(t2 - t0)
    return out


def pct(xs: list[float], q: float) -> float:
    """The q-quantile of seconds, in ms."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3


def summarise(samples: dict[str, list[float]]) -> dict:
    return {name: {"p50_ms": pct(xs, 0.5), "p99_ms": pct(xs, 0.99), "max_ms": max(xs) * 1e3}
            for name, xs in samples.items()} | {"n": len(samples["total"])}


def run(data: Path, repeats: int, rules_file: Path | None) -> dict:
    return summarise(measure(data, repeats, rules_file))


def across(processes: list[dict[str, list[float]]], seed: int = 0, b: int = BOOTSTRAP) -> dict:
    """Pooled p50 and p99 of every part, each process's p99, and a 95% interval for
    the pooled p99 from resampling whole processes (the noise that matters here)."""
    import numpy as np

    from bench.specbench.intervals import percentile_interval

    rng = random.Random(seed)
    out = {}
    for part in PARTS:
        arrays = [np.asarray(p[part]) for p in processes]
        boots = []
        for _ in range(b):  # numpy's partition: sorting ~50,000 seconds in Python a thousand times took ~20 s
            x = np.concatenate([arrays[rng.randrange(len(arrays))] for _ in arrays])
            k = min(len(x) - 1, int(0.99 * len(x)))  # pct's index
            boots.append(float(np.partition(x, k)[k]) * 1e3)
        pooled = [x for p in processes for x in p[part]]
        p99 = pct(pooled, 0.99)
        out[part] = {"p50_ms": pct(pooled, 0.5), "p99_ms": p99, "p99_interval_ms": percentile_interval(p99, boots)[1:],
                     "p99_per_process_ms": [pct(p[part], 0.99) for p in processes]}
    return out | {"n": sum(len(p["total"]) for p in processes), "processes": len(processes)}


def verdict(interval: list[float], target_ms: float) -> str:
    lo, hi = interval
    return "met" if hi <= target_ms else "missed" if lo > target_ms else "undecided"


def add_arguments(b) -> None:
    from bench import default_data_path

    b.add_argument("--data", default=str(default_data_path()), help="Spec-Bench JSONL (default: %(default)s)")
    b.add_argument("--repeats", type=int, default=20, help="passes over the prompts (default: %(default)s)")
    b.add_argument("--rules", help="rules file (default: no rules)")
    b.add_argument("--processes", type=int, default=1,
                   help="fresh processes, one after another, each doing every pass; above 1, the pooled p99 gets "
                        "a 95%% interval over processes (default: %(default)s: this process alone)")
    b.add_argument("--target-ms", type=float, default=0.5,
                   help="the total p99 judged against the interval (default: %(default)s)")


def main(args) -> int:
    from bench import cpu_model

    data, rules = Path(args.data), Path(args.rules) if args.rules else None
    print(f"machine: {cpu_model()}")
    if args.processes <= 1:
        res = run(data, args.repeats, rules)
        print(f"{res['n']} decisions (features incl. classifier + decide)")
        for k in PARTS:
            print(f"  {k:<9} p50 {res[k]['p50_ms']:.3f} ms   p99 {res[k]['p99_ms']:.3f} ms   "
                  f"max {res[k]['max_ms']:.2f} ms")
        return 0
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    samples = []
    # one worker, a fresh process per task: the processes run one after another, never sharing the cores
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), max_tasks_per_child=1) as pool:
        for i in range(args.processes):
            samples.append(pool.submit(measure, data, args.repeats, rules).result())
            print(f"  process {i + 1}/{args.processes}: total p99 {pct(samples[-1]['total'], 0.99):.3f} ms",
                  flush=True)
    res = across(samples)
    print(f"{res['n']} decisions in {res['processes']} processes (features incl. classifier + decide)")
    for k in PARTS:
        lo, hi = res[k]["p99_interval_ms"]
        print(f"  {k:<9} p50 {res[k]['p50_ms']:.3f} ms   p99 {res[k]['p99_ms']:.3f} ms [{lo:.3f}, {hi:.3f}]")
    print(f"total p99 <= {args.target_ms} ms: {verdict(res['total']['p99_interval_ms'], args.target_ms)}")
    return 0
