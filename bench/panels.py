"""The panels kernel (engines/panels.py) against MKL's W @ xᵀ, A/B in one process.

The engine as `make run` builds it, its start-up profile having chosen the
panels. The other side is what the profile would have kept without them: the
target's layers and head routed as W @ xᵀ by MKL up to the rows where MKL won
(from the same profile's timings; the head timed again), and a step-cost model
fitted that way. The two alternate round by round:
- lone forwards feeding 1 to 9 tokens (each its fastest of three a round): the
  price of verifying drafts, as a panels/MKL ratio per size;
- the dev split's benchmark prompts (the first --per-category of each category)
  served alone and greedy under each arm (bench/routes.py::serve_alternated):
  tokens per second after each request's first, as a panels/MKL ratio with a
  95% bootstrap interval over the rounds.
Then every prompt once more under each arm both ways: how many greedy outputs
differ.

    .venv/bin/python bench/panels.py --rounds 4 --per-category 1
"""

from __future__ import annotations


def run(rounds: int, config: str | None, per_category: int, max_tokens: int, arms: list[str]) -> tuple[dict, str]:
    from bench.routes import dev_prompts, lone_and_served
    from engines.builtin import BuiltinEngine
    from engines.config import load_engine_config
    from engines.layouts import Columns, routed
    from engines.profile import choose_head, fit_cost, upto_where_faster

    engine = BuiltinEngine.from_config(load_engine_config(config), start_worker=False)
    model, prof, w = engine.model, engine.profile, engine.model.weights
    if not prof.panels:
        raise SystemExit("the start-up profile did not choose the panels kernel here: " + prof.describe())
    head = w.lm_head
    layers = routed(w)
    mkl_layers = upto_where_faster({n: (prof.layers_s[n][0], prof.panels_s[n][0]) for n in prof.panels_s})
    sides = {True: (prof.layers_upto, prof.head_upto, engine._sched.cost)}

    def switch(on: bool) -> None:
        for c in layers:
            c.upto = sides[on][0]
            c.run_panels(on)  # MKL's side gets its dense copies back
        if isinstance(head, Columns):
            head.upto = sides[on][1]
            head.run_panels(on)
            w.lm_head = head
        engine._sched.cost = sides[on][2]  # each side's prices, each refitted by its own steps

    sides[False] = (mkl_layers, 0, sides[True][2])  # the MKL side's head and prices: measured next
    switch(False)
    mkl_head, _ = choose_head(model)  # the head as the profile would have routed it by MKL
    sides[False] = (mkl_layers, mkl_head, fit_cost(model, prof.packed_from, mkl_layers))
    rows = dev_prompts(per_category)
    out = lone_and_served(engine, rows, rounds, switch, arms, max_tokens)
    return out, (f"{len(rows)} prompts, {max_tokens} tokens each; MKL: the layers up to {mkl_layers} tokens, "
                 f"the head up to {mkl_head} rows; " + prof.describe())


def main() -> int:
    from bench.routes import lone_and_served_main

    return lone_and_served_main(__doc__, run, "MKL", "panels", "kernel")


if __name__ == "__main__":
    raise SystemExit(main())
