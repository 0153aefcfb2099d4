"""Where a draft's rounds go under the engine's adaptive γ, beside its fixed γ,
in one process.

Each dev prompt (the first --per-category of each of --categories) is served
alone (concurrency 1) under every mode, the modes interleaved and their order
rotated per prompt and per repeat, because these machines drift. Every
speculative round is counted by what happened to it:

    none        nothing drafted: the draft gate judged the model draft not
                worth running at this load (a plain round), or lookup found
                no match
    declined    drafted, nothing verified: no prefix of the draft paid for
                its verification (the model draft's drafting was spent)
    1, 2, ...   drafts verified

Per mode: tokens per second over the first mode's, as summed tokens over summed
seconds, with a 95% bootstrap interval over prompts (each prompt's repeats
drawn together), and the share of its rounds in each kind. At T > 0 each
repeat samples with its own seed, so every mode writes its own texts.

    .venv/bin/python bench/rounds.py --temperature 0.7 --modes eagle:1/fixed eagle:6 plain
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

import numpy as np


def kinds(drafted: list[int], verified: list[int]) -> Counter:
    """One request's speculative rounds by kind (see the module's docstring)."""
    out = Counter()
    for d, v in zip(drafted, verified):
        out["none" if d == 0 else "declined" if v == 0 else str(v)] += 1
    return out


def run(engine, rows: list[dict], modes: list[str], temperature: float, max_tokens: int, repeats: int,
        log=None) -> dict:
    """Per mode: tokens and seconds per prompt (summed over repeats), and its rounds by kind."""
    from bench.engine import dev_request, parse_mode, rotated
    from engines.api import GenerationRequest

    out = {m: dict(tokens=np.zeros(len(rows)), seconds=np.zeros(len(rows)), rounds=Counter()) for m in modes}
    n = 0
    for rep in range(repeats):
        for i, row in enumerate(rows):
            req = dev_request(row, temperature, max_tokens, rep)
            for mode in rotated(modes, n):
                arm, fixed = parse_mode(mode)
                s = engine.generate(GenerationRequest(arm=arm, fixed_gamma=fixed, **req)).stats
                cell = out[mode]
                cell["tokens"][i] += s.output_tokens
                cell["seconds"][i] += s.total_s
                cell["rounds"] += kinds(s.drafted_per_round, s.verified_per_round)
                if log:
                    log(f"[{rep + 1}/{repeats}] {row['category']:<14} {mode:<16} {s.tokens_per_s:6.1f} tok/s")
            n += 1
    return out


def over(cell: dict, ref: dict, b: int = 2000, seed: int = 0) -> list[float]:
    """[ratio, low, high]: cell's tokens/s over ref's, summed over prompts, and a
    95% bootstrap interval over prompts."""
    from bench.specbench.intervals import percentile_interval

    def ratio(idx):
        return (cell["tokens"][idx].sum() / cell["seconds"][idx].sum()) / (
            ref["tokens"][idx].sum() / ref["seconds"][idx].sum())

    k = len(cell["tokens"])
    draws = np.random.default_rng(seed).integers(0, k, (b, k))
    return percentile_interval(float(ratio(np.arange(k))), [float(ratio(d)) for d in draws])


def report(out: dict, modes: list[str]) -> list[str]:
    lines = []
    for m in modes:
        x, lo, hi = over(out[m], out[modes[0]])
        rounds = out[m]["rounds"]
        total = sum(rounds.values())
        order = sorted(rounds, key=lambda k: (k.isdigit(), int(k) if k.isdigit() else k != "none"))
        shares = ", ".join(f"{k} {rounds[k] / total:.0%}" for k in order) if total else "no speculative rounds"
        lines.append(f"{m:<16} {x:.3f}x {modes[0]} [{lo:.3f}, {hi:.3f}]  rounds {total}: {shares}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", nargs="+", default=["eagle:1/fixed", "eagle:6", "plain"],
                   help="plain, DRAFT:G or DRAFT:G/fixed; the first is the reference (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--categories", nargs="*", help="only these (default: all)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=2, help="passes over the prompts (default: %(default)s)")
    p.add_argument("--config", help="engine config YAML (default: built-in SmolLM2 config)")
    args = p.parse_args(argv)

    from bench import cpu_model
    from bench.engine import modes_error
    from bench.routes import dev_prompts
    from engines.builtin import BuiltinEngine, drive_from_side_thread
    from engines.config import load_engine_config

    problem = modes_error(args.modes)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    rows = dev_prompts(args.per_category, args.categories)
    if not rows:
        print(f"error: no dev prompts in {args.categories}", file=sys.stderr)
        return 2
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    engine = BuiltinEngine.from_config(load_engine_config(args.config), start_worker=False)
    out = drive_from_side_thread(engine, lambda: run(engine, rows, args.modes, args.temperature, args.max_tokens,
                                                     args.repeats, log))
    cats = len({r["category"] for r in rows})
    print(f"machine: {cpu_model()}; {len(rows)} prompts ({cats} categories), T={args.temperature:g}, "
          f"{args.max_tokens} tokens, {args.repeats} repeats")
    print("\n".join(report(out, args.modes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
