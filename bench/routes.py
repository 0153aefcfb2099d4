"""The routes as W @ xᵀ, A/B in one process: forwards of the target with every
matmul as laid out and with the layers and the head routed as W @ xᵀ for as
many rows as the start-up profile chose (engines/layouts.py: Columns),
interleaved round by round, each shape's time the fastest of three per round;
per shape the median of the routed/unrouted ratios over the rounds, with a 95%
bootstrap interval.

    .venv/bin/python bench/routes.py --rounds 10
"""

from __future__ import annotations

import argparse

SHAPES = {f"lone row, {t} token{'s' * (t > 1)}": [(t, t > 1)] for t in range(1, 10)} | {
    f"{n} rows decoding": [(1, False)] * n for n in (2, 4, 8, 16)}


def run(rounds: int, layers: int | None, head: int | None,
        config: str | None) -> tuple[dict[str, tuple[float, float, list[float]]], str]:
    """Per shape: (unrouted ms, routed ms, routed/unrouted ratio per round), and the profile."""
    import numpy as np

    from engines.builtin import BuiltinEngine
    from engines.config import load_engine_config
    from engines.layouts import route_columns
    from engines.profile import fastest_steps

    engine = BuiltinEngine.from_config(load_engine_config(config), start_worker=False)
    model, prof = engine.model, engine.profile
    routes = (layers if layers is not None else prof.layers_upto, head if head is not None else prof.head_upto)
    shapes = list(SHAPES.values())
    times: dict[tuple[int, int], list[list[float]]] = {(0, 0): [], routes: []}
    for r in range(rounds):
        for u in (((0, 0), routes) if r % 2 == 0 else (routes, (0, 0))):
            route_columns(model.weights, *u)
            times[u].append(fastest_steps(model, shapes, repeats=3))
    route_columns(model.weights, prof.layers_upto, prof.head_upto)
    engine.close()
    a, b = np.array(times[(0, 0)]), np.array(times[routes])  # [rounds, shapes]
    out = {name: (float(np.median(a[:, i])) * 1e3, float(np.median(b[:, i])) * 1e3, list(b[:, i] / a[:, i]))
           for i, name in enumerate(SHAPES)}
    return out, f"routed here: the layers up to {routes[0]} tokens, the head up to {routes[1]} rows; " + prof.describe()


def interval(ratios: list[float], b: int = 2000, seed: int = 0) -> list[float]:
    """[median, low, high]: the rounds' median ratio and a 95% bootstrap interval of it."""
    import numpy as np

    from bench.specbench.intervals import percentile_interval

    rng = np.random.default_rng(seed)
    x = np.asarray(ratios)
    meds = np.median(x[rng.integers(0, len(x), (b, len(x)))], axis=1)
    return percentile_interval(float(np.median(x)), meds.tolist())


def main() -> int:
    from bench import cpu_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10, help="rounds of each route, alternating (default: %(default)s)")
    ap.add_argument("--layers", type=int, help="the layers' route, in rows (default: the profile's choice)")
    ap.add_argument("--head", type=int, help="the head's route, in rows (default: the profile's choice)")
    ap.add_argument("--config", help="engine config YAML (default: the built-in SmolLM2 config)")
    a = ap.parse_args()
    if a.rounds < 2:
        ap.error("--rounds must be at least 2")
    if (a.layers is not None and a.layers < 0) or (a.head is not None and a.head < 0):
        ap.error("--layers and --head must be 0 or more")
    res, profile = run(a.rounds, a.layers, a.head, a.config)
    print(f"machine: {cpu_model()}; start-up profile: {profile}")
    for name, (plain_ms, routed_ms, ratios) in res.items():
        med, lo, hi = interval(ratios)
        print(f"{name:22s} as laid out {plain_ms:6.1f} ms  routed {routed_ms:6.1f} ms  "
              f"ratio {med:.3f} [{lo:.3f}, {hi:.3f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
