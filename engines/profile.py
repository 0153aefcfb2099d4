"""The engine measures its machine instead of assuming it.

At start-up, on CPU: time the three kinds of forward the engine runs (a decode
step, a lone row verifying drafts, a batch decoding) with the weights as they
load (dense BLAS), laid out for oneDNN, and, where the config allows it, with
the matmuls in bfloat16, each with every core and with one fewer, and keep the
fastest (logged: on one of the project's CPUs oneDNN packing wins 1.4x, on
another it loses 1.4-1.6x, and there bfloat16 matmuls cost the same for 1 to
16 rows). With dense weights, time forwards of several tokens with and without
a copy of the weights MKL packed (engines/layouts.py), from how many tokens
it wins, and keep it from there. Time the target's forwards with its layers'
matmuls as laid out and as W @ xᵀ (engines/layouts.py: Columns) by MKL and by
the panels kernel (engines/panels.py) for 1 to 32 tokens, keep the faster
kernel, then time its head alone both ways for 1 to 32 rows, and run each as
W @ xᵀ up to the rows where that stops winning by 3%. Then time
forwards of a few batch shapes to fit the step-cost model the verification
budget uses (engines/budget.py); the scheduler keeps
refitting it from every step it runs.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch

from engines.layouts import (
    LAYOUTS,
    can_pack_rows,
    can_run_bf16,
    linear,
    pack_rows,
    packs_agree,
    pass_rows,
    route_columns,
    route_rows,
    routed,
)
from engines.llama import LlamaModel, LlamaWeights
from engines.stepcost import StepCost, features, fit

log = logging.getLogger(__name__)

LONE_TOKENS = 9  # a lone row verifying up to 8 drafts (gamma_max's default)
# the forwards dense and MKL-packed weights are timed at (every size 1..9 took the profile 21 s of ~56
# on the Intel Xeon; 5, 7 and 8 tokens fall between neighbours that agree)
PACK_TRIALS = (1, 2, 3, 4, 6, LONE_TOKENS, 16, 32)
# what a layout and thread count are judged by: a decode step, a lone row verifying 8 drafts, 16 rows decoding
# (a decode step alone would not tell layouts apart whose cost differs with the rows the matmuls run)
PROBE = [[(1, False)], [(LONE_TOKENS, True)], [(1, False)] * 16]
# the rows the head is timed at in its layout and as W @ xᵀ: a lone row verifying, and batches decoding
HEAD_TRIALS = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 24, 32)
# the tokens of the lone forwards the layers' matmuls are timed at as laid out and as W @ xᵀ (whole forwards:
# a weight alone stays in cache, where the forward streams every weight from memory); past 16, since panels
# in Q4_1 still beat oneDNN at 24 rows (bench/matmuls.py: 42.7 against 48.8 ms), which 16 rows decoding
# with drafts to verify reach
LAYER_TRIALS = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 24, 32)
# a route as W @ xᵀ is taken where it runs at most this fraction of the layout's time: where the two are
# within noise (6-8 tokens on an AMD EPYC: 43-55 ms either way, by the round), the layout's kernels stay
ROUTE_MARGIN = 0.97
LAYOUT_NAMES = {"dense": "dense", "packed": "oneDNN-packed", "bf16": "bfloat16-matmul"}


@dataclass
class Profile:
    threads: int
    layout: str  # a key of engines.layouts.LAYOUTS
    step_s: dict[str, float] = field(default_factory=dict)  # "<threads>t/<layout>" -> the PROBE forwards' seconds
    cost: StepCost = field(default_factory=StepCost)
    packed_from: int | None = None  # forwards of at least this many rows run the MKL-packed copies (None: none)
    pack_s: dict[int, tuple[float, float]] = field(default_factory=dict)  # tokens -> (dense, packed) forward
    layers_upto: int = 0  # the layers' matmuls run as W @ xᵀ for forwards of up to this many rows (0: never)
    layers_s: dict[int, tuple[float, float]] = field(default_factory=dict)  # tokens -> (as laid out, W @ xᵀ) forward
    head_upto: int = 0  # the head runs as W @ xᵀ for forwards of up to this many rows (0: never)
    head_s: dict[int, tuple[float, float]] = field(default_factory=dict)  # rows -> (its layout, W @ xᵀ) head
    panels: bool = False  # the routes run the panels kernel (engines/panels.py), not MKL
    panels_s: dict[int, tuple[float, float]] = field(default_factory=dict)  # tokens -> (MKL, panels) forward

    def describe(self) -> str:
        others = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in sorted(self.step_s.items()))
        n = self.packed_from
        packs = n and (f"from {n} tokens ({n}: {self.pack_s[n][1] * 1e3:.1f} against {self.pack_s[n][0] * 1e3:.1f} ms "
                       f"dense; {LONE_TOKENS}: {self.pack_s[LONE_TOKENS][1] * 1e3:.1f} against "
                       f"{self.pack_s[LONE_TOKENS][0] * 1e3:.1f})")
        # nothing timed (others empty): not a CPU
        layouts = (f" (a decode step, a lone row feeding {LONE_TOKENS} tokens and 16 rows decoding: {others}); "
                   f"MKL-packed copies: {packs or 'none'}; as W @ xᵀ{self._kernel()}: the layers "
                   f"{self._route(self.layers_upto, self.layers_s, 'tokens')}, the head "
                   f"{self._route(self.head_upto, self.head_s, 'rows')}") if others else ""
        return (f"{self.threads} threads, {LAYOUT_NAMES[self.layout]} weights{layouts}; "
                f"step cost {self.cost.a * 1e3:.1f} ms + "
                f"{self._token_cost()} + {self.cost.e * 1e3:.2f} ms/row feeding several + "
                f"{self.cost.c * 1e3:.2f} ms/row + {self.cost.d * 1e3:.1f} ms beyond one token"
                f"{self._packs_cost()}; one row, by tokens "
                f"fed: {' '.join(f'{t}:{s * 1e3:.1f}' for t, s in sorted(self.cost.lone.items()))} ms")

    @property
    def choice(self) -> str:
        """This profile's choice as step_s names it."""
        return combination_name(self.threads, self.layout)

    def to_dict(self) -> dict:
        return dict(threads=self.threads, layout=self.layout, step_s=self.step_s, cost=self.cost.to_dict(),
                    packed_from=self.packed_from, pack_s={str(n): list(v) for n, v in self.pack_s.items()},
                    layers_upto=self.layers_upto, layers_s={str(n): list(v) for n, v in self.layers_s.items()},
                    head_upto=self.head_upto, head_s={str(n): list(v) for n, v in self.head_s.items()},
                    panels=self.panels, panels_s={str(n): list(v) for n, v in self.panels_s.items()})

    @staticmethod
    def from_dict(d: dict) -> Profile:
        """From to_dict() output; ValueError (or TypeError, KeyError) on anything else."""
        def pairs(m) -> dict[int, tuple[float, float]]:
            return {int(n): (float(v[0]), float(v[1])) for n, v in dict(m).items()}
        prof = Profile(int(d["threads"]), str(d["layout"]), {str(k): float(v) for k, v in dict(d["step_s"]).items()},
                       StepCost.from_dict(d["cost"]), d["packed_from"], pairs(d["pack_s"]), int(d["layers_upto"]),
                       pairs(d["layers_s"]), int(d["head_upto"]), pairs(d["head_s"]), bool(d["panels"]),
                       pairs(d["panels_s"]))
        packs, layers, head = prof.packed_from, prof.layers_upto, prof.head_upto
        holds = (prof.threads >= 1 and prof.layout in LAYOUTS and packs == prof.cost.packed_from
                 and layers == prof.cost.columns_upto
                 and (packs is None or (prof.layout == "dense" and {packs, LONE_TOKENS} <= set(prof.pack_s)))
                 and (layers == 0 or layers in prof.layers_s) and (head == 0 or head in prof.head_s)
                 and (not prof.panels or bool(prof.panels_s))
                 and sorted(prof.cost.lone) == list(range(1, LONE_TOKENS + 1)) and prof.choice in prof.step_s
                 and all(math.isfinite(v) and v > 0 and combination(k)[1] in LAYOUTS for k, v in prof.step_s.items()))
        if not holds:
            raise ValueError("not a profile this version made")
        return prof

    @staticmethod
    def _route(upto: int, times: dict[int, tuple[float, float]], unit: str) -> str:
        if not upto:
            return "never"
        two = f"; 2: {times[2][1] * 1e3:.1f} against {times[2][0] * 1e3:.1f} ms" if 2 in times and upto > 2 else ""
        return f"up to {upto} {unit} ({upto}: {times[upto][1] * 1e3:.1f} against {times[upto][0] * 1e3:.1f} ms{two})"

    def _kernel(self) -> str:
        if not self.panels_s:
            return " by MKL"
        n = max(t for t in self.panels_s if t <= max(self.layers_upto, 4))  # where the two differ most
        mkl, panels = self.panels_s[n]
        return (f" by {'panels' if self.panels else 'MKL'} ({n} tokens: panels {panels * 1e3:.1f} against MKL "
                f"{mkl * 1e3:.1f} ms)")

    def _token_cost(self) -> str:
        if not self.layers_upto:
            return f"{self.cost.b * 1e3:.2f} ms/matmul row"
        return f"{self.cost.k * 1e3:.2f} ms/matmul row (beyond {self.layers_upto} tokens {self.cost.b * 1e3:.2f})"

    def _packs_cost(self) -> str:
        return (f" + {self.cost.g * 1e3:.1f} ms packed" if self.packed_from else "") + (
            f" + {self.cost.h * 1e3:.1f} ms beyond {self.layers_upto} tokens" if self.layers_upto else "") + (
            f" + {self.cost.p * 1e3:.2f} ms a further pass of {self.cost.pass_rows} tokens" if self.cost.pass_rows
            else "")


def combination_name(threads: int, layout: str) -> str:
    """A thread count and layout as step_s names them: "2t/packed"."""
    return f"{threads}t/{layout}"


def combination(key: str) -> tuple[int, str]:
    """(threads, layout) from a step_s key (combination_name); ValueError if it is not one."""
    n, layout = key.split("t/", 1)
    return int(n), layout


def wait_for(device: torch.device) -> None:
    """Until the device has run what was queued: CUDA kernels run asynchronously, so a
    timer read without this measures their launch, not their work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fastest_steps(model: LlamaModel, shapes: list[list[tuple[int, bool]]], context: int = 64,
                   repeats: int = 7) -> list[float]:
    """Per shape, the fastest of `repeats` forwards of its rows (one row per feed:
    tokens, logits for every position). The shapes are timed round-robin, in
    alternating order, so a machine drifting during the profile moves them alike:
    timed one shape after another, a lone row's 9-token forward once read faster
    than its 1-token one on a machine that slowed down meanwhile."""
    caches = [[model.new_cache(context + n + 1) for n, _ in feeds] for feeds in shapes]
    vocab = min(1000, model.cfg.vocab_size)  # any valid ids: timing does not depend on which
    # one context, copied into every cache: a forward over each cache's own (untimed, ~64 tokens each,
    # 18 caches a probe and 81 the step-cost shapes) took more of the profile than the forwards it times
    first, *others = (c for row in caches for c in row)
    model.forward(torch.randint(0, vocab, (context,), device=model.device), first, all_logits=False)
    for c in others:
        c.k[..., :context, :] = first.k[..., :context, :]
        c.v[..., :context, :] = first.v[..., :context, :]
    times: list[list[float]] = [[] for _ in shapes]
    for r in range(repeats + 1):
        for i in (range(len(shapes)) if r % 2 == 0 else reversed(range(len(shapes)))):
            for c in caches[i]:
                c.lengths[0] = context
            items = [(torch.randint(0, vocab, (n,), device=model.device), c, logits)
                     for (n, logits), c in zip(shapes[i], caches[i])]
            t0 = time.perf_counter()
            model.forward_many(items)
            wait_for(model.device)
            times[i].append(time.perf_counter() - t0)
    # the fastest, not the median: noise from anything sharing the cores only adds time, and a
    # burst of it during a few repeats must not rank a 9-token forward below a 1-token one;
    # the first round pays for lazy initialisation
    return [min(t[1:]) for t in times]


def probe_s(model: LlamaModel) -> float:
    """The PROBE forwards' seconds (each its fastest of three) with the weights as they
    are laid out now: what layouts and thread counts are ranked by."""
    # three repeats, as the batch shapes below: seven added ~5 s to a ~55 s profile for the same choices
    return sum(fastest_steps(model, PROBE, repeats=3))


# batched shapes timed at start-up (tokens per row): decode batches, batches where some rows
# verify drafts (what tells a row's leaving the one-token path from its tokens), and decode
# batches beside a prefill chunk
SHAPES = [[1] * 2, [1] * 4, [1] * 8, [1] * 16, [3] * 4, [1] * 6 + [5] * 2, [1] * 12 + [4] * 4,
          [1] * 4 + [32], [1] * 8 + [128]]


def fit_cost(model: LlamaModel, packed_from: int | None = None, columns_upto: int = 0) -> StepCost:
    """Time a lone row feeding 1..LONE_TOKENS tokens (kept as measured) and
    forwards of the batched SHAPES; fit the step-cost model over all of them,
    with forwards of at least `packed_from` tokens on the MKL-packed copies and
    of up to `columns_upto` on the layers' route as W @ xᵀ (by the panels: a pass over
    the weights per `pass_rows` tokens)."""
    import numpy as np

    passes = pass_rows(model.weights) if columns_upto else 0
    counts = list(range(1, LONE_TOKENS + 1))
    lone = dict(zip(counts, fastest_steps(model, [[(t, t > 1)] for t in counts], repeats=5)))
    x = [features(t, 1, int(t > 1), packed_from, columns_upto, passes) for t in lone]
    y = list(lone.values())
    # a verifying row wants logits for every position; a prefill chunk (a feed longer than any
    # verification) only for its last
    y += fastest_steps(model, [[(n, 1 < n <= LONE_TOKENS) for n in shape] for shape in SHAPES], repeats=3)
    x += [features(sum(shape), len(shape), sum(n > 1 for n in shape), packed_from, columns_upto, passes)
          for shape in SHAPES]
    return fit(np.array(x), np.array(y), lone, packed_from, columns_upto, passes)


def layouts_to_try(pack: bool | str, bf16: bool | str) -> list[str]:
    """The layouts the config allows (True forces one; "auto" lets the profile time it)."""
    if bf16 is True:
        return ["bf16"]
    if pack is True:
        return ["packed"]
    return ["dense"] + (["packed"] if pack == "auto" else []) + (["bf16"] if bf16 == "auto" else [])


def choose_layout(model: LlamaModel, weights: list[LlamaWeights], pack: bool | str, threads: int | None,
                  bf16: bool | str = False, routes: bool = True) -> Profile:
    """Try the layouts allowed (layouts_to_try) and thread counts on the PROBE
    forwards; leave the fastest in place. `weights`: every weight set to lay out
    alike (the target's, and drafts with their own). `routes`: also time the
    target's matmuls as W @ xᵀ and route them where faster."""
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
            timings[(n, layout)] = probe_s(model)
    best_threads, best_layout = min(timings, key=timings.get)
    for w in weights:
        LAYOUTS[best_layout](w)
    torch.set_num_threads(best_threads)
    prof = Profile(best_threads, best_layout, {combination_name(n, p): s for (n, p), s in timings.items()})
    if best_layout == "dense" and pack == "auto" and can_pack_rows(model.dtype):
        prof.packed_from, prof.pack_s = choose_packed_from(model, weights)
    if routes:
        prof.layers_upto, prof.layers_s, prof.panels, prof.panels_s = choose_layer_route(model)
        prof.head_upto, prof.head_s = choose_head(model, panels=prof.panels)
    prof.cost = fit_cost(model, prof.packed_from, prof.layers_upto)
    return prof


def choose_layer_route(model: LlamaModel, rounds: int = 3) -> tuple[int, dict, bool, dict]:
    """Time lone forwards of LAYER_TRIALS tokens with the target's layer matmuls as
    laid out, as W @ xᵀ by MKL and, where it builds, by the panels kernel
    (engines/panels.py), the three alternated round by round and each kept at its
    fastest. Keep the kernel that took less over all the sizes, and leave the
    matmuls running as W @ xᵀ by it up to the most tokens below which that won
    by ROUTE_MARGIN at every size timed (0: never, the copies dropped). Drafts
    sharing the target's weights share the route. Gives (tokens up to, tokens ->
    (as laid out, routed) seconds, whether panels, tokens -> (MKL, panels))."""
    w = model.weights
    route_columns(w, LAYER_TRIALS[-1], 0, panels=True)
    modes = ("laid out", "MKL") + (("panels",) if any(c.panel is not None for c in routed(w)) else ())

    def switch(mode: str) -> None:
        for c in routed(w):
            c.upto = 0 if mode == "laid out" else LAYER_TRIALS[-1]
            c.run_panels(mode == "panels")
    best = _alternated(model, {n: [(n, n > 1)] for n in LAYER_TRIALS}, switch, rounds, repeats=1, modes=modes)
    panels = "panels" in best and sum(best["panels"].values()) < sum(best["MKL"].values())
    route = best["panels" if panels else "MKL"]
    times = {n: (best["laid out"][n], route[n]) for n in LAYER_TRIALS}
    upto = upto_where_faster(times)
    if not panels:
        route_columns(w, 0, 0)  # the copies in panels dropped
    route_columns(w, upto, 0, panels=panels)
    return upto, times, panels, ({n: (best["MKL"][n], best["panels"][n]) for n in LAYER_TRIALS}
                                 if "panels" in best else {})


def choose_head(model: LlamaModel, rounds: int = 8, panels: bool = False) -> tuple[int, dict[int, tuple[float, float]]]:
    """Time the target's head for HEAD_TRIALS rows as laid out and as W @ xᵀ (by the
    panels kernel where `panels`, the layers' choice, else MKL; alternated round by
    round, each kept at its fastest), and leave it running as W @ xᵀ up to the most
    rows below which that won by ROUTE_MARGIN at every size timed (0: never).
    Drafts sharing the target's weights share its head."""
    w = model.weights
    layers = max((c.upto for c in routed(w)), default=0)
    route_columns(w, layers, HEAD_TRIALS[-1], panels=panels)
    head, g = w.lm_head, torch.Generator().manual_seed(0)
    xs = {m: torch.randn(m, model.cfg.hidden_size, generator=g).to(model.device, model.dtype) for m in HEAD_TRIALS}

    def switch(column: bool) -> None:
        head.upto = HEAD_TRIALS[-1] if column else 0
    laid, columns = fastest_alternated(switch, lambda x: linear(x, head), xs, rounds, model.device)
    times = {m: (laid[m], columns[m]) for m in HEAD_TRIALS}
    upto = upto_where_faster(times)
    route_columns(w, layers, upto, panels=panels)
    return upto, times


def fastest_alternated(switch, run, xs: dict[int, torch.Tensor], rounds: int,
                       device: torch.device) -> tuple[dict[int, float], dict[int, float]]:
    """Each input's fastest `run(x)` with `switch(False)` and `switch(True)`, alternated
    round by round for `rounds` rounds after two untimed ones (lazy initialisation):
    a machine drifting meanwhile moves both alike. Keyed as `xs` (rows)."""
    best: tuple[dict[int, float], dict[int, float]] = (dict.fromkeys(xs, math.inf), dict.fromkeys(xs, math.inf))
    for r in range(rounds + 2):
        on = r % 2 == 1
        switch(on)
        for n, x in xs.items():
            t0 = time.perf_counter()
            run(x)
            wait_for(device)
            if r >= 2:
                best[on][n] = min(best[on][n], time.perf_counter() - t0)
    return best


def upto_where_faster(times: dict[int, tuple[float, float]], margin: float = ROUTE_MARGIN) -> int:
    """From rows -> (seconds as laid out, as W @ xᵀ): the most rows up to which
    W @ xᵀ won by `margin` at every size timed (0: not at one row)."""
    upto = 0
    for m in sorted(times):
        if times[m][1] > margin * times[m][0]:
            break
        upto = m
    return upto


def _alternated(model: LlamaModel, feeds: dict[int, list[tuple[int, bool]]], switch, rounds: int,
                repeats: int, modes: tuple = (False, True)) -> dict:
    """Each feed's lone forward (its fastest_steps) in every mode, `switch(mode)` cycling
    through `modes` (in turn reversed) for `rounds` each, each kept at its fastest: a
    machine drifting meanwhile moves them alike. Gives mode -> feed -> seconds."""
    best: dict = {m: {} for m in modes}
    for r in range(rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            switch(mode)
            for n, t in zip(feeds, fastest_steps(model, list(feeds.values()), repeats=repeats)):
                best[mode][n] = min(best[mode].get(n, t), t)
    return best


def choose_packed_from(model: LlamaModel, weights: list[LlamaWeights]) -> tuple[int | None, dict]:
    """Pack every weight once for MKL, time lone forwards of PACK_TRIALS tokens
    dense and packed (alternated, each kept at its fastest: drift moves both
    alike), and keep the copies for forwards from the fewest tokens from which
    packed won at every size timed (a forward of 1-3 tokens runs BLAS's fast
    small-matrix path); none where it lost at the largest, or where the copies
    do not compute what the dense weights do (packs_agree)."""
    for w in weights:
        pack_rows(w, 1)
    dense_s: dict[int, float] = {}
    packed_s: dict[int, float] = {}
    if all(packs_agree(w) for w in weights):
        def switch(packed: bool) -> None:
            for w in weights:
                route_rows(w, 1 if packed else None)
        timed = _alternated(model, {n: [(n, True)] for n in PACK_TRIALS}, switch, rounds=2, repeats=3)
        dense_s, packed_s = timed[False], timed[True]
    else:
        log.warning("MKL-packed weights disagree with dense ones: not used")
    won = [n for n in PACK_TRIALS if all(dense_s[k] > packed_s[k] for k in PACK_TRIALS if k >= n)] if packed_s else []
    least = won[0] if won else None
    for w in weights:
        pack_rows(w, least)
    return least, {n: (dense_s[n], packed_s[n]) for n in packed_s}
