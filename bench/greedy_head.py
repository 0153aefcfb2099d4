"""Greedy rows' head in two stages (engines/greedy_head.py), A/B in one process.

The dev split's benchmark prompts (the first --per-category of each category)
served alone and greedy under each arm, with the target's head as laid out and
in two stages, alternating round by round (bench/routes.py::serve_alternated);
the head's median time in the forwards of greedy rows, either way (cold in
cache, as a step reads it); per arm the tokens per second after each request's
first (prefill left out) as a two-stage/full ratio with a 95% bootstrap interval
over the rounds; and the candidates the screen left a row on average. Then
every prompt once more under each arm both ways: the greedy outputs must be the
same token for token.

    .venv/bin/python bench/greedy_head.py --rounds 6 --per-category 1
"""

from __future__ import annotations


def run(rounds: int, config: str | None, per_category: int, max_tokens: int, arms: list[str]) -> tuple[dict, str]:
    import time

    import numpy as np

    from bench.routes import dev_prompts, served_and_compared
    from engines.builtin import BuiltinEngine
    from engines.config import load_engine_config
    from engines.greedy_head import CALIBRATION_TEXT, calibrate

    engine = BuiltinEngine.from_config(load_engine_config(config), start_worker=False)
    model = engine.model
    chosen = model.greedy_head is not None
    head = model.greedy_head or calibrate(model, engine.tokenizer(CALIBRATION_TEXT)["input_ids"])[0]
    rows = dev_prompts(per_category)

    def switch(on: bool) -> None:
        model.greedy_head = head if on else None

    # the head's seconds in every target forward of a greedy row, by the head it ran (cold in cache, as served)
    head_s: dict[bool, list[float]] = {False: [], True: []}
    logits = model._logits

    def timed(x, greedy=None):
        t0 = time.perf_counter()
        out = logits(x, greedy)
        if greedy and any(greedy):
            head_s[model.greedy_head is not None].append(time.perf_counter() - t0)
        return out
    model._logits = timed

    out = served_and_compared(engine, rows, rounds, switch, arms, max_tokens)
    screened = head.candidates / max(head.screens, 1)
    out["head ms"] = {on: (len(v), float(np.median(v)) * 1e3) for on, v in head_s.items()}
    return out, (
        f"{len(rows)} prompts, {max_tokens} tokens each; the start-up chose the two stages: "
        f"{'yes' if chosen else 'no'}; candidates a row: {screened:.1f} of {model.cfg.vocab_size}; "
        + engine.profile.describe())


def main() -> int:
    from bench import cpu_model
    from bench.routes import print_served, serving_args

    a = serving_args(__doc__, 6, "head")
    res, about = run(a.rounds, a.config, a.per_category, a.max_tokens, a.arms)
    head = res.pop("head ms")
    print(f"machine: {cpu_model()}; {about}")
    print(f"the head in a forward with greedy rows, median: full {head[False][1]:.2f} ms ({head[False][0]} forwards), "
          f"two-stage {head[True][1]:.2f} ms ({head[True][0]})")
    print_served(res, "full", "two-stage", "heads")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
