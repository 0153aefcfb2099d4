"""The arm chooser's model: predicted speedup of every arm for a request.

Structure (it generalises to γ values seldom tried):
    α(draft, context)       acceptance per drafted token, a linear model on the
                            logit scale over category, temperature, top_p,
                            copy signal and prompt length;
    c(draft, γ, load)       cost of one round in plain decode steps, linear in
                            γ, load and γ·load (at high load verification
                            competes for compute that is already saturated);
    τ(α, γ) = (1 − α^(γ+1)) / (1 − α)   expected tokens per round;
    speedup = L / (L · c / τ + o(draft, prompt))   for L expected output tokens,
                            with o the draft's one-off cost (e.g. a model draft
                            prefilling the prompt), so short answers stay plain.

Plain decoding is 1.0 by definition. With no telemetry the prior below applies:
it already avoids speculation at high temperature, high load and short outputs.
Stored as JSON: coefficients only, nothing executable.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np

from policy.classifier import CATEGORIES
from policy.features import RequestFeatures

FORMAT = "specgate.policy_model.v1"


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """τ = (1 − α^(γ+1)) / (1 − α): accepted drafts plus the target's own token."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def acceptance_features(f: RequestFeatures) -> np.ndarray:
    """The α model's inputs: category one-hot, its interaction with temperature,
    and the numeric signals."""
    cat = np.array([f.category == c for c in CATEGORIES], dtype=np.float64)
    t = min(f.temperature, 2.0)
    num = np.array([t, t * t, f.top_p, f.copy_signal, math.log1p(f.prompt_tokens) / 8.0])
    return np.concatenate([cat, cat * t, num])


N_ACCEPT_FEATURES = 2 * len(CATEGORIES) + 5


def cost_features(gamma: int, load: int) -> np.ndarray:
    load = min(load, 64)
    return np.array([1.0, gamma, load, gamma * load], dtype=np.float64)


@dataclass
class DraftModel:
    """Coefficients for one draft."""

    accept_coef: list[float]  # over acceptance_features, logit scale (last entry: intercept)
    cost_coef: list[float]  # over cost_features, in plain steps per round
    overhead_steps: float = 0.0  # fixed cost per request, in plain steps
    overhead_per_prompt_token: float = 0.0
    samples: int = 0  # rounds of telemetry behind the fit (0 = prior)

    def alpha(self, f: RequestFeatures) -> float:
        w = np.asarray(self.accept_coef)
        z = float(acceptance_features(f) @ w[:-1] + w[-1])
        return 1.0 / (1.0 + math.exp(-max(min(z, 30.0), -30.0)))

    def round_cost(self, gamma: int, load: int) -> float:
        # plain Python: a 4-term dot product is cheaper than a numpy call here
        a, b, c, d = self.cost_coef
        load = min(load, 64)
        return max(1.0, a + b * gamma + c * load + d * gamma * load)

    def overhead(self, f: RequestFeatures) -> float:
        return self.overhead_steps + self.overhead_per_prompt_token * f.prompt_tokens


def prior_draft(kind: str) -> DraftModel:
    """Cold-start defaults, from the engine benchmark on this CPU (verifying 8
    drafts cost ~1.35 plain steps) and the rule of thumb that acceptance falls
    with temperature. `kind`: "ngram" (no model) or "model"."""
    w = np.zeros(N_ACCEPT_FEATURES + 1)
    temp, temp2, _top_p, copy, _plen = range(2 * len(CATEGORIES), N_ACCEPT_FEATURES)
    if kind == "ngram":
        w[copy], w[temp], w[-1] = 2.5, -3.0, -1.8  # T=0: α ≈ 0.14 plain prose, ≈ 0.55 strong copy cues
        cost = [1.0, 0.05, 0.0, 0.03]
        over = (2.0, 0.0)  # proposer and bookkeeping per request: short answers stay plain
    else:
        w[copy], w[temp], w[-1] = 0.5, -1.5, -0.2
        cost = [1.0, 0.35, 0.0, 0.03]  # drafting with a model costs a fraction of a step per token
        over = (3.0, 0.002)  # plus the draft prefilling the prompt
    w[temp2] = -0.5
    return DraftModel(w.tolist(), cost, *over)


@dataclass
class PolicyModel:
    version: str
    drafts: dict[str, DraftModel] = field(default_factory=dict)
    explore: float = 0.05  # default exploration share (rules may override)
    metrics: dict = field(default_factory=dict)  # offline scores at training time
    output_tokens: dict[str, float] = field(default_factory=dict)  # category -> median output length seen

    def expected_output_tokens(self, category: str, max_tokens: int, hint: int | None = None) -> int:
        """The request's hint if given, else max_tokens capped by what this category
        usually produces (most answers end at EOS well before max_tokens)."""
        if hint:
            return max(1, min(hint, max_tokens))
        typical = self.output_tokens.get(category)
        return max(1, min(max_tokens, int(typical))) if typical else max_tokens

    def draft(self, name: str) -> DraftModel:
        """A draft this model has never seen gets the prior for its kind."""
        m = self.drafts.get(name)
        return m if m is not None else _PRIORS["ngram" if name.startswith("ngram") else "model"]

    def speedup(self, f: RequestFeatures, draft: str | None, gamma: int) -> float:
        return 1.0 if draft is None else self.speedups(f, draft, [gamma])[0]

    def speedups(self, f: RequestFeatures, draft: str, gammas: list[int]) -> list[float]:
        """Predicted speedup over plain for each γ of one draft (α computed once)."""
        m = self.draft(draft)
        L = max(f.expected_output_tokens, 1)
        alpha, over = m.alpha(f), m.overhead(f)
        return [L / (L * m.round_cost(g, f.load) / expected_tokens_per_round(alpha, g) + over) for g in gammas]

    # storage: plain JSON, nothing executable
    def to_json(self) -> str:
        return json.dumps({
            "format": FORMAT, "version": self.version, "explore": self.explore, "metrics": self.metrics,
            "drafts": {k: vars(v) for k, v in self.drafts.items()}, "output_tokens": self.output_tokens,
        }, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> PolicyModel:
        d = json.loads(text)
        if d.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} artifact")
        drafts = {}
        for name, v in d["drafts"].items():
            m = DraftModel(**v)
            if len(m.accept_coef) != N_ACCEPT_FEATURES + 1 or len(m.cost_coef) != 4:
                raise ValueError(f"draft {name!r}: coefficient shapes do not match this version")
            if not all(math.isfinite(x) for x in m.accept_coef + m.cost_coef):
                raise ValueError(f"draft {name!r}: non-finite coefficients")
            drafts[name] = m
        explore = float(d.get("explore", 0.05))
        if not 0 <= explore <= 1:
            raise ValueError("explore must be in [0, 1]")
        lengths = {str(k): float(v) for k, v in d.get("output_tokens", {}).items() if math.isfinite(float(v))}
        return cls(str(d["version"]), drafts, explore, d.get("metrics", {}), lengths)


_PRIORS = {kind: prior_draft(kind) for kind in ("ngram", "model")}  # read-only
PRIOR_EXPLORE = 0.2  # cold start: nothing is known yet, so try other arms often


def prior_model() -> PolicyModel:
    return PolicyModel(version="prior", explore=PRIOR_EXPLORE)
