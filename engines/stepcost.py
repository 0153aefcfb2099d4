"""The step-cost model: seconds of one target forward, from its shape.

Profiled at start-up (engines/profile.py) and refitted from every step the
scheduler runs; the verification budget (engines/budget.py) prices drafting
and verification with it. Many rows: a + b·tokens (k·tokens while the matmuls run as W @ xᵀ) + c·rows
+ e·(rows feeding more than one token) (+ d once the forward feeds more than
one token, + g once it runs the MKL-packed copies, + h once it leaves the
matmuls run as W @ xᵀ, + p per further pass of the panels over the weights), by
non-negative least squares. One row: a table of measured seconds per token
count, times the machine's pace since.
"""

from __future__ import annotations

import collections
import math

import numpy as np
from scipy.optimize import nnls

from engines.layouts import runs_packed

PACE_RATE = 0.1  # moving average of the machine's pace, from every lone step
SHAPE_RATE = 0.05  # a lone table entry against the one-token step, from the steps of its size


class StepCost:
    """Seconds of one target forward.

    Many rows: a + b · tokens + c · rows + e · multi + d · [tokens > 1] + g ·
    [packed] + h · [laid out], least squares over a sliding window of measured
    steps, where a forward whose matmuls run as W @ xᵀ pays k a token instead
    of b. One slope for both routes was pulled down by prefill chunks (many
    tokens, laid out, cheap each): on an AMD EPYC, one row verifying 4 drafts
    beside 7 decoding added 11.6 ms, priced 8.8 so and 10.8 with the two
    (bench/stepcost.py). `packed`: the forward's tokens reach `packed_from`, where the
    MKL-packed copies (engines/layouts.py) take over from BLAS's small-matrix
    kernels; g is that switch (on the Intel Xeon, 5-9 ms). `laid out`: its tokens
    pass `columns_upto`, where the layers' matmuls leave W @ xᵀ for their layout
    (engines/layouts.py: Columns); h is that switch (on an AMD EPYC ~11 ms: a
    lone forward of 5 tokens 40 ms, of 6 tokens 47). `multi` counts rows feeding more than
    one token (verifying drafts, or a prefill chunk): such a row's attention
    leaves the one-query path and masks its new positions, so its first
    verified draft costs b + e and every further one b (at
    concurrency 16 on the 2-core CPU, regressed step by step: e 1.8-1.9 ms, b
    0.9-1.35 ms; priced at b alone, a row's first draft looked 2-3x cheaper
    than it is). `d` is what leaving the one-token kernels costs for the whole
    forward: on CPU a forward of a single token runs matrix-vector kernels, and
    its second token costs several times what each further one does. `p` is a
    further pass of the panels kernel over the layers' weights (engines/panels.py
    takes a routed forward's tokens `pass_rows` at a time: 4 on AVX-512): linear
    in tokens alone, a first verified draft beside 8 decoding rows (a ninth token,
    a third pass) was priced 3.1 ms on an AMD EPYC where a lone row's ninth token
    took 4.7 (its fifth 3.7, its sixth 2.0), and at concurrency 8 prompt lookup
    ran 0.97x plain (`load-s73`).

    One row (the case that decides speculation at low load): a table of measured
    seconds per token count (`lone`, from the start-up profile), because the
    linear fit, pulled by batched shapes, misjudges it (on one machine it priced
    a second token 31 ms above one, where 17 ms were measured between one token
    and three), times the machine's pace since (`pace`, from every one-row
    step, whatever its size). The table's one-token entry is the unit; a longer
    entry learns slowly from steps of its size what it costs against it. Each
    entry moving on its own went stale: steps of a size the budget stopped
    choosing were never timed again, so when the machine sped up (one-token
    steps 42 -> 26 ms within minutes) verifying one draft stayed priced at 52 ms,
    2x a step, and a lone row verified nothing for whole requests."""

    def __init__(self, a: float = 0.03, b: float = 0.002, c: float = 0.0, d: float = 0.0, window: int = 400,
                 lone: dict[int, float] | None = None, e: float = 0.0, g: float = 0.0,
                 packed_from: int | None = None, h: float = 0.0, columns_upto: int = 0, k: float | None = None,
                 p: float = 0.0, pass_rows: int = 0):
        self.a, self.b, self.c, self.d, self.e, self.g, self.h, self.p = a, b, c, d, e, g, h, p
        self.pass_rows = pass_rows  # a routed forward's tokens per pass of the panels over the weights (0: no panels)
        self.k = b if k is None else k  # per token of a forward run as W @ xᵀ (unfitted: as any other)
        self.packed_from = packed_from  # forwards of at least this many tokens run MKL-packed copies
        self.columns_upto = columns_upto  # forwards of up to this many tokens run the layers as W @ xᵀ (0: none)
        self.lone: dict[int, float] = dict(lone or {})  # tokens fed by a lone row -> seconds at pace 1
        self.pace = 1.0  # the machine's speed now against the table's: a step's seconds over its entry
        self._unit = min(self.lone, default=1)  # the entry the others are learnt against
        self._lone_fit: dict[int, float] | None = None  # its monotone fit, remade when the table moves
        self._obs: collections.deque = collections.deque(maxlen=window)
        self._since_fit = 0

    def to_dict(self) -> dict:
        """The prices (not the window of steps behind them), for a profile kept on disk."""
        return dict(a=self.a, b=self.b, c=self.c, d=self.d, e=self.e, g=self.g, h=self.h, k=self.k, p=self.p,
                    packed_from=self.packed_from, columns_upto=self.columns_upto, pass_rows=self.pass_rows,
                    lone={str(t): s for t, s in self.lone.items()})

    @staticmethod
    def from_dict(d: dict) -> StepCost:
        """From to_dict() output; ValueError (or TypeError) on anything else."""
        prices = [float(d[k]) for k in "abcdeghkp"]
        lone = {int(t): float(s) for t, s in dict(d["lone"]).items()}
        packed_from, columns_upto, pass_rows = d["packed_from"], d["columns_upto"], d["pass_rows"]
        if not all(map(math.isfinite, prices + list(lone.values()))) or min(lone.values(), default=1.0) <= 0 or (
                packed_from is not None and (not isinstance(packed_from, int) or packed_from < 1)) or any(
                not isinstance(n, int) or n < 0 for n in (columns_upto, pass_rows)):
            raise ValueError("step-cost prices out of range")
        a, b, c, dd, e, g, h, k, p = prices
        return StepCost(a, b, c, dd, lone=lone, e=e, g=g, packed_from=packed_from, h=h, columns_upto=columns_upto, k=k,
                        p=p, pass_rows=pass_rows)

    def seconds(self, tokens: int, rows: int, multi: int = 0) -> float:
        """The linear model: `features`' columns written out (the budget prices hundreds of forwards a step)."""
        as_columns = tokens <= self.columns_upto
        return (self.a + (self.k if as_columns else self.b) * tokens + self.c * rows + self.e * multi
                + (self.d if tokens > 1 else 0.0) + (self.g if runs_packed(tokens, self.packed_from) else 0.0)
                + (self.h if leaves_columns(tokens, self.columns_upto) else 0.0)
                + self.p * further_passes(tokens, self.columns_upto, self.pass_rows))

    def step(self, tokens: int, rows: int, multi: int = 0) -> float:
        """What the budget prices a forward at: measured for one row where known, else the model."""
        if rows == 1 and self.lone:
            if self._lone_fit is None:
                self._lone_fit = monotone(self.lone)
            if tokens in self._lone_fit:
                return self.pace * self._lone_fit[tokens]
            known = max((v for t, v in self._lone_fit.items() if t <= tokens), default=0.0)
            return max(self.pace * known, self.seconds(tokens, 1, int(tokens > 1)))
        return self.seconds(tokens, rows, multi)

    def lone_prices(self, most: int) -> tuple[float, ...]:
        """What a lone row feeding 1, 2, ..., `most` tokens is priced at now: a decode
        step, then one verifying 1, 2, ... drafts (what speculation costs on this machine)."""
        return tuple(self.step(t, 1, int(t > 1)) for t in range(1, most + 1))

    def observe(self, tokens: int, rows: int, seconds: float, multi: int = 0) -> None:
        if rows == 1 and tokens in self.lone:
            self.pace += (seconds / self.lone[tokens] - self.pace) * PACE_RATE
            if tokens != self._unit:
                self.lone[tokens] += (seconds / self.pace - self.lone[tokens]) * SHAPE_RATE
                self._lone_fit = None
        self._obs.append((tokens, rows, multi, seconds))
        self._since_fit += 1
        if self._since_fit >= 50:
            self.refit()

    def refit(self) -> None:
        self._since_fit = 0
        if len(self._obs) < 20:
            return
        x = np.array([features(t, r, m, self.packed_from, self.columns_upto, self.pass_rows)
                      for t, r, m, _ in self._obs])
        y = np.array([s for *_, s in self._obs])
        # a column that does not vary in the window is not observable: its coefficient stays as it is
        fixed = [j for j in range(1, COLUMNS) if np.ptp(x[:, j]) == 0]
        prior = np.array([self.a, self.b, self.c, self.e, self.d, self.g, self.h, self.k, self.p])
        free = [j for j in range(COLUMNS) if j not in fixed]
        y = y - x[:, fixed] @ prior[fixed]
        x = x[:, free]
        # ridge toward the current fit: a window of similar steps must not swing the slopes
        # (scaled per column, so that a 0/1 column is held as firmly as a token count); and no
        # coefficient below zero: clamping an unconstrained fit afterwards (a negative intercept
        # raised to zero) leaves the others fitted to a model that no longer holds
        lam = 1e-3 * np.array([0.0 if j == 0 else float(x[:, k] @ x[:, k]) for k, j in enumerate(free)])
        coef, _ = nnls(np.vstack([x, np.diag(np.sqrt(lam))]), np.concatenate([y, np.sqrt(lam) * prior[free]]))
        new = dict(zip(free, coef))
        self.a = max(float(new.get(0, self.a)), 1e-4)
        self.b = max(float(new.get(1, self.b)), 1e-5)
        self.c = float(new.get(2, self.c))
        self.e = float(new.get(3, self.e))
        self.d = float(new.get(4, self.d))
        self.g = float(new.get(5, self.g))
        self.h = float(new.get(6, self.h))
        self.k = max(float(new.get(7, self.k)), 1e-5)
        self.p = float(new.get(8, self.p))


COLUMNS = 9  # a, b, c, e, d, g, h, k, p


def leaves_columns(tokens: int, columns_upto: int) -> bool:
    """Whether a forward of this many tokens runs the layers as laid out, where
    smaller ones run them as W @ xᵀ (columns_upto 0: none do)."""
    return 0 < columns_upto < tokens


def further_passes(tokens: int, columns_upto: int, pass_rows: int) -> int:
    """Passes of the panels over the layers' weights beyond the first, for a forward of
    this many tokens (0 where it leaves the route, or no panels run it)."""
    return -(-tokens // pass_rows) - 1 if pass_rows and 0 < tokens <= columns_upto else 0


def features(tokens: int, rows: int, multi: int, packed_from: int | None = None, columns_upto: int = 0,
             pass_rows: int = 0) -> list[float]:
    """One forward's row of the step-cost regression: the columns of a, b, c, e, d, g, h, k and p."""
    as_columns = tokens <= columns_upto
    return [1.0, 0.0 if as_columns else float(tokens), float(rows), float(multi), float(tokens > 1),
            float(runs_packed(tokens, packed_from)), float(leaves_columns(tokens, columns_upto)),
            float(tokens) if as_columns else 0.0, float(further_passes(tokens, columns_upto, pass_rows))]


def fit(x: np.ndarray, y: np.ndarray, lone: dict[int, float] | None = None,
        packed_from: int | None = None, columns_upto: int = 0, pass_rows: int = 0) -> StepCost:
    """A step-cost model from forwards timed at start-up (rows of `features`
    with these packed copies, routes and passes), by non-negative least squares (see
    StepCost.refit), with a lone row's table."""
    (a, b, c, e, d, g, h, k, p), _ = nnls(x, y)
    # a route no forward took has no slope of its own: it is priced as the other
    b, k = (k, k) if not x[:, 1].any() else (b, b) if not x[:, 7].any() else (b, k)
    return StepCost(max(float(a), 1e-4), max(float(b), 1e-5), float(c), float(d), lone=lone, e=float(e),
                    g=float(g), packed_from=packed_from, h=float(h), columns_upto=columns_upto, k=max(float(k), 1e-5),
                    p=float(p), pass_rows=pass_rows)


def monotone(table: dict[int, float]) -> dict[int, float]:
    """The closest non-decreasing fit of a table (pool adjacent violators): a
    longer forward never priced below a shorter one, and one noisy entry pooled
    with its neighbours instead of raising every longer forward to it."""
    blocks: list[list[float]] = []  # [mean, count]
    for t in sorted(table):
        blocks.append([table[t], 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    values = [m for m, n in blocks for _ in range(int(n))]
    return dict(zip(sorted(table), values))
