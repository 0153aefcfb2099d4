"""Fitting the chooser from outcome telemetry, and judging it offline.

Learning reads `TrainingRow`s: what it needs of one served request. The
outcome record they come from (its schema, versions and parsing) is
telemetry/record.py's `OutcomeRecord.training_row()`.

Per row, the effective acceptance is the α for which τ(α, γ) equals the tokens
per round actually observed (it folds in rounds where nothing was proposed), and
the round cost is the time per round over the plain step time at that load.
Each tenant's rows weigh in proportion to the square root of their number, so
one tenant's flood of unusual traffic cannot outvote everyone else's.
"""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np

from engines.arms import Arm
from policy.features import RequestFeatures
from policy.model import (
    PRIOR_EXPLORE,
    DraftModel,
    PolicyModel,
    acceptance_features,
    cost_features,
    expected_tokens_per_round,
    prior_draft,
)

MIN_ROWS_PER_DRAFT = 30


@dataclass(frozen=True)
class TrainingRow:
    """One served request, as learning sees it."""

    features: RequestFeatures  # at decision time (rolling acceptance left out)
    arm: Arm
    propensity: float  # probability the logging policy gave this arm
    output_tokens: int
    rounds: int  # target forwards after the first token
    decode_s: float  # seconds after the first token
    tenant: str = ""
    request_id: str = ""

    @property
    def load(self) -> int:
        return min(self.features.load, 64)


def tenant_weights(rows: list[TrainingRow]) -> list[float]:
    """Per-row factors that give each tenant influence ∝ √(its rows): a tenant
    sending 100x the requests of another weighs 10x, not 100x."""
    counts = Counter(r.tenant for r in rows)
    return [1.0 / math.sqrt(counts[r.tenant]) for r in rows]


def alpha_from_tokens_per_round(tpr: float, gamma: int) -> float:
    """Invert τ(α, γ) by bisection (τ rises with α from 1 to γ + 1)."""
    tpr = min(max(tpr, 1.0), gamma + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if expected_tokens_per_round(mid, gamma) < tpr:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def plain_step_model(rows: list[TrainingRow]) -> np.ndarray:
    """Seconds per plain decode step as a + b · load, from plain rows."""
    x, y, w = [], [], []
    for r, tw in zip(rows, tenant_weights(rows)):
        if r.arm.is_plain and r.output_tokens > 1 and r.decode_s > 0:
            x.append([1.0, r.load])
            y.append(r.decode_s / (r.output_tokens - 1))
            w.append(r.output_tokens * tw)
    if len(x) < 3:
        return np.array([float(np.median(y)) if y else 0.05, 0.0])
    return _wls(np.array(x), np.array(y), np.array(w), ridge=1e-6)


def _wls(x: np.ndarray, y: np.ndarray, w: np.ndarray, ridge: float = 1e-3,
         prior: np.ndarray | None = None) -> np.ndarray:
    """Weighted least squares with a ridge that pulls toward `prior` (zero when
    None). Directions the data never moves (e.g. load when every request ran
    alone) keep the prior's value instead of collapsing to zero."""
    sw = np.sqrt(w / w.mean())[:, None]
    a, b = x * sw, y * sw[:, 0]
    p = np.zeros(x.shape[1]) if prior is None else np.asarray(prior, dtype=np.float64)
    return np.linalg.solve(a.T @ a + ridge * np.eye(x.shape[1]), a.T @ b + ridge * p)


def exploration_share(rows: int) -> float:
    """Exploration anneals with evidence: ~1.5/√n of requests try another arm
    (0.15 at 100 outcomes, 0.05 at 900), never below 0.03 so that a change in
    traffic or hardware is still noticed."""
    return float(min(PRIOR_EXPLORE, max(0.03, 1.5 / np.sqrt(max(rows, 1)))))


MIN_LOADED_ROWS = 20  # rows at load >= LOADED before the load terms are learned rather than taken from the prior
LOADED = 4


def fit_round_cost(x: np.ndarray, y: np.ndarray, w: np.ndarray, prior: np.ndarray) -> np.ndarray:
    """Round cost over [1, γ, load, γ·load]. The load terms are learned only from
    rows that ran under real load; until there are enough, they stay the
    prior's and only [1, γ] are fitted (else noise between load 0 and 1 gets
    extrapolated to load 30). Learned load terms are kept non-negative:
    verifying more tokens never gets cheaper as the batch grows."""
    if int((x[:, 2] >= LOADED).sum()) < MIN_LOADED_ROWS:
        base = _wls(x[:, :2], y - x[:, 2:] @ prior[2:], w, ridge=1e-2, prior=prior[:2])
        return np.concatenate([base, prior[2:]])
    coef = _wls(x, y, w, ridge=1e-2, prior=prior)
    coef[2:] = np.maximum(coef[2:], 0.0)
    return coef


def fit(rows: list[TrainingRow], version: str | None = None, explore: float | None = None) -> PolicyModel:
    t0 = time.perf_counter()
    step = plain_step_model(rows)
    by_draft: dict[str, list[tuple[RequestFeatures, int, float, float, float, int]]] = defaultdict(list)
    for r, tw in zip(rows, tenant_weights(rows)):
        if r.arm.is_plain or r.rounds <= 0 or r.decode_s <= 0:
            continue
        tpr = (r.output_tokens - 1) / r.rounds  # the first token comes from the prefill
        plain_step = max(float(step @ [1.0, r.load]), 1e-6)
        cost = (r.decode_s / r.rounds) / plain_step
        by_draft[r.arm.draft].append((r.features, r.arm.gamma, alpha_from_tokens_per_round(tpr, r.arm.gamma), cost,
                                      r.rounds * tw, r.rounds))

    drafts = {}
    for name, items in by_draft.items():
        if len(items) < MIN_ROWS_PER_DRAFT:
            continue
        prior = prior_draft("ngram" if name.startswith("ngram") else "model")
        x = np.array([np.append(acceptance_features(f), 1.0) for f, *_ in items])
        alpha = np.clip([a for _, _, a, _, _, _ in items], 0.02, 0.98)
        w = np.array([it[4] for it in items], dtype=np.float64)
        accept = _wls(x, np.log(alpha / (1 - alpha)), w, ridge=0.3, prior=prior.accept_coef)
        xc = np.array([cost_features(g, f.load) for f, g, *_ in items])
        cost = fit_round_cost(xc, np.array([it[3] for it in items]), w, np.asarray(prior.cost_coef))
        drafts[name] = DraftModel(accept.tolist(), cost.tolist(), prior.overhead_steps,
                                  prior.overhead_per_prompt_token, sum(it[5] for it in items))
    lengths: dict[str, list[int]] = defaultdict(list)
    for r in rows:
        lengths[r.features.category].append(r.output_tokens)
    typical = {c: float(np.median(v)) for c, v in lengths.items() if len(v) >= 10}
    version = version or time.strftime("v%Y%m%d-%H%M%S") + f".{int(time.time() * 1000) % 1000:03d}"
    explore = exploration_share(len(rows)) if explore is None else explore
    model = PolicyModel(version, drafts, explore, output_tokens=typical)
    model.metrics = dict(rows=len(rows), fit_s=round(time.perf_counter() - t0, 3),
                         plain_step_s=[round(float(v), 6) for v in step])
    return model


def observed_speed(row: TrainingRow, step: np.ndarray) -> float:
    """A row's speed relative to plain at its load: plain step time x tokens / time."""
    plain_step = max(float(step @ [1.0, row.load]), 1e-6)
    return plain_step * max(row.output_tokens - 1, 1) / max(row.decode_s, 1e-9)


def greedy_arm(model: PolicyModel, f: RequestFeatures, arms: list[Arm]) -> Arm:
    """The arm the model ranks first (ties to the earlier, cheaper arm)."""
    by_draft: dict[str, list[int]] = defaultdict(list)
    for a in arms:
        if not a.is_plain:
            by_draft[a.draft].append(a.gamma)
    speed = {Arm(): 1.0}
    for d, gammas in by_draft.items():  # α once per draft, not once per arm
        speed.update({Arm(d, g): s for g, s in zip(gammas, model.speedups(f, d, gammas))})
    return arms[max(range(len(arms)), key=lambda i: (speed[arms[i]], -i))]


def offline_value(model: PolicyModel, rows: list[TrainingRow], arms: list[Arm],
                  step: np.ndarray | None = None) -> float | None:
    """Self-normalised inverse-propensity estimate of the mean relative speed the
    model's greedy choice among `arms` would have had on the logged rows.
    None when no logged arm agrees with the model's choice (no overlap)."""
    step = plain_step_model(rows) if step is None else step
    num = den = 0.0
    for r in rows:
        if r.propensity <= 0 or greedy_arm(model, r.features, arms) != r.arm:
            continue
        num += observed_speed(r, step) / r.propensity
        den += 1.0 / r.propensity
    return num / den if den > 0 else None
