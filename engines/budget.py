"""How much to verify, per round and per step.

Per round, each speculative row estimates how likely each drafted token is to
be accepted (given the ones before it):

    prompt lookup   the request's own recent acceptance (an exponential moving
                    average of accepted / tried), relaxing toward a prior while
                    nothing is tried, so that a collapsed row probes again
    model drafts    the draft's confidence in its token, calibrated online
                    against what the target accepted (per draft, greedy or not)

A token's survival is the product of the estimates up to it: the expected number
of tokens it adds if verified.

Per step, the batch has one budget: the target forward costs about
a + b·tokens + c·rows seconds (the step-cost model, profiled at start-up and
refitted from every step). Verifying one more draft token adds b seconds and
its survival in expected tokens; slots are admitted in order of survival while
that beats the batch's current rate (tokens emitted per second):
survival > b · emitted / seconds. Alone, nearly every plausible draft is
verified; in a saturated batch only near-certain ones are. Verifying fewer
drafts is only a smaller k: output stays exactly the target's.
"""

from __future__ import annotations

import collections

import numpy as np
import torch


class StepCost:
    """Seconds of one target forward: a + b · tokens + c · rows, least squares
    over a sliding window of measured steps."""

    def __init__(self, a: float = 0.03, b: float = 0.002, c: float = 0.0, window: int = 400):
        self.a, self.b, self.c = a, b, c
        self._obs: collections.deque = collections.deque(maxlen=window)
        self._since_fit = 0

    def seconds(self, tokens: int, rows: int) -> float:
        return self.a + self.b * tokens + self.c * rows

    def observe(self, tokens: int, rows: int, seconds: float) -> None:
        self._obs.append((tokens, rows, seconds))
        self._since_fit += 1
        if self._since_fit >= 50:
            self.refit()

    def refit(self) -> None:
        self._since_fit = 0
        if len(self._obs) < 20:
            return
        x = np.array([[1.0, t, r] for t, r, _ in self._obs])
        y = np.array([s for *_, s in self._obs])
        if np.ptp(x[:, 1]) == 0:  # every step the same size: the slope is not observable, keep it
            self.a = float(np.median(y - self.b * x[:, 1] - self.c * x[:, 2]))
            return
        # ridge toward the current fit: a window of identical rows must not swing the slopes
        prior = np.array([self.a, self.b, self.c])
        lam = 1e-3 * len(y)
        coef = np.linalg.solve(x.T @ x + lam * np.diag([0.0, 100.0, 100.0]),
                               x.T @ y + lam * np.array([0.0, 100.0, 100.0]) * prior)
        self.a, self.b, self.c = max(float(coef[0]), 1e-4), max(float(coef[1]), 1e-5), max(float(coef[2]), 0.0)


class AcceptanceEstimate:
    """A request's recent per-token acceptance of prompt-lookup drafts."""

    def __init__(self, prior: float = 0.5, rate: float = 0.3, relax: float = 0.05):
        self.prior, self.value, self.rate, self.relax = prior, prior, rate, relax

    def observe(self, verified: int, accepted: int) -> None:
        if verified <= 0:
            # nothing verified this round: drift back toward the prior (a collapsed
            # row becomes worth a probe again once the batch has room)
            self.value += (self.prior - self.value) * self.relax
            return
        trials = accepted + (1 if accepted < verified else 0)  # tokens tried until the first rejection
        self.value += (accepted / trials - self.value) * self.rate


class Calibration:
    """Acceptance against the draft's own confidence, in bins, per (draft, greedy):
    turns a model draft's top probability into an estimate of acceptance."""

    BINS = 10

    def __init__(self, decay: float = 0.995):
        self.decay = decay
        self._tables: dict[tuple, np.ndarray] = {}

    def _table(self, key) -> np.ndarray:
        t = self._tables.get(key)
        if t is None:  # prior: an even chance, worth 4 trials per bin, so that every bin gets verified and learned
            t = self._tables[key] = np.stack([np.full(self.BINS, 2.0), np.full(self.BINS, 4.0)])
        return t

    def estimate(self, key, confidence: torch.Tensor) -> torch.Tensor:
        t = self._table(key)
        bins = (confidence.clamp(0, 0.9999) * self.BINS).long().numpy()
        return torch.from_numpy(t[0][bins] / t[1][bins]).float()

    def observe(self, key, confidence: torch.Tensor, accepted: int) -> None:
        """The tokens tried (up to and including the first rejected) and which were accepted."""
        t = self._table(key)
        t *= self.decay
        tried = min(len(confidence), accepted + 1)
        for i in range(tried):
            b = min(int(float(confidence[i]) * self.BINS), self.BINS - 1)
            t[1][b] += 1.0
            t[0][b] += 1.0 if i < accepted else 0.0


def admit(survivals: list[list[float]], base_tokens: int, emitted: int, cost: StepCost, rows: int) -> list[int]:
    """How many drafted tokens to verify for each row.

    survivals[r][j]: expected tokens added by verifying row r's j+1-th draft
    (non-increasing in j). base_tokens: tokens the forward feeds anyway (one per
    decoding row, prefill chunks); emitted: tokens the step emits anyway (one per
    decoding row). Greedy on survival while it beats the batch's rate."""
    slots = sorted(((s, r, j) for r, ss in enumerate(survivals) for j, s in enumerate(ss)), reverse=True)
    take = [0] * len(survivals)
    tokens, gain = base_tokens, float(emitted)
    for s, r, j in slots:
        if j != take[r]:  # a row's drafts are verified as a prefix
            continue
        seconds = cost.seconds(tokens, rows)
        if s * seconds <= cost.b * max(gain, 1e-9):  # s / b <= gain / seconds: it would lower the rate
            break
        take[r] += 1
        tokens += 1
        gain += s
    return take


def survival(estimates: torch.Tensor) -> list[float]:
    """Per-token acceptance estimates -> expected tokens added by each prefix."""
    out, p = [], 1.0
    for e in estimates.tolist():
        p *= min(max(e, 0.0), 1.0)
        out.append(p)
    return out


def threshold(cost: StepCost, tokens: int, rows: int, emitted: int) -> float:
    """The least survival worth verifying in a step of this size (what drafting
    aims at: a model draft stops before its confidence falls below it)."""
    if emitted <= 0:
        return 0.0
    return min(1.0, cost.b * emitted / max(cost.seconds(tokens, rows), 1e-9))

