"""The routes as W @ xᵀ, A/B in one process: forwards of the target with every
matmul as laid out and with the layers and the head routed as W @ xᵀ for as
many rows as the start-up profile chose (engines/layouts.py: Columns),
interleaved round by round, each shape's time the fastest of three per round;
per shape the median of the routed/unrouted ratios over the rounds, with a 95%
bootstrap interval.

With --drafts, the EAGLE drafts' own routes instead (Drafts.route_columns): the
dev split's benchmark prompts (the first --per-category of each category) served
alone under each at γ 1 and 3, greedy, fixed γ, with the drafts routed as the target and laid out,
alternating round by round; per round the drafting seconds per drafted token
(the requests' draft_s over their drafted tokens, their first round's reading
of the prompt included) and the tokens per second after each request's first
(prefill left out), each as a routed/laid-out ratio.

    .venv/bin/python bench/routes.py --rounds 10
    .venv/bin/python bench/routes.py --drafts --rounds 4 --per-category 1
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


def run_drafts(rounds: int, config: str | None, per_category: int, max_tokens: int) -> tuple[dict, str]:
    """Per (draft, γ, figure): (laid-out median, routed median, routed/laid-out ratio per round)."""
    import json

    import numpy as np

    from bench import default_data_path
    from bench.engine import pick_prompts
    from engines.api import ChatMessage, GenerationRequest, SamplingParams
    from engines.arms import Arm
    from engines.builtin import BuiltinEngine, drive_from_side_thread
    from engines.config import load_engine_config
    from engines.drafts import Drafts
    from engines.proposers.eagle import EagleProposer

    # the decode loop on this (main) thread, as `specgate serve` runs it; requests from a second
    engine = BuiltinEngine.from_config(load_engine_config(config), start_worker=False)
    prof = engine.profile
    eagles = {n: p.draft for n, f in engine.drafts.items() if isinstance(p := f(1), EagleProposer)}
    if not eagles:
        raise SystemExit("no EAGLE draft in this config")
    own = Drafts({}, [d.model.weights for d in eagles.values()], list(eagles.values()))
    routes = (prof.layers_upto, prof.head_upto)
    rows = pick_prompts([json.loads(x) for x in default_data_path().read_text().splitlines() if x.strip()],
                        per_category, None)
    runs: dict[tuple, dict[bool, list[float]]] = {}

    def serve_rounds() -> None:
        for r in range(rounds):
            for routed in ((False, True) if r % 2 == 0 else (True, False)):
                own.route_columns(*(routes if routed else (0, 0)))  # the loop is idle: every request has ended
                for name in eagles:
                    for gamma in (1, 3):
                        stats = [engine.submit(GenerationRequest(
                            f"{name}-{gamma}-{i}", SamplingParams(max_tokens=max_tokens, temperature=0.0),
                            messages=(ChatMessage("user", row["turns"][0]),), arm=Arm(name, gamma),
                            fixed_gamma=True)).wait(600).stats for i, row in enumerate(rows)]
                        drafted = sum(x.drafted for x in stats)
                        decoding = sum(x.total_s - x.ttft_s for x in stats)  # after the first token
                        figures = {"drafting ms/token": sum(x.draft_s for x in stats) / max(drafted, 1) * 1e3,
                                   "decode tok/s": sum(x.output_tokens - 1 for x in stats) / decoding}
                        for fig, v in figures.items():
                            runs.setdefault((name, gamma, fig), {False: [], True: []})[routed].append(v)
    try:
        drive_from_side_thread(engine, serve_rounds)
    finally:
        own.route_columns(*routes)
        engine.close()
    out = {k: (float(np.median(v[False])), float(np.median(v[True])),
               list(np.array(v[True]) / np.array(v[False]))) for k, v in runs.items()}
    return out, (f"{len(rows)} prompts, {max_tokens} tokens each; drafts routed as the target: the layers up to "
                 f"{prof.layers_upto} tokens, the head up to {prof.head_upto} rows; " + prof.describe())


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
    ap.add_argument("--drafts", action="store_true", help="A/B the EAGLE drafts' own routes instead (see above)")
    ap.add_argument("--per-category", type=int, default=3, choices=(1, 2, 3),
                    help="with --drafts: prompts per category (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=96,
                    help="with --drafts: tokens per answer (default: %(default)s)")
    a = ap.parse_args()
    if a.rounds < 2:
        ap.error("--rounds must be at least 2")
    if (a.layers is not None and a.layers < 0) or (a.head is not None and a.head < 0):
        ap.error("--layers and --head must be 0 or more")
    if a.drafts:
        res, profile = run_drafts(a.rounds, a.config, a.per_category, a.max_tokens)
        print(f"machine: {cpu_model()}; {profile}")
        for (name, gamma, fig), (laid, routed, ratios) in res.items():
            med, lo, hi = interval(ratios)
            print(f"{name}:{gamma} {fig:18s} as laid out {laid:6.2f}  routed {routed:6.2f}  "
                  f"ratio {med:.3f} [{lo:.3f}, {hi:.3f}]")
        return 0
    res, profile = run(a.rounds, a.layers, a.head, a.config)
    print(f"machine: {cpu_model()}; start-up profile: {profile}")
    for name, (plain_ms, routed_ms, ratios) in res.items():
        med, lo, hi = interval(ratios)
        print(f"{name:22s} as laid out {plain_ms:6.1f} ms  routed {routed_ms:6.1f} ms  "
              f"ratio {med:.3f} [{lo:.3f}, {hi:.3f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
