"""The layers' fused ops (engines/fused.py) against torch's ops, in one process on the
real target, alternating (the machine's drift moves both alike):

  forwards  each shape's fastest forward of `--rounds`, every row over `--context`
            cached positions: a lone row decoding and verifying, batches decoding,
            a batch where one row verifies
  requests  dev prompts served alone (concurrency 1) under each `--modes`, the
            sides alternated and the modes rotated per prompt and per repeat:
            tokens/s with the ops over without, and each mode over plain on each
            side, with 95% bootstrap intervals over prompts. Every decoder the
            engine runs switches (the target and the drafts' layers); the
            step-cost model keeps learning from both sides' steps.

    .venv/bin/python bench/fused.py
"""

from __future__ import annotations

import argparse
import sys

SHAPES = [("1 row decoding", [1]), ("1 row verifying 2", [3]), ("1 row verifying 4", [5]),
          ("4 rows decoding", [1] * 4), ("8 rows, one verifying 4", [1] * 7 + [5]), ("16 rows decoding", [1] * 16)]


def switch(engine, on: bool, ops) -> None:
    for m in engine.decoders:
        m.fused = ops if on else None


def forwards(engine, ops, context: int, rounds: int) -> list[tuple[str, float, float]]:
    """Per shape: (name, fastest seconds with torch's ops, with the fused ones)."""
    from engines.profile import fastest_steps

    feeds = [[(n, n > 1) for n in shape] for _, shape in SHAPES]
    best = {False: [float("inf")] * len(SHAPES), True: [float("inf")] * len(SHAPES)}
    for r in range(rounds):
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            switch(engine, on, ops)
            times = fastest_steps(engine.model, feeds, context=context, repeats=1)
            best[on] = [min(a, b) for a, b in zip(best[on], times)]
    switch(engine, True, ops)
    return [(name, off, on) for (name, _), off, on in zip(SHAPES, best[False], best[True])]


def requests(engine, ops, rows: list[dict], modes: list[str], temperature: float, max_tokens: int, repeats: int,
             log) -> dict:
    """{(mode, on): tokens and seconds per prompt, summed over repeats} (as bench/rounds.py's cells)."""
    import numpy as np

    from bench.engine import dev_request, parse_mode, rotated
    from engines.api import GenerationRequest

    out = {(m, on): dict(tokens=np.zeros(len(rows)), seconds=np.zeros(len(rows)))
           for m in modes for on in (False, True)}
    n = 0
    for rep in range(repeats):
        for i, row in enumerate(rows):
            req = dev_request(row, temperature, max_tokens, rep)
            for mode in rotated(modes, n):
                for on in ((False, True) if n % 2 == 0 else (True, False)):
                    switch(engine, on, ops)
                    arm, fixed = parse_mode(mode)
                    s = engine.generate(GenerationRequest(arm=arm, fixed_gamma=fixed, **req)).stats
                    out[mode, on]["tokens"][i] += s.output_tokens
                    out[mode, on]["seconds"][i] += s.total_s
                    log(f"[{rep + 1}/{repeats}] {row['category']:<14} {mode:<14} {'fused' if on else 'torch'} "
                        f"{s.tokens_per_s:6.1f} tok/s")
            n += 1
    switch(engine, True, ops)
    return out


def main(argv: list[str] | None = None) -> int:
    from bench import cpu_model
    from bench.engine import modes_error
    from bench.rounds import over
    from bench.routes import dev_prompts
    from engines.builtin import BuiltinEngine, drive_from_side_thread
    from engines.config import load_engine_config

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=300, help="forwards: positions cached (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=10, help="forwards a shape and side (default: %(default)s)")
    ap.add_argument("--modes", nargs="*", default=["plain", "eagle:6", "ngram:8"],
                    help="requests: plain, DRAFT:G or DRAFT:G/fixed; none: skip (default: %(default)s)")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--config", help="engine config YAML (default: built-in SmolLM2 config)")
    a = ap.parse_args(argv)
    problem = modes_error(a.modes)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    engine = BuiltinEngine.from_config(load_engine_config(a.config), start_worker=False)
    ops = engine.model.fused
    if ops is None:
        print("the fused ops are off here (no C compiler, a failed check, or the config): nothing to compare")
        engine.close()
        return 1
    print(f"machine: {cpu_model()}; start-up profile: {engine.profile.describe()}", flush=True)
    print(f"forwards over {a.context} cached positions, fastest of {a.rounds} a side:")
    print(f"  {'shape':26s} {'torch ms':>9s} {'fused ms':>9s} {'torch/fused':>12s}")
    for name, off, on in forwards(engine, ops, a.context, a.rounds):
        print(f"  {name:26s} {off * 1e3:9.2f} {on * 1e3:9.2f} {off / on:12.2f}", flush=True)
    if not a.modes:
        engine.close()
        return 0
    rows = dev_prompts(a.per_category, None)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731 - progress
    out = drive_from_side_thread(engine, lambda: requests(engine, ops, rows, a.modes, a.temperature, a.max_tokens,
                                                          a.repeats, log))
    print(f"requests: {len(rows)} dev prompts alone, T={a.temperature:g}, {a.max_tokens} tokens, "
          f"{a.repeats} repeats; 95% intervals over prompts")
    for m in a.modes:
        x, lo, hi = over(out[m, True], out[m, False])
        tps = {on: out[m, on]["tokens"].sum() / out[m, on]["seconds"].sum() for on in (False, True)}
        line = (f"  {m:<14} torch {tps[False]:6.1f} tok/s, fused {tps[True]:6.1f}: "
                f"fused/torch {x:.3f} [{lo:.3f}, {hi:.3f}]")
        if m != a.modes[0]:
            for on in (False, True):
                y, ylo, yhi = over(out[m, on], out[a.modes[0], on])
                line += f"; over {a.modes[0]} {'fused' if on else 'torch'} {y:.3f} [{ylo:.3f}, {yhi:.3f}]"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
