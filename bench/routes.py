"""The routes as W @ xᵀ, A/B in one process: forwards of the target with every
matmul as laid out and with the layers and the head routed as W @ xᵀ for as
many rows as the start-up profile chose (engines/layouts.py: Columns),
interleaved round by round, each shape's time the fastest of three per round;
per shape the median of the routed/unrouted ratios over the rounds, with a 95%
bootstrap interval.

With --drafts, the EAGLE drafts' own routes instead (Drafts.route_columns): the
dev split's benchmark prompts (the first --per-category of each category) served
alone under each at γ 1 and 3, greedy, fixed γ, with the drafts routed as the target and laid out,
alternating round by round (`alternated`, which bench/draft_context.py shares);
per round the accepted per drafted token (routes change no draft: 1.000), the
drafting seconds per drafted token (their first round's reading of the prompt
included) and the tokens per second after each request's first (prefill left
out), each as a routed/laid-out ratio.

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
            route_columns(model.weights, *u, panels=prof.panels)
            times[u].append(fastest_steps(model, shapes, repeats=3))
    route_columns(model.weights, prof.layers_upto, prof.head_upto, prof.panels)
    engine.close()
    a, b = np.array(times[(0, 0)]), np.array(times[routes])  # [rounds, shapes]
    out = {name: (float(np.median(a[:, i])) * 1e3, float(np.median(b[:, i])) * 1e3, list(b[:, i] / a[:, i]))
           for i, name in enumerate(SHAPES)}
    return out, f"routed here: the layers up to {routes[0]} tokens, the head up to {routes[1]} rows; " + prof.describe()


def run_drafts(rounds: int, config: str | None, per_category: int, max_tokens: int) -> tuple[dict, str]:
    """Per (arm, figure): (laid-out median, routed median, routed/laid-out ratio per round)."""
    from engines.builtin import BuiltinEngine
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
    rows = dev_prompts(per_category)
    arms = [f"{name}:{gamma}/fixed" for name in eagles for gamma in (1, 3)]
    try:
        out = alternated(engine, rows, rounds,
                         lambda routed: own.route_columns(*(routes if routed else (0, 0)), prof.panels),
                         arms, max_tokens)
    finally:
        own.route_columns(*routes, prof.panels)
        engine.close()
    return out, (f"{len(rows)} prompts, {max_tokens} tokens each; drafts routed as the target: the layers up to "
                 f"{prof.layers_upto} tokens, the head up to {prof.head_upto} rows; " + prof.describe())


def alternated(engine, rows: list[dict], rounds: int, switch, arms: list[str], max_tokens: int,
               temperatures: tuple[float, ...] = (0.0,)) -> dict:
    """serve_alternated with the decode loop on this (main) thread, as `specgate serve`
    runs it (the engine is closed after)."""
    from engines.builtin import drive_from_side_thread

    return drive_from_side_thread(engine, lambda: serve_alternated(engine, rows, rounds, switch, arms, max_tokens,
                                                                   temperatures))


def serve_alternated(engine, rows: list[dict], rounds: int, switch, arms: list[str], max_tokens: int,
                     temperatures: tuple[float, ...] = (0.0,)) -> dict:
    """Serve `rows` (first turns) alone under each arm (`DRAFT:G`, `/fixed` for a fixed γ)
    at each temperature (greedy by default; an arm is named `ARM@T` beside others) with
    `switch(False)` and `switch(True)` alternating round by round, from a thread beside
    the decode loop's. Per (arm, figure): (median off, median on, on/off ratio per
    round), the figures being accepted per drafted token, drafting ms per drafted token
    (the first round's reading of the prompt included) and tokens per second after each
    request's first (prefill left out)."""
    import numpy as np

    from engines.api import ChatMessage, GenerationRequest, SamplingParams
    from engines.arms import Arm

    runs: dict[tuple, dict[bool, list[float]]] = {}
    for r in range(rounds):
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            switch(on)  # the loop is idle: every request has ended
            for arm, t in ((a, t) for t in temperatures for a in arms):
                parsed, fixed = Arm.parse(arm.removesuffix("/fixed")), arm.endswith("/fixed")
                stats = [engine.submit(GenerationRequest(
                    f"{arm}-{t}-{on}-{i}", SamplingParams(max_tokens=max_tokens, temperature=t),
                    messages=(ChatMessage("user", row["turns"][0]),), arm=parsed,
                    fixed_gamma=fixed)).wait(600).stats for i, row in enumerate(rows)]
                name = arm if temperatures == (0.0,) else f"{arm}@{t:g}"
                drafted = max(sum(x.drafted for x in stats), 1)
                decoding = sum(x.total_s - x.ttft_s for x in stats)  # after the first token
                figures = {"accepted/drafted": sum(x.accepted for x in stats) / drafted,
                           "drafting ms/token": sum(x.draft_s for x in stats) / drafted * 1e3,
                           "decode tok/s": sum(x.output_tokens - 1 for x in stats) / decoding}
                for fig, v in figures.items():
                    runs.setdefault((name, fig), {False: [], True: []})[on].append(v)
    with np.errstate(invalid="ignore", divide="ignore"):  # plain drafts nothing: its drafting figures are 0/0
        return {k: (float(np.median(v[False])), float(np.median(v[True])),
                    list(np.array(v[True]) / np.array(v[False]))) for k, v in runs.items()}


def served_and_compared(engine, rows: list[dict], rounds: int, switch, arms: list[str], max_tokens: int) -> dict:
    """serve_alternated with the decode loop on this (main) thread, as `specgate serve` runs
    it, then, under "differ", per arm how many greedy outputs differ between the sides."""
    from engines.builtin import drive_from_side_thread

    def serve() -> dict:
        out = serve_alternated(engine, rows, rounds, switch, arms, max_tokens)
        return out | {"differ": {arm: differing(engine, rows, arm, max_tokens, switch) for arm in arms}}
    return drive_from_side_thread(engine, serve)


def dev_prompts(per_category: int, categories: list[str] | None = None) -> list[dict]:
    """The dev split's benchmark prompts: the first `per_category` of each category (of `categories`)."""
    import json

    from bench import default_data_path
    from bench.engine import pick_prompts

    return pick_prompts([json.loads(x) for x in default_data_path().read_text().splitlines() if x.strip()],
                        per_category, categories)


def lone_and_served(engine, rows: list[dict], rounds: int, switch, arms: list[str], max_tokens: int) -> dict:
    """lone_alternated (under "lone"), then served_and_compared, which closes the engine."""
    lone = lone_alternated(engine.model, rounds, switch)
    return served_and_compared(engine, rows, rounds, switch, arms, max_tokens) | {"lone": lone}


def differing(engine, rows: list[dict], arm: str, max_tokens: int, switch) -> int:
    """Prompts whose greedy output under `arm` differs between switch(False) and
    switch(True) (from a thread beside the decode loop's)."""
    from engines.api import ChatMessage, GenerationRequest, SamplingParams
    from engines.arms import Arm

    def outputs(on: bool) -> list[tuple[int, ...]]:
        switch(on)
        return [tuple(engine.submit(GenerationRequest(
            f"same-{arm}-{on}-{i}", SamplingParams(max_tokens=max_tokens, temperature=0.0),
            messages=(ChatMessage("user", row["turns"][0]),), arm=Arm.parse(arm))).wait(600).token_ids)
            for i, row in enumerate(rows)]
    return sum(a != b for a, b in zip(outputs(False), outputs(True)))


LONE = tuple(range(1, 10))  # tokens a lone row feeds in lone_alternated


def lone_alternated(model, rounds: int, switch) -> dict[int, tuple[float, float, list[float]]]:
    """Lone forwards feeding 1 to 9 tokens, each its fastest of three a round, the sides
    alternating round by round: per size (median off ms, median on ms, on/off ratio per round)."""
    import numpy as np

    from engines.profile import fastest_steps

    lone: dict[bool, list[list[float]]] = {False: [], True: []}
    for r in range(rounds):
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            switch(on)
            lone[on].append(fastest_steps(model, [[(t, t > 1)] for t in LONE], repeats=3))
    a, b = np.array(lone[False]), np.array(lone[True])  # [rounds, sizes]
    return {t: (float(np.median(a[:, i])) * 1e3, float(np.median(b[:, i])) * 1e3, list(b[:, i] / a[:, i]))
            for i, t in enumerate(LONE)}


def print_lone(lone: dict, off: str, on: str) -> None:
    """lone_alternated()'s figures, a line per size."""
    for t, (a, b, ratios) in lone.items():
        med, lo, hi = interval(ratios)
        print(f"lone row, {t} token{'s' * (t > 1)}   {off} {a:6.2f} ms  {on} {b:6.2f} ms  "
              f"ratio {med:.3f} [{lo:.3f}, {hi:.3f}]")


def print_served(res: dict, off: str, on: str, sides: str) -> None:
    """served_and_compared()'s decode speeds and differing outputs."""
    print_alternated({k: v for k, v in res.items() if k[1] == "decode tok/s"}, off, on)
    print(f"greedy outputs differing between the {sides}: "
          + ", ".join(f"{a} {n}" for a, n in res["differ"].items()))


def lone_and_served_main(doc: str, run, off: str, on: str, side: str) -> int:
    """The command line of an A/B bench whose `run` gives lone_and_served()'s figures
    and a line about them (bench/formats.py, bench/panels.py): `off` and `on` name
    the sides, `side` what alternates."""
    from bench import cpu_model

    a = serving_args(doc, 4, side)
    res, about = run(a.rounds, a.config, a.per_category, a.max_tokens, a.arms)
    print(f"machine: {cpu_model()}; {about}")
    print_lone(res.pop("lone"), off, on)
    print_served(res, off, on, f"{side}s")
    return 0


SERVED_ARMS = ("plain", "ngram:8", "eagle:6", "ngram-eagle:8")  # what the A/B benches serve by default


def serving_args(doc: str, rounds: int, sides: str) -> argparse.Namespace:
    """The command line of an A/B bench that serves the dev prompts under arms with
    serve_alternated (bench/greedy_head.py, bench/panels.py, bench/formats.py): --rounds (at least 2),
    --config, --per-category, --max-tokens, --arms. `sides`: what alternates."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=rounds,
                    help=f"rounds of each {sides}, alternating (default: %(default)s)")
    ap.add_argument("--config", help="engine config YAML (default: the built-in SmolLM2 config)")
    ap.add_argument("--per-category", type=int, default=1, choices=(1, 2, 3),
                    help="prompts per category (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=96, help="tokens per answer (default: %(default)s)")
    ap.add_argument("--arms", nargs="+", default=list(SERVED_ARMS), help="arms served (default: %(default)s)")
    a = ap.parse_args()
    if a.rounds < 2:
        ap.error("--rounds must be at least 2")
    return a


def print_alternated(res: dict, off: str, on: str) -> None:
    """alternated()'s figures, a line each: both medians and the ratio's median [95% interval]."""
    for (arm, fig), (a, b, ratios) in res.items():
        med, lo, hi = interval(ratios)
        print(f"{arm:16s} {fig:18s} {off} {a:6.3f}  {on} {b:6.3f}  ratio {med:.3f} [{lo:.3f}, {hi:.3f}]")


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
        print_alternated(res, "as laid out", "routed")
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
