"""The engine measures its machine instead of assuming it.

At start-up, on CPU: time the three kinds of forward the engine runs (a decode
step, a lone row verifying drafts, a batch decoding) with the weights as they
load (dense BLAS), laid out for oneDNN, and, where the config allows it, with
the matmuls in bfloat16, each with every core and with one fewer, and keep the
fastest (logged: on one of the project's CPUs oneDNN packing wins 1.4x, on
another it loses 1.4-1.6x, and there bfloat16 matmuls cost the same for 1 to
16 rows). With dense weights, time forwards of several tokens with and without
MKL row packs (engines/layouts.py) and keep the packs that win. Then time
forwards of a few batch shapes to fit the step-cost model the verification
budget uses (engines/budget.py); the scheduler keeps
refitting it from every step it runs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from engines.layouts import LAYOUTS, can_pack_rows, can_run_bf16, pack_rows, route_rows
from engines.llama import LlamaModel, LlamaWeights
from engines.stepcost import StepCost, features, fit

log = logging.getLogger(__name__)

LONE_TOKENS = 9  # a lone row verifying up to 8 drafts (gamma_max's default)
ROW_PACKS = (LONE_TOKENS, 16, 32)  # row counts MKL packs are tried for: a lone verification, batches
# what a layout and thread count are judged by: a decode step, a lone row verifying 8 drafts, 16 rows decoding
# (a decode step alone would not tell layouts apart whose cost differs with the rows the matmuls run)
PROBE = [[(1, False)], [(LONE_TOKENS, True)], [(1, False)] * 16]
LAYOUT_NAMES = {"dense": "dense", "packed": "oneDNN-packed", "bf16": "bfloat16-matmul"}


@dataclass
class Profile:
    threads: int
    layout: str  # a key of engines.layouts.LAYOUTS
    step_s: dict[str, float] = field(default_factory=dict)  # "<threads>t/<layout>" -> the PROBE forwards' seconds
    cost: StepCost = field(default_factory=StepCost)
    buckets: tuple[tuple[int, int], ...] = ()  # MKL row packs kept: (least rows, packed rows)
    pack_s: dict[int, tuple[float, float]] = field(default_factory=dict)  # packed rows -> (dense, packed) forward

    def describe(self) -> str:
        others = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in sorted(self.step_s.items()))
        packs = ", ".join(f"{lo}-{n} tokens padded to {n} ({self.pack_s[n][1] * 1e3:.1f} against "
                          f"{self.pack_s[n][0] * 1e3:.1f} ms dense at {lo})" for lo, n in self.buckets)
        return (f"{self.threads} threads, {LAYOUT_NAMES[self.layout]} weights (a decode step, a lone row feeding "
                f"{LONE_TOKENS} tokens and 16 rows decoding: {others}); MKL row packs: {packs or 'none'}; "
                f"step cost {self.cost.a * 1e3:.1f} ms + "
                f"{self.cost.b * 1e3:.2f} ms/matmul row + {self.cost.e * 1e3:.2f} ms/row feeding several + "
                f"{self.cost.c * 1e3:.2f} ms/row + {self.cost.d * 1e3:.1f} ms beyond one token"
                f"{self._packs_cost()}; one row, by tokens "
                f"fed: {' '.join(f'{t}:{s * 1e3:.1f}' for t, s in sorted(self.cost.lone.items()))} ms")

    def _packs_cost(self) -> str:
        if not self.buckets:
            return ""
        return f" + {self.cost.g * 1e3:.1f} ms packed + {self.cost.f * 1e3:.1f} ms beyond the packs"


def _fastest_steps(model: LlamaModel, shapes: list[list[tuple[int, bool]]], context: int = 64,
                   repeats: int = 7) -> list[float]:
    """Per shape, the fastest of `repeats` forwards of its rows (one row per feed:
    tokens, logits for every position). The shapes are timed round-robin, in
    alternating order, so a machine drifting during the profile moves them alike:
    timed one shape after another, a lone row's 9-token forward once read faster
    than its 1-token one on a machine that slowed down meanwhile."""
    caches = [[model.new_cache(context + n + 1) for n, _ in feeds] for feeds in shapes]
    vocab = min(1000, model.cfg.vocab_size)  # any valid ids: timing does not depend on which
    for c in (c for row in caches for c in row):
        model.forward(torch.randint(0, vocab, (context,), device=model.device), c, all_logits=False)
    times: list[list[float]] = [[] for _ in shapes]
    for r in range(repeats + 1):
        for i in (range(len(shapes)) if r % 2 == 0 else reversed(range(len(shapes)))):
            for c in caches[i]:
                c.lengths[0] = context
            items = [(torch.randint(0, vocab, (n,), device=model.device), c, logits)
                     for (n, logits), c in zip(shapes[i], caches[i])]
            t0 = time.perf_counter()
            model.forward_many(items)
            times[i].append(time.perf_counter() - t0)
    # the fastest, not the median: noise from anything sharing the cores only adds time, and a
    # burst of it during a few repeats must not rank a 9-token forward below a 1-token one;
    # the first round pays for lazy initialisation
    return [min(t[1:]) for t in times]


# batched shapes timed at start-up (tokens per row): decode batches, batches where some rows
# verify drafts (what tells a row's leaving the one-token path from its tokens), and decode
# batches beside a prefill chunk
SHAPES = [[1] * 2, [1] * 4, [1] * 8, [1] * 16, [3] * 4, [1] * 6 + [5] * 2, [1] * 12 + [4] * 4,
          [1] * 4 + [32], [1] * 8 + [128]]


def fit_cost(model: LlamaModel, buckets: tuple[tuple[int, int], ...] = ()) -> StepCost:
    """Time a lone row feeding 1..LONE_TOKENS tokens (kept as measured) and
    forwards of the batched SHAPES; fit the step-cost model over all of them,
    its matmul rows padded as the MKL row packs in place pad them."""
    import numpy as np

    counts = list(range(1, LONE_TOKENS + 1))
    lone = dict(zip(counts, _fastest_steps(model, [[(t, t > 1)] for t in counts], repeats=5)))
    x = [features(t, 1, int(t > 1), buckets) for t in lone]
    y = list(lone.values())
    # a verifying row wants logits for every position; a prefill chunk (a feed longer than any
    # verification) only for its last
    y += _fastest_steps(model, [[(n, 1 < n <= LONE_TOKENS) for n in shape] for shape in SHAPES], repeats=3)
    x += [features(sum(shape), len(shape), sum(n > 1 for n in shape), buckets) for shape in SHAPES]
    return fit(np.array(x), np.array(y), lone, buckets)


def layouts_to_try(pack: bool | str, bf16: bool | str) -> list[str]:
    """The layouts the config allows (True forces one; "auto" lets the profile time it)."""
    if bf16 is True:
        return ["bf16"]
    if pack is True:
        return ["packed"]
    return ["dense"] + (["packed"] if pack == "auto" else []) + (["bf16"] if bf16 == "auto" else [])


def choose_layout(model: LlamaModel, weights: list[LlamaWeights], pack: bool | str, threads: int | None,
                  bf16: bool | str = False) -> Profile:
    """Try the layouts allowed (layouts_to_try) and thread counts on the PROBE
    forwards; leave the fastest in place. `weights`: every weight set to lay out
    alike (the target's, and drafts with their own)."""
    cores = torch.get_num_threads()
    thread_options = [threads] if threads else sorted({cores, max(1, cores - 1)}, reverse=True)
    if bf16 == "auto" and not can_run_bf16(model.dtype):
        bf16 = False  # emulated bfloat16 is not worth timing (True still forces it)
    timings: dict[tuple[int, str], float] = {}
    for layout in layouts_to_try(pack, bf16):
        for w in weights:
            LAYOUTS[layout](w)
        for n in thread_options:
            torch.set_num_threads(n)
            # three repeats, as the batch shapes below: seven added ~5 s to a ~55 s profile for the same choices
            timings[(n, layout)] = sum(_fastest_steps(model, PROBE, repeats=3))
    best_threads, best_layout = min(timings, key=timings.get)
    for w in weights:
        LAYOUTS[best_layout](w)
    torch.set_num_threads(best_threads)
    prof = Profile(best_threads, best_layout, {f"{n}t/{p}": s for (n, p), s in timings.items()})
    if best_layout == "dense" and pack == "auto" and can_pack_rows(model.dtype):
        prof.buckets, prof.pack_s = choose_row_packs(model, weights)
    prof.cost = fit_cost(model, prof.buckets)
    return prof


def choose_row_packs(model: LlamaModel, weights: list[LlamaWeights]) -> tuple[tuple, dict]:
    """MKL row packs worth their memory, left in place: for each size n in
    ROW_PACKS, a lone row's forward of n tokens with weights packed for n
    against dense forwards of fewer tokens; n's bucket starts at the fewest
    tokens above the last bucket from which every dense forward timed is the
    slower (a forward of 2 or 3 tokens runs the fast small-matrix path: padding
    it would cost more than it saves)."""
    dense_at = sorted({*range(2, ROW_PACKS[0] + 1), *(n for n in ROW_PACKS), *(n + 1 for n in ROW_PACKS[:-1])})
    dense_s: dict[int, float] = {}
    packed_s: dict[int, float] = {}
    every = tuple((n, n) for n in ROW_PACKS)
    for w in weights:
        pack_rows(w, every)  # once: the rounds below only route forwards to the copies or not
    for r in range(4):  # dense and packed alternated, each kept at its fastest: drift moves both alike
        packed = r % 2 == 1
        for w in weights:
            route_rows(w, every if packed else ())
        sizes, best = (ROW_PACKS, packed_s) if packed else (dense_at, dense_s)
        for n, t in zip(sizes, _fastest_steps(model, [[(n, True)] for n in sizes], repeats=3)):
            best[n] = min(best.get(n, t), t)
    buckets, last = [], 1
    for n in ROW_PACKS:
        timed = [m for m in dense_at if last < m <= n]
        won = [m for m in timed if all(dense_s[k] > packed_s[n] for k in timed if k >= m)]
        if won:
            buckets.append((won[0], n))
            last = n
    for w in weights:
        pack_rows(w, tuple(buckets))
    return tuple(buckets), {n: (dense_s[lo], packed_s[n]) for lo, n in buckets}
