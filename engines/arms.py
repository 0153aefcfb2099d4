"""What an arm is, in one place.

An *arm* is a way to decode a request: plain decoding, or speculative decoding
with a named draft and γ, the most tokens drafted per round (the engine may
draft fewer in a round; see engines/budget.py). A *menu* is the set of arms an
engine or a fleet serves. Every parser of arm text and every "is this arm
served" check lives here, so clients get the same error whatever path a
request took.

    plain            plain decoding
    DRAFT:G          draft DRAFT, at most G tokens per round (e.g. ngram:4)
    DRAFT:LO-HI      in configs and CLI menus: every γ from LO to HI

A menu also says what each draft is (`DraftKind`), where the engine knows it:
the policy starts an unseen draft from its kind's prior, and draws a hybrid's
uncertainty together with the model draft it runs.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from engines.errors import InvalidRequest

PLAIN = "plain"
MAX_GAMMA = 64
_NAME = r"[A-Za-z0-9_.-]{1,64}"
_ARM = re.compile(rf"({_NAME}):([0-9]{{1,3}})")  # ASCII digits only: str.isdigit() accepts '²'
_RANGE = re.compile(rf"({_NAME}):([0-9]{{1,3}})-([0-9]{{1,3}})")
DRAFT_NAME = re.compile(_NAME)


@dataclass(frozen=True, order=True)
class Arm:
    """`draft=None` is plain decoding, else (draft, γ)."""

    draft: str | None = None
    gamma: int = 0
    name: str = field(init=False, compare=False, repr=False)  # 'plain' or 'DRAFT:GAMMA', made once

    def __post_init__(self):
        object.__setattr__(self, "name", PLAIN if self.draft is None else f"{self.draft}:{self.gamma}")

    @property
    def is_plain(self) -> bool:
        return self.draft is None

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def parse(text: str, field: str = "arm") -> Arm:
        """`plain` or `DRAFT:GAMMA` with 1 <= GAMMA <= 64; InvalidRequest(field) otherwise."""
        if not isinstance(text, str):
            raise InvalidRequest(field, f"expected 'plain' or 'DRAFT:GAMMA', got {type(text).__name__}")
        t = text.strip()
        if t == PLAIN:
            return Arm()
        m = _ARM.fullmatch(t)
        if m is None:
            raise InvalidRequest(field, f"expected 'plain' or 'DRAFT:GAMMA' (e.g. ngram:4), got {text[:80]!r}")
        gamma = int(m.group(2))
        if not 1 <= gamma <= MAX_GAMMA:
            raise InvalidRequest(field, f"γ must be in [1, {MAX_GAMMA}], got {gamma}")
        return Arm(m.group(1), gamma)


def parse_arm_specs(specs: Iterable[str], ranges: bool = True) -> frozenset[Arm]:
    """Config entries: 'plain', 'DRAFT:G', or (with `ranges`) 'DRAFT:LO-HI'.
    Raises ValueError naming the offending entry."""
    out: set[Arm] = set()
    for spec in specs:
        m = _RANGE.fullmatch(spec.strip()) if isinstance(spec, str) else None
        if m is not None:
            lo, hi = int(m.group(2)), int(m.group(3))
            if not 1 <= lo <= hi <= MAX_GAMMA:
                raise ValueError(f"arm {spec!r}: expected DRAFT:LO-HI with 1 <= LO <= HI <= {MAX_GAMMA}")
            if not ranges and lo != hi:
                raise ValueError(f"arm {spec!r}: a γ range needs gamma_field (a server that takes γ per request)")
            out.update(Arm(m.group(1), g) for g in range(lo, hi + 1))
            continue
        try:
            out.add(Arm.parse(spec))
        except InvalidRequest as e:
            raise ValueError(f"arm {spec!r}: {e.message}") from None
    return frozenset(out)


LONE_KINDS = ("ngram", "eagle", "model", "layers")  # what a draft can be alone (a hybrid names two of them)


@dataclass(frozen=True)
class DraftKind:
    """What a draft is: its configured kind and, for a hybrid, the model draft it runs
    where prompt lookup finds nothing."""

    kind: str  # ngram, layers, model, eagle or hybrid, as engines/config.py names them
    model: str | None = None

    @staticmethod
    def guess(name: str) -> DraftKind:
        """For a draft whose engine does not say (a CLI menu, an older worker, a server
        configured without `draft_kinds`): the default config's names ('ngram-eagle' is
        the hybrid of prompt lookup and the draft 'eagle')."""
        if name.startswith(("hybrid", "ngram-")):
            part = name.removeprefix("ngram-")
            return DraftKind("hybrid", part if part and part != name else None)
        if name.startswith("ngram"):
            return DraftKind("ngram")
        if name.startswith(("eagle", "distill")):
            return DraftKind("eagle")
        return DraftKind("layers" if name.startswith("selfspec") else "model")

    @staticmethod
    def parse(spec: str, drafts: Iterable[str]) -> tuple[str, DraftKind]:
        """'NAME=KIND' (e.g. 'spec=eagle') for one of `drafts`; ValueError naming the entry."""
        name, sep, kind = spec.partition("=")
        if not sep or kind not in LONE_KINDS or name not in drafts:
            raise ValueError(f"{spec!r}: expected NAME=KIND with NAME one of {sorted(drafts)} and KIND one of "
                             f"{', '.join(LONE_KINDS)}")
        return name, DraftKind(kind)


@dataclass(frozen=True)
class ArmMenu:
    """Arms served: plain plus every draft at every γ in [gamma_min, gamma_max],
    or, with `only`, exactly the listed arms (servers configured per arm, e.g. a
    vLLM with K=4; plain included only if listed)."""

    drafts: tuple[str, ...]
    gamma_min: int = 1
    gamma_max: int = 1
    only: frozenset[Arm] | None = None
    adaptive: bool = False
    """True: γ is a bound the engine verifies within, round by round (the built-in
    engine), so a larger γ is never slower. False: a server runs the γ it is given."""
    kinds: tuple[tuple[str, DraftKind], ...] = ()
    """(draft, what it is) where the engine said; others are guessed from their names."""

    def kind_of(self, draft: str) -> DraftKind:
        return self._kinds.get(draft) or DraftKind.guess(draft)

    @functools.cached_property
    def _kinds(self) -> dict[str, DraftKind]:
        return dict(self.kinds)

    @functools.cached_property
    def _served(self) -> frozenset[Arm]:
        return frozenset(self.only if self.only is not None else self.all_arms())

    def allows(self, arm: Arm) -> bool:
        return arm in self._served

    def check(self, arm: Arm) -> None:
        """Raise the InvalidRequest a client sees for an arm this menu does not serve."""
        if self.allows(arm):
            return
        if self.only is not None:  # an explicit menu says it best
            raise InvalidRequest("arm", f"no engine serves {arm.name}; served: {[a.name for a in self.all_arms()]}")
        if arm.draft not in self.drafts:
            raise InvalidRequest("arm.draft", f"no engine serves draft {arm.draft!r}; served: {list(self.drafts)}")
        raise InvalidRequest("arm.gamma", f"must be in [{self.gamma_min}, {self.gamma_max}], got {arm.gamma}")

    @functools.cached_property
    def _by_draft(self) -> dict[str, tuple[Arm, ...]]:
        # each draft's γ from the largest down where the engine adapts, else from the smallest up:
        # the order that breaks ties between equal predictions (see by_preference)
        out: dict[str, list[Arm]] = {}
        for a in self.all_arms():
            if not a.is_plain:
                out.setdefault(a.draft, []).append(a)
        return {d: tuple(v[::-1] if self.adaptive else v) for d, v in out.items()}

    def arms_of(self, draft: str) -> tuple[Arm, ...]:
        """The served arms of one draft, in by_preference's order (made once per
        menu: decisions read it per request)."""
        return self._by_draft.get(draft, ())

    def by_preference(self) -> list[Arm]:
        """Every served arm in the order that breaks ties between equal
        predictions: plain, then per draft its γ from the largest down where the
        engine adapts (a larger bound costs nothing predicted and keeps the long
        copies a request's mean acceptance cannot foresee: ties to the smallest
        served prompt lookup with γ 1-2 where ngram:8 ran 1.26-1.59x plain on the
        same requests), else from the smallest up (the shortest draft that pays)."""
        plain = [a for a in self.all_arms() if a.is_plain]
        return plain + [a for d in self._by_draft for a in self._by_draft[d]]

    def all_arms(self) -> list[Arm]:
        """Plain first (when served), then by draft and γ."""
        if self.only is not None:
            return sorted(self.only, key=lambda a: (not a.is_plain, a.draft or "", a.gamma))
        return [Arm()] + [Arm(d, g) for d in self.drafts for g in range(self.gamma_min, self.gamma_max + 1)]

    @staticmethod
    def of(arms: Iterable[Arm]) -> ArmMenu:
        """The menu of exactly these arms."""
        arms = frozenset(arms)
        spec = [a for a in arms if not a.is_plain]
        return ArmMenu(tuple(sorted({a.draft for a in spec})), min((a.gamma for a in spec), default=1),
                       max((a.gamma for a in spec), default=1), arms)

    @staticmethod
    def union(menus: list[ArmMenu]) -> ArmMenu:
        """Everything any of `menus` serves."""
        if not menus:
            return NOTHING
        kinds: dict[str, DraftKind] = {}
        for m in menus:  # engines that disagree on a name: the first to say wins
            for d, k in m.kinds:
                kinds.setdefault(d, k)
        kinds_t = tuple(sorted(kinds.items()))
        if any(m.only is not None for m in menus):
            return replace(ArmMenu.of(a for m in menus for a in m.all_arms()), kinds=kinds_t)
        return ArmMenu(tuple(sorted({d for m in menus for d in m.drafts})), min(m.gamma_min for m in menus),
                       max(m.gamma_max for m in menus), adaptive=all(m.adaptive for m in menus), kinds=kinds_t)

    @staticmethod
    def parse(spec: str, adaptive: bool = False) -> ArmMenu:
        """A menu on the command line: 'ngram,selfspec:1-8' (every draft at every γ
        in the range) or 'plain,ngram:4,draft:5' (exactly those arms)."""
        entries = [e.strip() for e in spec.split(",") if e.strip()]
        if entries and all(e == PLAIN or _ARM.fullmatch(e) for e in entries):
            return replace(ArmMenu.of([Arm()] + [Arm.parse(e) for e in entries]), adaptive=adaptive)
        names, _, rng = spec.partition(":")
        drafts = tuple(n.strip() for n in names.split(",") if n.strip())
        m = re.fullmatch(r"([0-9]{1,2})(?:-([0-9]{1,2}))?", rng or "1-8")
        if not drafts or m is None or any(not DRAFT_NAME.fullmatch(d) for d in drafts):
            raise ValueError(f"arms {spec!r}: expected 'DRAFT,DRAFT:LO-HI' or 'plain,DRAFT:G,...'")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if not 1 <= lo <= hi <= MAX_GAMMA:
            raise ValueError(f"arms {spec!r}: γ range must satisfy 1 <= LO <= HI <= {MAX_GAMMA}")
        return ArmMenu(drafts, lo, hi, adaptive=adaptive)


NOTHING = ArmMenu((), 1, 1, frozenset())
