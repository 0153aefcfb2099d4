"""The attention kernel against torch's attention, in one process on the real
target, alternating by round (the machine's drift moves both alike):

  attention the attention alone, 30 layers' worth of calls per shape (the same
            shapes, and a 64-token chunk on its own), torch's ops as forward_many
            runs them against one kernel call a layer
  forwards  each shape's fastest forward of `--rounds`, every row over `--context`
            cached positions: a lone row decoding and verifying, batches decoding,
            a batch where one row verifies, a prefill chunk beside decoding rows
  serving   plain decoding of dev prompts at each `--concurrency`, the scheduler
            driven step by step after prefill (as bench/steps.py), tokens/s per
            pass; the ratio's 95% interval from a bootstrap over passes

    .venv/bin/python bench/attention.py
"""

from __future__ import annotations

import argparse
import json
import time

# (name, tokens fed per row)
SHAPES = [("1 row decoding", [1]), ("1 row verifying 4", [5]), ("4 rows decoding", [1] * 4),
          ("8 rows decoding", [1] * 8), ("8 rows, one verifying 4", [1] * 7 + [5]), ("16 rows decoding", [1] * 16),
          ("8 rows and a 64-token chunk", [1] * 8 + [64])]


def by_torch(shape: list[int], start: int, caches, q, k, v):
    """The rows' attention as forward_many runs it without the kernel: per row, its
    keys and values stored, its queries grouped by kv head, `attend`, laid back."""
    import torch

    from engines.attention import attend, by_kv_head, by_token

    Hk, outs, o = k.shape[1], [], 0
    for t, c in zip(shape, caches):
        kc, vc = c.k[0, 0], c.v[0, 0]  # [Hk, S, D]
        kc[:, start:start + t] = k[o:o + t].transpose(0, 1)
        vc[:, start:start + t] = v[o:o + t].transpose(0, 1)
        outs.append(by_token(attend(by_kv_head(q[o:o + t], Hk), kc[:, :start + t], vc[:, :start + t], t), t))
        o += t
    return torch.cat(outs)


def attention_alone(kernel, context: int, rounds: int, layers: int = 30) -> list[tuple[str, float, float]]:
    """Per shape (and a 64-token chunk alone): (name, fastest seconds of `layers` calls
    with torch's ops, with the kernel), SmolLM2's heads (9 query, 3 kv, 64 wide)."""
    import torch

    from engines.attention import RaggedAttention
    from engines.llama import KVCache

    H, Hk, D = 9, 3, 64
    g, out = torch.Generator().manual_seed(0), []
    for name, shape in [*SHAPES[:-1], ("a 64-token chunk", [64])]:
        caches = [KVCache(1, 1, Hk, context + 64, D, torch.float32, "cpu") for _ in shape]
        n = sum(shape)
        q, kn, vn = (torch.randn(n, h, D, generator=g) for h in (H, Hk, Hk))
        offs = [sum(shape[:i]) for i in range(len(shape))]

        ragged = RaggedAttention(kernel, [(t, context, c) for t, c in zip(shape, caches)], offs, H, Hk, D)
        result = torch.empty(n, H * D)
        best = {False: float("inf"), True: float("inf")}
        for r in range(rounds + 1):
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                t0 = time.perf_counter()
                for _ in range(layers):
                    ragged(0, q, kn, vn, result) if on else by_torch(shape, context, caches, q, kn, vn)
                if r:  # the first round warms both
                    best[on] = min(best[on], time.perf_counter() - t0)
        out.append((name, best[False], best[True]))
    return out


def forwards(engine, context: int, rounds: int) -> list[tuple[str, float, float]]:
    """Per shape: (name, fastest seconds with torch, with the kernel)."""
    from engines.profile import fastest_steps

    model, kernel = engine._sched.model, engine._sched.model.attention_kernel
    feeds = [[(n, 1 < n <= 9) for n in shape] for _, shape in SHAPES]  # a chunk wants its last logits only
    best = {False: [float("inf")] * len(SHAPES), True: [float("inf")] * len(SHAPES)}
    for r in range(rounds):
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            model.attention_kernel = kernel if on else None
            times = fastest_steps(model, feeds, context=context, repeats=1)
            best[on] = [min(a, b) for a, b in zip(best[on], times)]
    model.attention_kernel = kernel
    return [(name, off, on) for (name, _), off, on in zip(SHAPES, best[False], best[True])]


def serving(engine, concurrency: int, steps: int, passes: int, temperature: float) -> tuple[list[float], list[float]]:
    """Plain decoding's tokens/s per pass with torch's attention and with the kernel."""
    from bench import default_data_path
    from bench.steps import spread, timed_pass

    model = engine._sched.model
    kernel = model.attention_kernel
    rows = [json.loads(line) for line in default_data_path().read_text().splitlines() if line.strip()]
    out: dict[bool, list[float]] = {False: [], True: []}
    for n in range(passes):
        prompts = spread(rows, concurrency, n % 7)
        for on in ((False, True) if n % 2 == 0 else (True, False)):
            model.attention_kernel = kernel if on else None
            out[on].append(timed_pass(engine, prompts, "plain", temperature, steps, f"{on}-{n}", spare=8))
    model.attention_kernel = kernel
    return out[False], out[True]


def main() -> int:
    import numpy as np

    from bench import cpu_model
    from bench.specbench.intervals import percentile_interval
    from engines.builtin import BuiltinEngine
    from engines.config import load_engine_config

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=300, help="positions cached before each row (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=10, help="forwards per shape and side (default: %(default)s)")
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 8, 16],
                    help="serving: rows decoding together (default: %(default)s; none: skip serving)")
    ap.add_argument("--steps", type=int, default=60, help="serving: steps timed a pass (default: %(default)s)")
    ap.add_argument("--passes", type=int, default=6, help="serving: passes a side (default: %(default)s)")
    ap.add_argument("--temperature", type=float, default=0.7, help="serving (default: %(default)s)")
    a = ap.parse_args()
    engine = BuiltinEngine.from_config(load_engine_config(None), start_worker=False)
    if engine._sched.model.attention_kernel is None:
        print("the attention kernel is off here (no C compiler, a failed check, or the config): nothing to compare")
        return 1
    print(f"machine: {cpu_model()}; start-up profile: {engine.profile.describe()}", flush=True)
    print(f"attention alone, 30 layers' calls over {a.context} cached positions, fastest of {a.rounds} a side:")
    print(f"  {'shape':30s} {'torch ms':>9s} {'kernel ms':>10s} {'torch/kernel':>13s}")
    for name, off, on in attention_alone(engine._sched.model.attention_kernel, a.context, a.rounds):
        print(f"  {name:30s} {off * 1e3:9.2f} {on * 1e3:10.2f} {off / on:13.2f}", flush=True)
    print(f"forwards over {a.context} cached positions, fastest of {a.rounds} a side:")
    print(f"  {'shape':30s} {'torch ms':>9s} {'kernel ms':>10s} {'torch/kernel':>13s}")
    for name, off, on in forwards(engine, a.context, a.rounds):
        print(f"  {name:30s} {off * 1e3:9.2f} {on * 1e3:10.2f} {off / on:13.2f}", flush=True)
    rng = np.random.default_rng(0)
    for c in a.concurrency:
        off, on = serving(engine, c, a.steps, a.passes, a.temperature)
        r = np.array(on) / np.array(off)
        boots = [float(np.exp(np.log(r[rng.integers(0, len(r), len(r))]).mean())) for _ in range(2000)]
        point = float(np.exp(np.log(r).mean()))
        _, lo, hi = percentile_interval(point, boots)
        print(f"plain decoding at concurrency {c}, T={a.temperature:g}: torch {np.mean(off):.1f} tok/s, kernel "
              f"{np.mean(on):.1f} tok/s; kernel/torch {point:.3f} [{lo:.3f}, {hi:.3f}] over {a.passes} passes",
              flush=True)
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
