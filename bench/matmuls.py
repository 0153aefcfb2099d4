"""The matmul kernels a forward of a few rows can run, timed as a forward reads
them: SmolLM2's 30 layers' weights (qkv, o, gate_up, down; random values, the
real shapes) cycled in order, so each is read from memory as in a decode step
(one weight timed over and over stays in cache, where the kernels rank
otherwise). Per row count: oneDNN-packed weights (x @ Wᵀ), dense BLAS x @ Wᵀ
(F.linear), W @ xᵀ by MKL (a lone row fed as two: engines/layouts.py, Columns)
and by the panels kernel (engines/panels.py, where it builds), in float32 and
in Q4_1 (the weights' values are Q4_1's, as a GGUF model's layers are, so every
kernel multiplies the same numbers), alternated, each its fastest of `--rounds`.

`--against FILE` also times the Q4_1 panels by another source of the panels
kernel (an earlier revision: `git show REV:engines/kernels/panels.c > FILE`),
built as the engine builds its own, over the same panels' bytes (the layout must
be the same), alternated with the rest; the last column is this kernel's time
over that one's.

    .venv/bin/python bench/matmuls.py
    .venv/bin/python bench/matmuls.py --rows 1 2 3 4 6 9 --against /tmp/panels-before.c
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2-135M: qkv, o, gate_up, down [out, in]
KINDS = ("oneDNN x @ Wᵀ", "BLAS x @ Wᵀ", "W @ xᵀ", "panels W @ xᵀ", "panels Q4_1", "Q4_1 against")


def run(rows: tuple[int, ...], layers: int, rounds: int, threads: int,
        against: Path | None = None) -> dict[int, dict[str, float]]:
    """Per row count, per kernel: the fastest pass over every layer's matmuls, in seconds."""
    import torch
    import torch.nn.functional as F

    from engines.panels import Panel, build, check, exactly, kernel

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    dense = [[exactly("q4", o, i, g) for o, i in SHAPES] for _ in range(layers)]
    packed = [[w.to_mkldnn() for w in ws] for ws in dense]
    k = kernel()
    panels = [[Panel(w, k, formats=False) for w in ws] for ws in dense] if k else None
    q4 = [[Panel(w, k) for w in ws] for ws in dense] if k and k.formats else None
    other = None
    if against is not None:
        other = build(against)
        if q4 is None or (other.lanes, other.rows, other.formats) != (k.lanes, k.rows, True):
            raise SystemExit(f"{against}: not the same panels layout as the engine's kernel on this machine")
        problem = check(other)
        if problem:
            raise SystemExit(f"{against}: {problem}")
    kinds = KINDS[:3] + KINDS[3:3 + bool(k) + bool(q4)] + KINDS[5:5 + bool(other)]

    def one_pass(kind: str, m: int) -> float:
        xs = {i: torch.randn(m, i, generator=g) for i in {i for _, i in SHAPES}}
        cols = {i: x if m > 1 else x.expand(2, -1).contiguous() for i, x in xs.items()}
        t0 = time.perf_counter()
        for ws, ps, qs, fs in zip(dense, packed, panels or packed, q4 or packed):
            for w, p, q, f in zip(ws, ps, qs, fs):
                i = w.shape[1]
                if kind == KINDS[3]:
                    q(xs[i])
                elif kind == KINDS[4]:
                    f(xs[i])
                elif kind == KINDS[5]:  # the same bytes, the other kernel's code
                    f.k = other
                    f(xs[i])
                    f.k = k
                elif kind == KINDS[0]:
                    torch.ops.mkldnn._linear_pointwise(xs[i], p, None, "none", [], "")
                elif kind == KINDS[1]:
                    F.linear(xs[i], w)
                else:
                    torch.mm(w, cols[i].t())
        return time.perf_counter() - t0

    out = {}
    for m in rows:
        best = {k: float("inf") for k in kinds}
        for r in range(rounds + 1):  # the first: warm-up, untimed
            for kind in (kinds if r % 2 == 0 else kinds[::-1]):
                s = one_pass(kind, m)
                if r:
                    best[kind] = min(best[kind], s)
        out[m] = best
    return out


def main() -> int:
    from bench import cpu_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8, 9, 16], help="(default: %(default)s)")
    ap.add_argument("--layers", type=int, default=30, help="(default: %(default)s, SmolLM2's)")
    ap.add_argument("--rounds", type=int, default=5, help="(default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="(default: %(default)s)")
    ap.add_argument("--against", type=Path, metavar="FILE",
                    help="another source of engines/kernels/panels.c to time the Q4_1 panels by as well")
    a = ap.parse_args()
    if a.against is not None and not a.against.is_file():
        ap.error(f"--against {a.against}: no such file")
    if min(a.rows) < 1 or a.layers < 1 or a.rounds < 1 or a.threads < 1:
        ap.error("--rows, --layers, --rounds and --threads must be positive")
    print(f"machine: {cpu_model()}; {a.layers} layers of SmolLM2's matmuls, {a.threads} threads, ms per pass")
    res = run(tuple(a.rows), a.layers, a.rounds, a.threads, a.against)
    kinds = list(next(iter(res.values())))
    ratio = KINDS[5] in kinds
    print("rows  " + "  ".join(f"{k:>14s}" for k in kinds) + ("   Q4_1 / against" if ratio else ""))
    for m, best in res.items():
        print(f"{m:4d}  " + "  ".join(f"{best[k] * 1e3:14.2f}" for k in kinds)
              + (f"  {best[KINDS[4]] / best[KINDS[5]]:16.3f}" if ratio else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
