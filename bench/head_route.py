"""The head's route, A/B in one process: forwards of the target with its head as
laid out and as W @ xᵀ (engines/layouts.py: ColumnHead), interleaved round by
round, each shape's time the fastest of three per round; per shape the median of
the routed/unrouted ratios over the rounds, with a 95% bootstrap interval.

    .venv/bin/python bench/head_route.py --rounds 10
"""

from __future__ import annotations

import argparse

SHAPES = {f"lone row, {t} token{'s' * (t > 1)}": [(t, t > 1)] for t in range(1, 10)} | {
    f"{n} rows decoding": [(1, False)] * n for n in (2, 4, 8, 16)}


def run(rounds: int, upto: int | None, config: str | None) -> tuple[dict[str, tuple[float, float, list[float]]], str]:
    """Per shape: (unrouted ms, routed ms, routed/unrouted ratio per round), and the profile."""
    import numpy as np

    from engines.builtin import BuiltinEngine
    from engines.config import load_engine_config
    from engines.layouts import route_head
    from engines.profile import _fastest_steps

    engine = BuiltinEngine.from_config(load_engine_config(config), start_worker=False)
    model, chosen = engine.model, engine.profile.head_upto
    upto = upto or chosen or 8
    shapes = list(SHAPES.values())
    times: dict[int, list[list[float]]] = {0: [], upto: []}
    for r in range(rounds):
        for u in ((0, upto) if r % 2 == 0 else (upto, 0)):
            route_head(model.weights, u)
            times[u].append(_fastest_steps(model, shapes, repeats=3))
    route_head(model.weights, chosen)
    engine.close()
    a, b = np.array(times[0]), np.array(times[upto])  # [rounds, shapes]
    out = {name: (float(np.median(a[:, i])) * 1e3, float(np.median(b[:, i])) * 1e3, list(b[:, i] / a[:, i]))
           for i, name in enumerate(SHAPES)}
    return out, f"routed up to {upto} rows here; " + engine.profile.describe()


def interval(ratios: list[float], b: int = 2000, seed: int = 0) -> tuple[float, float]:
    import numpy as np

    rng = np.random.default_rng(seed)
    x = np.asarray(ratios)
    meds = np.median(x[rng.integers(0, len(x), (b, len(x)))], axis=1)
    return float(np.quantile(meds, 0.025)), float(np.quantile(meds, 0.975))


def main() -> int:
    from bench import cpu_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10, help="rounds of each route, alternating (default: %(default)s)")
    ap.add_argument("--upto", type=int, help="the route's rows (default: the profile's choice, else 8)")
    ap.add_argument("--config", help="engine config YAML (default: the built-in SmolLM2 config)")
    a = ap.parse_args()
    if a.rounds < 2:
        ap.error("--rounds must be at least 2")
    res, profile = run(a.rounds, a.upto, a.config)
    print(f"machine: {cpu_model()}; start-up profile: {profile}")
    for name, (plain_ms, routed_ms, ratios) in res.items():
        lo, hi = interval(ratios)
        med = sorted(ratios)[len(ratios) // 2]
        print(f"{name:22s} as laid out {plain_ms:6.1f} ms  as W @ xT {routed_ms:6.1f} ms  "
              f"ratio {med:.3f} [{lo:.3f}, {hi:.3f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
