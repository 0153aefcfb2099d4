"""How well the step-cost model prices batches it was not fitted on: the
start-up profile's forwards (a lone row feeding 1..9 tokens, the batched SHAPES)
and held-out batches where rows verify drafts beside rows decoding, all timed
round-robin on the real target, each shape its fastest of `--repeats`. Three
models are fitted on the start-up forwards alone: the engine's (a token on the
route as W @ xᵀ priced apart from one laid out, `k` and `b`, and a further pass
of the panels over the weights, `p`), the same without `p`, and one slope for
both routes. Per held-out batch: measured, and each model's price over it; then
what verifying 1 and 4 drafts adds to a batch of 8 rows decoding.

`--serve ARM` instead serves `--concurrency` dev prompts with the arm, the
scheduler driven step by step (as bench/steps.py) with the model refitting from
every step, and compares each step's price, taken just before the model learns
from it, with what it took: decode steps, and the steps that verified drafts
(their extra over a decode step, priced and measured). Run against another
checkout (PYTHONPATH) to see its model in the same serving.

    .venv/bin/python bench/stepcost.py
    .venv/bin/python bench/stepcost.py --serve ngram:8 --concurrency 8 --temperature 0.7
"""

from __future__ import annotations

import argparse

# held out: batches of 4, 8, 16 and 32 rows, some verifying drafts (1 + drafts tokens), some prefilling
HELD_OUT = [[1] * 4 + [3] * 4, [1] * 3 + [5], [1] * 8, [1] * 7 + [2], [1] * 7 + [5], [1] * 6 + [5] * 2,
            [1] * 4 + [5] * 4, [1] * 6 + [3] * 2, [3] * 8, [1] * 16, [1] * 15 + [5], [1] * 12 + [5] * 4,
            [1] * 14 + [9] * 2, [1] * 32, [1] * 28 + [5] * 4, [1] * 16 + [64]]


def one_slope(x):
    """The features with the two routes' token columns (b's and k's) as one, and no passes."""
    import numpy as np

    return np.column_stack([x[:, 0], x[:, 1] + x[:, 7], x[:, 2:7]])


def run(repeats: int) -> None:
    import numpy as np
    from scipy.optimize import nnls

    from bench import cpu_model
    from engines.builtin import BuiltinEngine
    from engines.config import load_engine_config
    from engines.profile import LONE_TOKENS, SHAPES, fastest_steps
    from engines.stepcost import features, fit

    engine = BuiltinEngine.from_config(load_engine_config(None), start_worker=False)
    model, prof = engine._sched.model, engine.profile
    passes = prof.cost.pass_rows
    fitted = [[t] for t in range(1, LONE_TOKENS + 1)] + SHAPES
    shapes = fitted + HELD_OUT
    print(f"machine: {cpu_model()}; {len(fitted)} start-up forwards, {len(HELD_OUT)} held out, "
          f"fastest of {repeats}", flush=True)
    ys = np.array(fastest_steps(model, [[(n, 1 < n <= LONE_TOKENS) for n in s] for s in shapes], repeats=repeats))
    engine.close()

    def row(s: list[int], pass_rows: int = passes) -> list[float]:
        return features(sum(s), len(s), sum(n > 1 for n in s), prof.packed_from, prof.layers_upto, pass_rows)

    x, x0 = np.array([row(s) for s in shapes]), np.array([row(s, 0) for s in shapes])
    n = len(fitted)
    cost = fit(x[:n], ys[:n], packed_from=prof.packed_from, columns_upto=prof.layers_upto, pass_rows=passes)
    flat_cost = fit(x0[:n], ys[:n], packed_from=prof.packed_from, columns_upto=prof.layers_upto)
    flat, _ = nnls(one_slope(x[:n]), ys[:n])
    print(f"the layers run as W @ xᵀ up to {prof.layers_upto} tokens; a token there {cost.k * 1e3:.2f} ms, "
          f"laid out {cost.b * 1e3:.2f} ms, a further pass of {passes} tokens {cost.p * 1e3:.2f} ms; "
          f"without passes a token there {flat_cost.k * 1e3:.2f} ms; one slope for both {flat[1] * 1e3:.2f} ms")
    models = {"engine's": lambda s: cost.step(sum(s), len(s), sum(t > 1 for t in s)),
              "no passes": lambda s: flat_cost.step(sum(s), len(s), sum(t > 1 for t in s)),
              "one slope": lambda s: float(one_slope(np.array([row(s)]))[0] @ flat)}
    print(f"{'batch (tokens per row)':34s} {'measured':>9s} " + " ".join(f"{m:>9s}" for m in models))
    ratios = []
    for s, y in zip(HELD_OUT, ys[n:]):
        ratios.append([price(s) / y for price in models.values()])
        name = " ".join(f"{s.count(t)}x{t}" for t in sorted(set(s)))
        print(f"{name:34s} {y * 1e3:8.1f}  " + " ".join(f"{r:9.2f}" for r in ratios[-1]))
    err = np.abs(np.log(np.array(ratios)))
    for j, label in enumerate(models):
        print(f"{label}: every price within a factor {np.exp(err[:, j].max()):.2f} of measured, "
              f"mean |log ratio| {err[:, j].mean():.3f}")
    took = {tuple(s): y for s, y in zip(shapes, ys)}
    for drafts in (1, 4):
        verifying, decoding = [1] * 7 + [1 + drafts], [1] * 8
        measured = took[tuple(verifying)] - took[tuple(decoding)]
        priced = ", ".join(f"{(price(verifying) - price(decoding)) * 1e3:.1f} ({label})"
                           for label, price in models.items())
        print(f"8 rows, one verifying {drafts} draft(s): adds {measured * 1e3:.1f} ms; priced {priced}")


def serve(arm: str, concurrency: int, temperature: float, steps: int, passes: int) -> None:
    import json

    import numpy as np

    from bench import cpu_model, default_data_path
    from bench.steps import spread, timed_pass
    from engines.builtin import BuiltinEngine
    from engines.config import load_engine_config

    engine = BuiltinEngine.from_config(load_engine_config(None), start_worker=False)
    cost, seen, timed = engine._sched.cost, [], [False]
    learn = cost.observe

    def observe(tokens, rows, seconds, multi=0):  # the price the step had, then what it took
        if timed[0]:
            seen.append((tokens - rows, multi, cost.step(tokens, rows, multi), cost.step(rows, rows), seconds))
        learn(tokens, rows, seconds, multi)

    def timing(on: bool) -> None:  # only the steps after prefill: no prefill chunk in a priced step
        timed[0] = on

    cost.observe = observe
    rows = [json.loads(line) for line in default_data_path().read_text().splitlines() if line.strip()]
    prompts = spread(rows, concurrency)
    for n in range(passes):
        timed_pass(engine, prompts, arm, temperature, steps, str(n), timing=timing)
    engine.close()
    print(f"machine: {cpu_model()}; {arm} at concurrency {concurrency}, T={temperature:g}, "
          f"{passes} x {steps} steps after prefill")
    full = [s for s in seen if s[0] >= 0]
    decode = np.array([s[2:] for s in full if s[1] == 0]).reshape(-1, 3)
    verify = np.array([(s[0], *s[2:]) for s in full if s[1] > 0]).reshape(-1, 4)
    if len(decode):
        print(f"decode steps: {len(decode)}, priced {decode[:, 0].mean() * 1e3:.1f} ms, "
              f"took {decode[:, 2].mean() * 1e3:.1f} ms")
    if len(verify):
        priced, took = (verify[:, 1] - verify[:, 2]).mean(), (verify[:, 3] - decode[:, 2].mean()).mean()
        print(f"steps verifying: {len(verify)}, {verify[:, 0].mean():.1f} drafts each; over a decode step "
              f"priced {priced * 1e3:.1f} ms, took {took * 1e3:.1f} ms ({took / priced:.2f}x)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7, help="forwards per shape, fastest kept (default: %(default)s)")
    ap.add_argument("--serve", metavar="ARM", help="price serving steps of this arm instead (plain, DRAFT:G)")
    ap.add_argument("--concurrency", type=int, default=8, help="with --serve: rows (default: %(default)s)")
    ap.add_argument("--temperature", type=float, default=0.7, help="with --serve (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=120, help="with --serve: steps timed a pass (default: %(default)s)")
    ap.add_argument("--passes", type=int, default=2, help="with --serve (default: %(default)s)")
    a = ap.parse_args()
    if a.serve:
        serve(a.serve, a.concurrency, a.temperature, a.steps, a.passes)
    else:
        run(a.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
