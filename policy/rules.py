"""Operator rules: YAML, validated with pydantic, ordered, first match wins.

A rule has a `name`, a `when` (every condition given must hold; none = always)
and a `then` (what to do). The file ends with an explicit `default` action.
"""

from __future__ import annotations

import hashlib
from functools import cached_property
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engines.arms import Arm
from engines.errors import InvalidRequest
from policy.classifier import CATEGORIES
from policy.features import RequestFeatures

SHIPPED_RULES = Path(__file__).resolve().parent / "default_rules.yaml"
"""The rules a gateway runs when none are configured (and the teaching example)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Range(_Strict):
    """Numeric bounds; every bound given must hold."""

    gt: float | None = None
    gte: float | None = None
    lt: float | None = None
    lte: float | None = None

    @model_validator(mode="after")
    def _nonempty(self):
        if all(v is None for v in (self.gt, self.gte, self.lt, self.lte)):
            raise ValueError("give at least one of gt, gte, lt, lte")
        lo = max((v for v in (self.gt, self.gte) if v is not None), default=None)
        hi = min((v for v in (self.lt, self.lte) if v is not None), default=None)
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"empty range: lower bound {lo} > upper bound {hi}")
        return self

    def holds(self, x: float) -> bool:
        return ((self.gt is None or x > self.gt) and (self.gte is None or x >= self.gte)
                and (self.lt is None or x < self.lt) and (self.lte is None or x <= self.lte))

    def describe(self) -> str:
        ops = {"gt": ">", "gte": ">=", "lt": "<", "lte": "<="}
        return " and ".join(f"{ops[k]} {v:g}" for k, v in self.model_dump().items() if v is not None)


class When(_Strict):
    """Conditions on the request's features; all given must hold."""

    category: list[str] | None = None
    """Any of these categories."""
    temperature: Range | None = None
    top_p: Range | None = None
    expected_length: Range | None = None
    """Expected output tokens."""
    prompt_length: Range | None = None
    """Prompt tokens."""
    load: Range | None = None
    """Requests running plus waiting in the engine."""
    tenant: list[str] | None = None

    @field_validator("category")
    @classmethod
    def _known_categories(cls, v):
        unknown = [c for c in v or [] if c not in CATEGORIES]
        if unknown:
            raise ValueError(f"unknown categories {unknown}; known: {list(CATEGORIES)}")
        return v

    def failed(self, f: RequestFeatures) -> str | None:
        """The first condition that does not hold, described; None when all hold."""
        why = next(self._failures(f), None)
        return None if why is None else why()

    def holds(self, f: RequestFeatures) -> bool:
        """Whether every condition holds: the decision path, which never describes (a
        generator of failures per rule took ~2.5 us of it, checked in order here)."""
        if self.category is not None and f.category not in self.category:
            return False
        if self.tenant is not None and f.tenant not in self.tenant:
            return False
        for _, attribute, r in self._bounds:
            if not r.holds(getattr(f, attribute)):
                return False
        return True

    @cached_property
    def _bounds(self) -> tuple[tuple[str, str, Range], ...]:
        """(field, the RequestFeatures attribute it bounds, its Range) for every bound given."""
        return tuple((name, attribute, r) for name, attribute in _BOUNDED if (r := getattr(self, name)) is not None)

    def _failures(self, f: RequestFeatures):
        """Each condition that does not hold, as a function that describes it."""
        if self.category is not None and f.category not in self.category:
            yield lambda: f"category {f.category!r} not in {self.category}"
        if self.tenant is not None and f.tenant not in self.tenant:
            yield lambda: f"tenant {f.tenant!r} not in {self.tenant}"
        for name, attribute, r in self._bounds:
            if not r.holds(value := getattr(f, attribute)):
                yield lambda name=name, value=value, r=r: f"{name} {value:g} is not {r.describe()}"


# When's bounded conditions, in the order they are checked: (field, the RequestFeatures attribute it bounds)
_BOUNDED = (("temperature", "temperature"), ("top_p", "top_p"), ("expected_length", "expected_output_tokens"),
            ("prompt_length", "prompt_tokens"), ("load", "load"))


class GammaRange(_Strict):
    min: int = Field(1, ge=1)
    max: int = Field(32, ge=1)

    @model_validator(mode="after")
    def _order(self):
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must be <= max ({self.max})")
        return self


class Guard(_Strict):
    """Stop the policy choosing a draft for a category while its rolling
    acceptance (accepted per verified token) is low. It steers the policy's own
    choices: an arm a request asks for is held to the rule's drafts and γ bounds
    only (allow_requested_arm: false refuses requests' arms)."""

    min_acceptance: float = Field(0.55, ge=0, le=1)
    min_samples: int = Field(20, ge=1)
    """Rounds of evidence (decayed) needed before the guard may trip. Evidence is
    kept per tenant, from policy-chosen requests only: a request that forces an
    arm, and another tenant's traffic, never move it."""
    reprobe: float = Field(0.02, ge=0, le=1)
    """Share of guarded requests that still try the draft, so it can recover."""
    drafts: list[str] | None = None
    """Drafts the guard watches (None: all). Prompt lookup costs almost nothing
    to verify and can pay at acceptance well below 0.55, so it is often left out."""


class Then(_Strict):
    """What a matching rule does. `force` excludes the other fields."""

    force: str | None = None
    """'plain' or 'DRAFT:GAMMA': no model, no exploration."""
    drafts: list[str] | None = None
    """Only these drafts may be used (plain always may)."""
    gamma: GammaRange | None = None
    explore: float | None = Field(None, ge=0, le=1)
    """Exploration strength for matching requests: 0 always takes the predicted best arm, 1 samples arms
    in proportion to the model's belief that each is best (Thompson sampling); None: the model's."""
    guard: Guard | None = None
    allow_requested_arm: bool = True
    """Honour a request's own arm when it is otherwise allowed."""

    @field_validator("force")
    @classmethod
    def _arm_syntax(cls, v):
        if v is not None:
            try:
                Arm.parse(v)
            except InvalidRequest as e:
                raise ValueError(f"force: {e.message}") from None
        return v

    @model_validator(mode="after")
    def _force_alone(self):
        if self.force is not None and (self.drafts or self.gamma or self.explore is not None or self.guard):
            raise ValueError("force cannot be combined with drafts, gamma, explore or guard")
        return self


class Rule(_Strict):
    name: str = Field(min_length=1, max_length=100)
    when: When = When()
    then: Then


class RuleSet(_Strict):
    version: Literal[1] = 1
    rules: list[Rule] = Field(default_factory=list, max_length=1000)
    default: Then = Then()
    """Applied when no rule matches (required in files, so the fallback is explicit)."""

    @model_validator(mode="after")
    def _unique_names(self):
        names = [r.name for r in self.rules]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"rule names must be unique: {dup}")
        return self

    @cached_property
    def digest(self) -> str:
        """Content version of the rules, for logs, traces and GetStatus."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:12]

    def first(self, f: RequestFeatures) -> tuple[Rule | None, Then]:
        """First rule whose conditions hold (None: the default) and its action."""
        for rule in self.rules:
            if rule.when.holds(f):
                return rule, rule.then
        return None, self.default

    def match(self, f: RequestFeatures) -> tuple[Rule | None, Then, list[str]]:
        """First rule whose conditions hold, its action, and why earlier rules did not match."""
        skipped = []
        for rule in self.rules:
            why = rule.when.failed(f)
            if why is None:
                return rule, rule.then, skipped
            skipped.append(f"{rule.name}: {why}")
        return None, self.default, skipped


class RulesError(ValueError):
    """A rules file is invalid; the message names the file, the rule and the field."""


def parse_rules(text: str, source: str = "<rules>") -> RuleSet:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise RulesError(f"{source}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise RulesError(f"{source}: expected a mapping with 'rules' and 'default', got {type(data).__name__}")
    if "default" not in data:
        raise RulesError(f"{source}: missing 'default' (the action when no rule matches; e.g. default: {{}})")
    try:
        return RuleSet.model_validate(data)
    except ValidationError as e:
        raise RulesError(_describe(e, data, source)) from None


def load_rules(path: str | Path) -> RuleSet:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise RulesError(f"{p}: cannot read: {e.strerror}") from None
    return parse_rules(text, str(p))


def _describe(e: ValidationError, data: dict, source: str) -> str:
    lines = []
    for err in e.errors():
        loc = list(err["loc"])
        where = ""
        if len(loc) >= 2 and loc[0] == "rules" and isinstance(loc[1], int):
            i = loc[1]
            rules = data.get("rules") or []
            name = rules[i].get("name") if i < len(rules) and isinstance(rules[i], dict) else None
            where = f"rule #{i + 1}" + (f" {name!r}" if name else "")
            loc = loc[2:]
        field = ".".join(str(x) for x in loc) or "(top level)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"{source}: {where + ': ' if where else ''}field {field}: {msg}")
    return "\n".join(lines)


NO_RULES = RuleSet()
"""An empty rule set: the model decides everything."""
