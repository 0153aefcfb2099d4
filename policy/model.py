"""The arm chooser's model: predicted speedup of every arm for a request, with
its uncertainty.

Structure (it generalises to drafts, γ bounds and loads seldom tried):
    α(draft | x)        per-token acceptance: a logistic regression over the
                        request's features (category and its interaction with
                        temperature, sampling shape, copy cues, repetition,
                        code, script, turns, lengths), with the Laplace
                        posterior covariance of its coefficients: the
                        uncertainty that drives exploration;
    q(draft | x)        coverage: the share of rounds that verify a draft at
                        all (prompt lookup finds no match, or the engine judges
                        the draft not worth verifying, in most rounds at T=1);
                        a logistic regression over the same features, learnt
                        once a draft has telemetry (the prior's α already
                        counts every round, so it keeps q = 1);
    c(draft, k, load)   cost of a round that verifies k drafted tokens, in
                        plain decode steps: 1 + a + b·k + e·k·load (at high load
                        verification competes for compute already saturated);
    τ(α, k) = (1 − α^(k+1)) / (1 − α)   expected tokens per verifying round;
    speedup(draft, γ)   = max over k ≤ γ of L / (L · c(q·k) / (q·τ + 1 − q) + o):
                        the engine adapts k per round within the bound γ
                        (engines/budget.py), a round that verifies nothing yields
                        one token, o is the draft's one-off cost per request (e.g.
                        a model draft reading the prompt), so short answers stay plain.

Plain decoding is 1.0 by definition. With no telemetry the prior below applies.
Stored as JSON: coefficients only, nothing executable.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np

from engines.arms import DraftKind
from policy.classifier import CATEGORIES
from policy.features import RequestFeatures

FORMAT = "specgate.policy_model.v2"
N_CATEGORIES = len(CATEGORIES)
N_FEATURES = 2 * N_CATEGORIES + 11  # see acceptance_features; the last one is the intercept
_CAT_INDEX = {c: i for i, c in enumerate(CATEGORIES)}
# cold start: how unsure the prior is of its acceptance (logit scale). The prior is fit to measured speed
# (prior_draft); at 1.0 its draws served the head or lookup alone for half the requests, where its
# mean chose the hybrid for most: 0.3-1.6% slower than at 0.5 in `specgate bench-replay`
PRIOR_LOGIT_SD = 0.5
# the prior's load term e (round cost per verified token and per request in the engine, in plain
# steps). Its α is fit by value at load 0 and runs high, so at 0.02 (a batch of 16's step growing
# ~0.37 for a token every row verifies) it predicted the hybrid 1.26x plain at load 15, where every
# draft measured 0.98-1.00x plain from concurrency 4 to 32 (`load-s70`) and the hybrid it served
# 0.995x (`e2e-s71`): a full batch spends a verified token's compute on cores its rows already
# saturate, and the step budget verifies almost nothing. At 0.06 a verified token costs about a
# step at load 15 (0.09 + 15·0.06), and the prior serves plain there
LOAD_TERM = 0.06
LOAD_CAP = 64  # the round cost's load term grows no further (the fit's rows are capped alike: TrainingRow.load)
TEMPERATURE, INTERCEPT = 2 * N_CATEGORIES, N_FEATURES - 1  # positions in acceptance_features


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """τ = (1 − α^(γ+1)) / (1 − α): accepted drafts plus the target's own token."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def acceptance_features(f: RequestFeatures) -> np.ndarray:
    """x for the α model: category one-hot, its interaction with temperature,
    the per-request signals, and an intercept (last)."""
    x = np.zeros(N_FEATURES)
    t = min(f.temperature, 2.0)
    i = _CAT_INDEX.get(f.category)
    if i is not None:
        x[i] = 1.0
        x[N_CATEGORIES + i] = t
    x[2 * N_CATEGORIES:] = (t, t * t, f.top_p, f.copy_signal, f.repetition, f.code, f.non_ascii,
                            math.log1p(f.prompt_tokens) / 8.0, float(f.turns > 1), min(f.length_ratio, 4.0) / 4.0,
                            1.0)
    return x


@dataclass
class DraftModel:
    """Coefficients for one draft."""

    accept_coef: list[float]  # over acceptance_features, logit scale
    accept_cov: list[float] | None = None  # posterior covariance, row-major [N_FEATURES²]; None: the prior's
    cost_coef: list[float] = field(default_factory=lambda: [0.0, 0.06, 0.02])  # a, b (per k), e (per k·load)
    overhead_steps: float = 0.0  # fixed cost per request, in plain steps
    overhead_per_prompt_token: float = 0.0
    samples: int = 0  # rounds of telemetry behind the fit (0 = prior)
    coverage_coef: list[float] | None = None  # logit of the share of rounds that verify; None: every round

    def __post_init__(self):
        self._w = np.asarray(self.accept_coef, dtype=np.float64)
        self._q = None if self.coverage_coef is None else np.asarray(self.coverage_coef, dtype=np.float64)
        n = len(self.accept_coef)
        self._cov = (np.asarray(self.accept_cov, dtype=np.float64).reshape(n, n) if self.accept_cov is not None
                     else np.eye(n) * (PRIOR_LOGIT_SD ** 2 / 4))

    def logit(self, x: np.ndarray) -> tuple[float, float]:
        """Mean and standard deviation of logit α at features x."""
        mean = float(x @ self._w)
        return mean, math.sqrt(max(float(x @ self._cov @ x), 0.0))

    def alpha(self, f: RequestFeatures) -> float:
        return sigmoid(self.logit(acceptance_features(f))[0])

    def coverage(self, x: np.ndarray) -> float:
        """Share of rounds that verify a draft, at features x."""
        return 1.0 if self._q is None else sigmoid(float(x @ self._q))

    def cost_terms(self) -> tuple[float, float, float]:
        """c(k, load) = fixed + (per_k + per_k_load · min(load, LOAD_CAP)) · k, in plain steps:
        (fixed, per_k, per_k_load)."""
        a, b, e = self.cost_coef
        return 1.0 + max(a, 0.0), max(b, 0.0), max(e, 0.0)

    def round_cost(self, k, load: int):
        """In plain steps, for k tokens verified (an int, or an array of them)."""
        fixed, per_k, per_k_load = self.cost_terms()
        return fixed + (per_k + per_k_load * min(load, LOAD_CAP)) * k

    def overhead(self, f: RequestFeatures) -> float:
        return self.overhead_steps + self.overhead_per_prompt_token * f.prompt_tokens

    def to_dict(self) -> dict:
        return {"accept_coef": self.accept_coef, "accept_cov": self.accept_cov, "cost_coef": self.cost_coef,
                "overhead_steps": self.overhead_steps, "overhead_per_prompt_token": self.overhead_per_prompt_token,
                "samples": self.samples, "coverage_coef": self.coverage_coef}


def sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-max(min(z, 30.0), -30.0)))


def prior_draft(kind: str) -> DraftModel:
    """Cold-start defaults, fit to realised speed on the project's CPUs (float32, the
    shipped EAGLE head trained with passages, on AMD EPYCs).

    The cost side comes from the engine benchmarks (verifying k tokens costs ~0.06 of a
    step each alone, more in a full batch). The acceptance side's intercept and
    temperature slope per draft were fit to three `specgate bench --concurrency 1
    --no-adaptive --skip 3` runs of dev prompts the default workload does not use (each
    category's rows 4-6: 31 requests, every fixed arm each), on three machines of one EPYC
    model that priced the EAGLE head differently (1.26x plain where plain ran 19 tok/s,
    1.14x and 1.19x where it ran 24): first by least squares on log speedup, then all
    drafts together by the mean replayed speed of the policy they make (`specgate
    bench-replay RUN RUN RUN --fit-prior --fit-prior-value`). Acceptance here is therefore
    what makes the choices come out right, not a measured acceptance rate: those runs
    measured prompt lookup (ngram:8) 1.10-1.12x plain, the head 1.14-1.26x and the hybrid
    (lookup where it matches, the head elsewhere) 1.24-1.26x, the hybrid the best fixed
    arm at every temperature on two of them; these coefficients choose the hybrid at
    every temperature when idle, plain as the load rises (first at high temperatures), and
    lookup or the head alone almost never. Replayed on the seven runs of the default
    workload at hand (other prompts, the same head, EPYCs of the same model): 1.005x
    [0.998, 1.013] the prior fit to the first two (paired over their 273 requests),
    faster on five of the seven."""
    w = np.zeros(N_FEATURES)
    t, t2, _top_p, copy, rep, code, _nonascii, _plen, _turns, _lratio, bias = range(TEMPERATURE, N_FEATURES)
    if kind == "ngram":
        w[copy], w[rep], w[code], w[t], w[bias] = 2.5, 2.0, 1.0, -0.923, -1.701
        # verifying k more tokens costs ~0.06·k of a lone row's step
        cost, over = [0.0, 0.06, LOAD_TERM], (2.0, 0.0)  # proposer bookkeeping per request: short answers stay plain
    elif kind == "hybrid":
        w[copy], w[rep], w[code], w[t], w[bias] = 2.5, 2.0, 1.0, -0.439, 0.779
        cost, over = [0.0, 0.09, LOAD_TERM], (3.0, 0.0005)  # priced as the head: lookup rounds cost less
    elif kind == "eagle":
        w[t], w[code], w[bias] = -0.275, 0.3, -0.54
        cost, over = [0.0, 0.09, LOAD_TERM], (3.0, 0.0005)  # plus a draft layer per token; it reads the prompt once
    else:  # a separate model or a subset of the target's layers
        w[copy], w[t], w[bias] = 0.5, -1.5, -0.2
        cost, over = [0.0, 0.8, 0.03], (3.0, 0.002)  # 25 of 30 layers: ~0.8 of a step per drafted token
    w[t2] = -0.3
    return DraftModel(w.tolist(), None, cost, *over)


@dataclass
class PolicyModel:
    version: str
    drafts: dict[str, DraftModel] = field(default_factory=dict)
    explore: float = 1.0  # exploration strength: 0 = always the predicted best, 1 = Thompson sampling
    metrics: dict = field(default_factory=dict)  # offline scores at training time
    output_tokens: dict[str, float] = field(default_factory=dict)  # category -> median output length seen
    _stacks: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # see stack()

    def expected_output_tokens(self, category: str, max_tokens: int, hint: int | None = None) -> int:
        """The request's hint if given, else max_tokens capped by what this category
        usually produces (most answers end at EOS well before max_tokens)."""
        if hint:
            return max(1, min(hint, max_tokens))
        typical = self.output_tokens.get(category)
        return max(1, min(max_tokens, int(typical))) if typical else max_tokens

    def draft(self, name: str, kind: DraftKind | None = None) -> DraftModel:
        """A draft this model has never seen gets the prior for its kind (by default,
        the kind its name suggests)."""
        m = self.drafts.get(name)
        return m if m is not None else prior_of(kind or DraftKind.guess(name))

    def stack(self, drafts: tuple[str, ...], kinds: tuple[DraftKind | None, ...]) -> DraftStack:
        """These drafts' coefficients stacked, made once per menu. The drafts the names
        resolve to are looked up every time (a trainer or a test may still add drafts to
        a model it has not served from); the stack keeps them, so their ids stay unique."""
        ms = tuple(self.draft(d, k) for d, k in zip(drafts, kinds))
        key = tuple(map(id, ms))
        st = self._stacks.get(key)
        if st is None:
            if len(self._stacks) >= 64:  # menus are few; this only bounds a pathological caller
                self._stacks.clear()
            st = self._stacks[key] = DraftStack(ms)
        return st

    def speedup(self, f: RequestFeatures, draft: str | None, gamma: int) -> float:
        return 1.0 if draft is None else self.speedups(f, draft, [gamma])[0]

    def speedups(self, f: RequestFeatures, draft: str, gammas: list[int], logit: float | None = None,
                 kind: DraftKind | None = None) -> list[float]:
        """Predicted speedup over plain for each γ bound of one draft (at α's mean, or at `logit`)."""
        st = self.stack((draft,), (kind,))
        x = acceptance_features(f)
        if logit is None:
            logit = float(st.posterior(x)[0][0])
        table = st.speeds(np.array([[sigmoid(logit)]]), f, max(gammas, default=1), st.coverage(x))
        return [float(table[g - 1, 0, 0]) for g in gammas]

    # storage: plain JSON, nothing executable
    def to_json(self) -> str:
        return json.dumps({
            "format": FORMAT, "version": self.version, "explore": self.explore, "metrics": self.metrics,
            "drafts": {k: v.to_dict() for k, v in self.drafts.items()}, "output_tokens": self.output_tokens,
        }, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> PolicyModel:
        d = json.loads(text)
        if d.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} artifact")
        drafts = {}
        for name, v in d["drafts"].items():
            cov, q = v.get("accept_cov"), v.get("coverage_coef")  # q: absent in models written before it
            if len(v["accept_coef"]) != N_FEATURES or len(v["cost_coef"]) != 3 or (
                    cov is not None and len(cov) != N_FEATURES ** 2) or (q is not None and len(q) != N_FEATURES):
                raise ValueError(f"draft {name!r}: coefficient shapes do not match this version")
            numbers = list(v["accept_coef"]) + list(v["cost_coef"]) + list(cov or []) + list(q or [])
            if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in numbers):
                raise ValueError(f"draft {name!r}: non-finite coefficients")
            drafts[name] = DraftModel(list(v["accept_coef"]), cov, list(v["cost_coef"]),
                                      float(v.get("overhead_steps", 0)), float(v.get("overhead_per_prompt_token", 0)),
                                      int(v.get("samples", 0)), list(q) if q is not None else None)
        explore = float(d.get("explore", 1.0))
        if not 0 <= explore <= 1:
            raise ValueError("explore must be in [0, 1]")
        lengths = {str(k): float(v) for k, v in d.get("output_tokens", {}).items() if math.isfinite(float(v))}
        return cls(str(d["version"]), drafts, explore, d.get("metrics", {}), lengths)


def speedups_at(m: DraftModel, alpha: float, f: RequestFeatures, gammas: list[int],
                coverage: float = 1.0) -> list[float]:
    """The speedup for each γ bound (the engine adapts k within it); see DraftStack.speeds."""
    table = DraftStack((m,)).speeds(np.array([[alpha]]), f, max(gammas, default=1), np.array([coverage]))
    return [float(table[g - 1, 0, 0]) for g in gammas]


class DraftStack:
    """Several drafts' coefficients as arrays (D drafts, N features), so that a
    decision prices its whole menu, every draft and γ under every Thompson draw,
    in a few array operations instead of a call per draft. Made once per menu and
    model (PolicyModel.stack): a DraftModel is not changed once it prices anything."""

    def __init__(self, ms: tuple[DraftModel, ...]):
        self.models = ms
        self.accept = np.array([m._w for m in ms])  # [D, N]
        self.cov = np.array([m._cov for m in ms])  # [D, N, N]
        self.has_q = np.array([m._q is not None for m in ms])  # [D]
        self.q = np.array([m._q if m._q is not None else np.zeros_like(m._w) for m in ms])  # [D, N]
        self.fixed, self.per_k, self.per_k_load = np.array([m.cost_terms() for m in ms]).T  # [D] each
        self.over, self.over_per_token = np.array([(m.overhead_steps, m.overhead_per_prompt_token) for m in ms]).T
        self._all_covered = None if self.has_q.any() else np.ones(len(ms))  # no draft has q: read-only
        if self._all_covered is not None:
            self._all_covered.flags.writeable = False
        self._ks: dict[int, np.ndarray] = {}  # γ_max -> k = 1..γ_max as [γ_max, 1, 1]

    def posterior(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Mean and standard deviation of each draft's logit α at features x: [D] each."""
        return self.accept @ x, np.sqrt(np.maximum((self.cov @ x) @ x, 0.0))

    def coverage(self, x: np.ndarray) -> np.ndarray:
        """Each draft's share of rounds that verify a draft: [D] (1 where it has no coverage model)."""
        if self._all_covered is not None:
            return self._all_covered
        z = np.minimum(np.maximum(self.q @ x, -30.0), 30.0)
        return np.where(self.has_q, 1.0 / (1.0 + np.exp(-z)), 1.0)

    def speeds(self, alpha: np.ndarray, f: RequestFeatures, gamma_max: int, coverage: np.ndarray) -> np.ndarray:
        """Speedups for many values of α at once: α is [R, D], the result [γ_max, R, D],
        entry [γ-1, i, j] the best over k ≤ γ of
        L / (L · c_j(q_j·k) / (q_j·τ(α_ij, k) + 1 − q_j) + o_j), q_j draft j's coverage:
        rounds that verify nothing cost a plain round (c is linear in k, so c(q·k) is the
        mean round's cost) and yield one token. γ leads so that the running best over k
        reads whole [R, D] blocks."""
        L = max(f.expected_output_tokens, 1)
        k = self._ks.get(gamma_max)
        if k is None:
            k = self._ks[gamma_max] = np.arange(1, gamma_max + 1, dtype=np.float64)[:, None, None]  # [γ_max, 1, 1]
        per_k = self.per_k + self.per_k_load * min(f.load, LOAD_CAP)  # [D]: round_cost's, at this load
        over = self.over + self.over_per_token * f.prompt_tokens  # [D]
        a = np.minimum(np.maximum(alpha, 0.0), 1.0 - 1e-9)  # [R, D]; ufuncs: np.clip's wrapper costs more
        # tokens per mean round q·τ + 1 − q, τ = (1 − a^(k+1)) / (1 − a) (expected_tokens_per_round),
        # and the speedup L / (L·c / tokens + o) = tokens / (c + o/L · tokens): fewer passes over the table
        tokens = powers(a, gamma_max)  # [γ_max, R, D]: a^(k+1)
        if coverage is self._all_covered:  # q = 1: the same figures in fewer array calls (a decision's main cost)
            s = 1.0 / (1.0 - a)  # [R, D]
            tokens *= -s
            tokens += s
            cost = self.fixed + per_k * k  # [γ_max, 1, D]
        else:
            q = np.minimum(np.maximum(coverage, 0.0), 1.0)  # [D]
            s = q / (1.0 - a)
            tokens *= -s
            tokens += s + (1.0 - q)
            cost = self.fixed + per_k * (q * k)
        out = (over / L) * tokens
        out += cost
        np.divide(tokens, out, out=out)
        return running_max(out)


def powers(a: np.ndarray, n: int) -> np.ndarray:
    """a^2 .. a^(n+1) stacked: [n, *a.shape], by doubling (log2 n whole-block products;
    `a ** k` broadcast over k calls pow per element, 4x slower on a decision's table)."""
    out = np.empty((n,) + a.shape)
    np.multiply(a, a, out=out[0])
    done = 1
    while done < n:
        # out[i] = a^(i+2); the next block multiplies the first ones by a^done
        step = min(done, n - done)
        np.multiply(out[:step], a if done == 1 else out[done - 2], out=out[done:done + step])
        done += step
    return out


def running_max(x: np.ndarray) -> np.ndarray:
    """The running maximum along the first axis, in place: one whole-block maximum
    per row (ufunc.accumulate steps element by element, 1.6x slower here)."""
    for g in range(1, len(x)):
        np.maximum(x[g], x[g - 1], out=x[g])
    return x


_PRIORS = {kind: prior_draft(kind) for kind in ("ngram", "hybrid", "eagle", "model")}  # read-only


def prior_of(kind: DraftKind) -> DraftModel:
    """The cold-start model for a draft of this kind (a subset of the target's layers
    is priced as a separate model)."""
    return _PRIORS.get(kind.kind, _PRIORS["model"])


def prior_model() -> PolicyModel:
    return PolicyModel(version="prior", explore=1.0)
