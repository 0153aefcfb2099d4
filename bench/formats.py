"""Weights streamed in their block formats (engines/panels.py: Q4_1, Q8_0,
bfloat16) against the same panels in float32, A/B in one process.

The engine as `make run` builds it: its routed weights in panels, each in the
smallest format that gives back its exact values (SmolLM2's layers Q4_1, its
tied head Q8_0; the EAGLE head's own weights bfloat16, its rows of the target's
head Q8_0). The other side runs every one of those panels in float32, with the
same routes and a step-cost model fitted that way. The two alternate round by
round:
- lone forwards feeding 1 to 9 tokens (each its fastest of three a round);
- the dev split's benchmark prompts (the first --per-category of each category)
  served alone and greedy under each arm (bench/routes.py::serve_alternated);
then every prompt once more under each arm both ways: how many greedy outputs
differ (none should: the formats give the float32 panels' bits).

    .venv/bin/python bench/formats.py --rounds 4 --per-category 1
"""

from __future__ import annotations


def panels_of(engine) -> list:
    """Every routed weight the engine runs by the panels: the target's and its EAGLE drafts'."""
    from engines.layouts import Columns, routed
    from engines.proposers.eagle import EagleProposer

    eagles = {id(p.draft): p.draft for f in engine.drafts.values() if isinstance(p := f(1), EagleProposer)}
    weights = [engine.model.weights, *(e.model.weights for e in eagles.values())]
    cols = [c for w in weights for c in (*routed(w), w.lm_head)]
    cols += [c for e in eagles.values() for c in (e.fc, e.reduce)]
    return [c for c in cols if isinstance(c, Columns) and c.on_panels]


def run(rounds: int, config: str | None, per_category: int, max_tokens: int, arms: list[str]) -> tuple[dict, str]:
    import collections

    from bench.routes import dev_prompts, lone_and_served
    from engines.builtin import BuiltinEngine
    from engines.config import load_engine_config
    from engines.panels import Panel
    from engines.profile import fit_cost

    engine = BuiltinEngine.from_config(load_engine_config(config), start_worker=False)
    model, prof = engine.model, engine.profile
    cols = panels_of(engine)
    formats = collections.Counter(c.panel.fmt for c in cols)
    if set(formats) == {"float32"}:
        raise SystemExit("no routed weight streams in a block format here: " + prof.describe())
    sides = {True: [c.panel for c in cols], False: [Panel(c.dense, c.panel.k, formats=False) for c in cols]}
    costs = {True: engine._sched.cost}

    def switch(on: bool) -> None:
        for c, p in zip(cols, sides[on]):
            c.panel = p
        engine._sched.cost = costs[on]

    costs[False] = costs[True]
    switch(False)
    costs[False] = fit_cost(model, prof.packed_from, prof.layers_upto)  # float32's own prices
    rows = dev_prompts(per_category)
    out = lone_and_served(engine, rows, rounds, switch, arms, max_tokens)
    mb = {on: sum(p.packed.numel() * p.packed.element_size() for p in ps) / 2**20 for on, ps in sides.items()}
    return out, (f"{len(rows)} prompts, {max_tokens} tokens each; {len(cols)} routed weights in panels "
                 f"({', '.join(f'{n} {f}' for f, n in formats.most_common())}): {mb[True]:.0f} MB against "
                 f"{mb[False]:.0f} MB in float32; " + prof.describe())


def main() -> int:
    from bench.routes import lone_and_served_main

    return lone_and_served_main(__doc__, run, "float32", "formats", "side")


if __name__ == "__main__":
    raise SystemExit(main())
