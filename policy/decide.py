"""The decision: which arm serves a request, and why. A pure function: same
features, rules, model and rng state give the same decision.

Rules bound the choice (or force it); the model predicts every allowed arm's
speedup; Thompson sampling over the arms predicted within EXPLORE_FLOOR of the
best (and, under load, not below plain) explores where the model is unsure (its
posterior narrows with evidence, so exploration anneals by itself); a
small share of idle requests tries the drafts the model has no outcomes for
(`EXPLORE_UNTRIED`), which Thompson draws around the prior seldom reach; the
propensity of the chosen arm is logged for offline evaluation."""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field

import numpy as np

from engines.arms import MAX_GAMMA, Arm, ArmMenu, DraftKind
from engines.errors import InvalidRequest
from policy.features import RequestFeatures
from policy.model import PolicyModel, acceptance_features, prior_model
from policy.rules import RuleSet, Then

SOURCES = ("rule", "policy", "exploration", "fallback", "request")
EXPLORE_FLOOR = 0.75  # explored arms are predicted at least this share of the best arm's speedup
THOMPSON_DRAWS = 64
# Idle requests (no other in the engine) that try a draft the model prices by the prior alone, at
# the draft's best γ: the judge promotes only on outcomes, so a draft the live model never serves
# would otherwise never be learnt about (`specgate bench-gate --policy`: a start that never served
# the hybrid never left it). Only drafts predicted at least UNTRIED_FLOOR over plain are tried.
EXPLORE_UNTRIED = 0.05
UNTRIED_FLOOR = 0.8
PLAIN = Arm()
# Fixed standard-normal draws (one column per draft; row 0 is the mean): a decision picks one row at random.
_DRAWS = np.concatenate([np.zeros((1, 8)), np.random.default_rng(20261130).standard_normal((THOMPSON_DRAWS, 8))])
_MEAN_ONLY = np.zeros((1, 1))  # no exploration: the mean alone


@dataclass(frozen=True)
class Decision:
    arm: Arm
    source: str  # one of SOURCES
    rule: str | None  # the matched rule's name (None: the default action)
    policy_version: str
    rules_version: str
    predicted_speedup: dict[str, float] = field(default_factory=dict)  # every arm considered
    propensity: float = 1.0  # probability that this arm was chosen, for offline evaluation
    explored: bool = False
    reason: str = ""
    min_confidence: float = 0.0  # for model drafts: stop drafting below this running confidence

    def to_dict(self) -> dict:
        return dict(arm=self.arm.name, draft=self.arm.draft, gamma=self.arm.gamma, source=self.source,
                    rule=self.rule, policy_version=self.policy_version, rules_version=self.rules_version,
                    predicted_speedup=self.predicted_speedup, propensity=self.propensity,
                    explored=self.explored, reason=self.reason, min_confidence=self.min_confidence)

    @staticmethod
    def from_dict(d: dict) -> Decision:
        return Decision(arm=Arm.parse(d["arm"]), source=str(d.get("source", "policy")), rule=d.get("rule"),
                        policy_version=str(d.get("policy_version", "")), rules_version=str(d.get("rules_version", "")),
                        predicted_speedup={str(k): float(v) for k, v in (d.get("predicted_speedup") or {}).items()},
                        propensity=float(d.get("propensity") or 0.0), explored=bool(d.get("explored", False)),
                        reason=str(d.get("reason", "")), min_confidence=float(d.get("min_confidence") or 0.0))


def decide(features: RequestFeatures, rules: RuleSet, model: PolicyModel | None, rng: random.Random,
           arms: ArmMenu) -> Decision:
    """Pick the arm for one request among those `arms` (what the engines serve)
    and the matching rule allow."""
    model = model or prior_model()
    rule, then = rules.first(features)
    rule_name = rule.name if rule else None
    where = f"rule {rule_name!r}" if rule else "default rules"
    base = dict(rule=rule_name, policy_version=model.version, rules_version=rules.digest)

    if then.force is not None:
        arm = Arm.parse(then.force)
        if not arms.allows(arm):
            return Decision(Arm(), "fallback", reason=f"{where} forces {arm.name}, which no engine serves: plain",
                            **base)
        return Decision(arm, "rule", reason=f"{where} forces {arm.name}", **base)

    guarded = _guarded_drafts(features, then, rng)
    layout = _layout_for(arms, then, guarded)
    candidates = layout.candidates

    # an arm the request asks for is held to the rule's drafts and γ bounds, not to the guard: the
    # guard judges the policy's own use of a draft (its tally counts policy-chosen requests only), and
    # a client asking for a fixed configuration (a benchmark's baseline) gets it, not plain instead
    requested = _parse_requested(features.requested_arm)
    if requested is not None and then.allow_requested_arm and \
            requested in (_layout_for(arms, then, set()) if guarded else layout).candidates:
        return Decision(requested, "request", reason=f"requested arm {requested.name}, allowed by {where}", **base)

    if len(candidates) == 1:
        why = f"guard tripped for {sorted(guarded)}" if guarded else (
            "no draft is served" if not arms.drafts else f"{where} allows no draft")
        return Decision(Arm(), "fallback" if not arms.drafts else "rule", reason=f"plain: {why}", **base)

    # one table for the menu: row 0 at the mean of each draft's α, rows 1.. at Thompson draws from its posterior
    strength = then.explore if then.explore is not None else model.explore
    x = acceptance_features(features)
    stack = model.stack(layout.drafts, layout.kinds)
    mean, sd = stack.posterior(x)  # [D] each: logit α
    z = _DRAWS[:, layout.draw_columns] if strength > 0 else _MEAN_ONLY  # [1 + draws, D]
    # ufuncs: np.clip's wrapper costs more
    logit = np.minimum(np.maximum(mean + strength * sd * z, -30.0), 30.0)  # [1 + draws, D]
    table = stack.speeds(1.0 / (1.0 + np.exp(-logit)), features, layout.gamma_max,
                         stack.coverage(x))  # [γ_max, 1 + draws, D]
    # every candidate's speedup under each draw, a column per candidate (plain: 1 under every draw)
    drawn = np.empty((table.shape[1], len(candidates)))  # [1 + draws, C]
    drawn[:, 0] = 1.0
    drawn[:, 1:] = table[layout.gamma_index, :, layout.draft_of[1:]].T
    at_mean = drawn[0].round(4)  # the method: np.round's wrapper costs more
    speed = dict(zip(layout.names, at_mean.tolist()))
    b = int(at_mean.argmax())
    best = candidates[b]  # ties go to the earlier candidate: plain, then ArmMenu.by_preference

    # Thompson sampling among the safe arms: those predicted within EXPLORE_FLOOR of
    # the best, and, when other requests share the engine's steps, none predicted
    # below plain: a slow arm costs more than its own request there, since one slow
    # model-drafted sequence holds back every sequence batched with it.
    floor = EXPLORE_FLOOR * speed[best.name]
    if features.load >= 1:  # the load seen at decision time: requests other than this one
        floor = max(floor, 1.0)
    pool = (at_mean >= floor).nonzero()[0]  # np.flatnonzero's wrapper costs more
    chosen, wins = b, None
    if strength > 0 and len(pool) > 1:
        # the index of the best pool arm under each draw; a draw taken at random decides,
        # so the share of draws an arm wins is exactly its probability of being chosen
        wins = drawn[1:, pool].argmax(axis=1)
        chosen = int(pool[wins[rng.randrange(len(wins))]])
    untried = _untried(layout, stack.models, at_mean, b) if strength > 0 and features.load < 1 else []
    share = EXPLORE_UNTRIED * strength if untried else 0.0
    trying = share > 0 and rng.random() < share
    if trying:
        chosen = untried[rng.randrange(len(untried))]
    # the chosen arm's probability under the mixture: Thompson's share of the draws, or the
    # untried share split evenly, whichever picked it
    thompson = (1.0 if chosen == b else 0.0) if wins is None else (
        float(np.count_nonzero(pool[wins] == chosen)) / len(wins))
    propensity = (1.0 - share) * thompson + (share / len(untried) if chosen in untried else 0.0)
    chosen = candidates[chosen]
    explored = chosen != best
    ctx = (f"{features.category}, T={features.temperature:g}, ~{features.expected_output_tokens} tokens, "
           f"load {features.load}")
    if trying:
        reason = (f"trying {chosen.name} ({speed[chosen.name]:.2f}x predicted), a draft this model has no "
                  f"outcomes for, instead of {best.name} ({speed[best.name]:.2f}x) for {ctx}")
    elif explored:
        reason = (f"exploring {chosen.name} ({speed[chosen.name]:.2f}x predicted) instead of {best.name} "
                  f"({speed[best.name]:.2f}x) for {ctx}")
    else:
        reason = f"{best.name} predicted {speed[best.name]:.2f}x over plain for {ctx}"
    if rule is not None:
        reason += f"; within {where}"
    if guarded:
        reason += f"; guard excluded {sorted(guarded)}"
    return Decision(chosen, "exploration" if explored else "policy", predicted_speedup=speed,
                    propensity=round(propensity, 6), explored=explored, reason=reason, **base)


def _untried(layout: _Layout, models: tuple, at_mean: np.ndarray, best: int) -> list[int]:
    """Per draft the model has no outcomes for, other than the best arm's, its best
    candidate (ties to the earlier), if predicted at least UNTRIED_FLOOR."""
    out = []
    for j, m in enumerate(models):
        if m.samples == 0 and layout.draft_of[best] != j:
            own = layout.of_draft[j]
            i = int(own[int(at_mean[own].argmax())])
            if at_mean[i] >= UNTRIED_FLOOR:
                out.append(i)
    return out


def _guarded_drafts(f: RequestFeatures, then: Then, rng: random.Random) -> set[str]:
    g = then.guard
    if g is None:
        return set()
    # rolling_acceptance: draft -> (acceptance, rounds of evidence), from this tenant's policy-chosen traffic
    low = {d for d, (alpha, rounds) in f.rolling_acceptance.items()
           if rounds >= g.min_samples and alpha < g.min_acceptance and (g.drafts is None or d in g.drafts)}
    # one draw per decision, taken whether or not a draft is low, so that the
    # rng sequence (and thus the decision) does not depend on telemetry order
    reprobe = rng.random() < g.reprobe
    return set() if reprobe else low


@dataclass(frozen=True)
class _Layout:
    """The arms a menu, a rule's bounds and the guard allow, and where each reads
    the speed table: the same for every request they share, so made once."""

    candidates: tuple[Arm, ...]  # plain first, then ArmMenu.by_preference's order
    names: tuple[str, ...]
    drafts: tuple[str, ...]  # the speed table's draft axis
    kinds: tuple[DraftKind, ...]  # what each of those drafts is
    gamma_max: int
    gamma_index: np.ndarray  # per speculative candidate: its γ's row in the speed table (γ − 1)
    draw_columns: np.ndarray  # per draft: its column of _DRAWS
    draft_of: np.ndarray  # per candidate: its draft's index (plain: -1)
    of_draft: tuple[np.ndarray, ...]  # per draft: its candidates' indices


def _layout_for(arms: ArmMenu, then: Then, guarded: set[str]) -> _Layout:
    gamma = (then.gamma.min, then.gamma.max) if then.gamma is not None else (1, MAX_GAMMA)
    return _layout(arms, None if then.drafts is None else tuple(then.drafts), gamma, frozenset(guarded))


@functools.lru_cache(maxsize=512)
def _layout(arms: ArmMenu, allowed: tuple[str, ...] | None, gamma: tuple[int, int],
            guarded: frozenset[str]) -> _Layout:
    lo, hi = gamma
    out = [PLAIN]  # always the reference; the router substitutes a served arm where no engine serves plain
    for d in arms.drafts:
        if (allowed is None or d in allowed) and d not in guarded:
            out.extend(a for a in arms.arms_of(d) if lo <= a.gamma <= hi)
    drafts = sorted({a.draft for a in out[1:]})
    index = {d: j for j, d in enumerate(drafts)}
    g_max = max((a.gamma for a in out[1:]), default=1)
    gamma_index = np.array([a.gamma - 1 for a in out[1:]], dtype=np.intp)
    # a hybrid shares its model part's draws: independent draws rated the head alone above the hybrid
    # that runs the same head plus lookup in a quarter of them, where the hybrid was mostly faster
    # (`specgate bench-replay`: 0.5-1.2% faster with shared draws on four runs, docs/measurements.md)
    own = np.arange(len(drafts)) % _DRAWS.shape[1]
    kinds = tuple(arms.kind_of(d) for d in drafts)
    draw_columns = np.array([own[index[k.model]] if k.model in index else own[j] for j, k in enumerate(kinds)],
                            dtype=np.intp)
    draft_of = np.array([-1] + [index[a.draft] for a in out[1:]], dtype=np.intp)
    of_draft = tuple(np.flatnonzero(draft_of == j) for j in range(len(drafts)))
    return _Layout(tuple(out), tuple(a.name for a in out), tuple(drafts), kinds, g_max, gamma_index, draw_columns,
                   draft_of, of_draft)


def _parse_requested(text: str | None) -> Arm | None:
    if not text:
        return None
    try:
        return Arm.parse(text)
    except InvalidRequest:  # the gateway validates it; here a bad one is just ignored
        return None
