"""The drafting price from the drafts' own clocks (engines/proposers/base.py:
DraftingClock) against whole calls timed, A/B in one process.

The engine as `make run` builds it, adaptive γ and the step budget on. On one
side a model draft's drafting price (seconds per drafted token, which the
budget weighs against what a token saves) counts only the forwards that
draft, a catch-up of more than DraftingClock.CATCH_UP positions left out. On
the other it counts whole calls, catch-ups included (CATCH_UP unbounded). Each
side keeps its own price. The dev split's benchmark prompts (the first
--per-category of each category) are served alone under each arm at each
temperature, the sides alternating round by round (bench/routes.py:
serve_alternated): tokens per second after each request's first, accepted per
drafted token and drafting ms per drafted token, as clock/whole ratios with a
95% bootstrap interval over the rounds.

    .venv/bin/python bench/pricing.py --rounds 4 --per-category 1
"""

from __future__ import annotations

import argparse


def run(rounds: int, config: str | None, per_category: int, max_tokens: int, arms: list[str],
        temperatures: tuple[float, ...]) -> tuple[dict, str]:
    from bench.routes import alternated, dev_prompts
    from engines.builtin import BuiltinEngine
    from engines.config import load_engine_config
    from engines.proposers.base import DraftingClock

    engine = BuiltinEngine.from_config(load_engine_config(config), start_worker=False)
    sched, profile = engine._sched, engine.profile.describe()
    warm = dict(sched.drafting_s)  # both sides start from the warm-up's prices
    catch_up = DraftingClock.CATCH_UP
    prices = {True: dict(warm), False: dict(warm)}
    side = [True]

    def switch(on: bool) -> None:
        prices[side[0]] = dict(sched.drafting_s)
        side[0] = on
        sched.drafting_s.clear()
        sched.drafting_s.update(prices[on])
        DraftingClock.CATCH_UP = catch_up if on else 1 << 62

    rows = dev_prompts(per_category)
    try:
        out = alternated(engine, rows, rounds, switch, arms, max_tokens, temperatures)
    finally:
        DraftingClock.CATCH_UP = catch_up
    prices[side[0]] = dict(sched.drafting_s)
    last = "; ".join(f"{'clock' if on else 'whole'} " + ", ".join(f"{d} {s * 1e3:.2f} ms" for d, s in sorted(p.items()))
                     for on, p in prices.items())
    return out, f"{len(rows)} prompts, {max_tokens} tokens each; prices at the end: {last}; {profile}"


def main() -> int:
    from bench import cpu_model
    from bench.routes import print_alternated

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4, help="rounds of each side, alternating (default: %(default)s)")
    ap.add_argument("--config", help="engine config YAML (default: the built-in SmolLM2 config)")
    ap.add_argument("--per-category", type=int, default=1, choices=(1, 2, 3),
                    help="prompts per category (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=96, help="tokens per answer (default: %(default)s)")
    ap.add_argument("--arms", nargs="+", default=["eagle:6", "ngram-eagle:8"],
                    help="arms served, model drafts (default: %(default)s)")
    ap.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 0.7],
                    help="sampling temperatures served (default: %(default)s)")
    a = ap.parse_args()
    if a.rounds < 2:
        ap.error("--rounds must be at least 2")
    res, about = run(a.rounds, a.config, a.per_category, a.max_tokens, a.arms, tuple(a.temperatures))
    print(f"machine: {cpu_model()}; {about}")
    print_alternated(res, "whole", "clock")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
