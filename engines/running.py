"""A running request's decoding state, and what it feeds one step: the rows
the batching scheduler (engines/scheduler.py) plans and applies."""

from __future__ import annotations

from dataclasses import dataclass, field

from engines import budget
from engines.api import GenerationStats, SamplingParams
from engines.llama import KVCache
from engines.proposers import Proposal
from engines.sampling import Draws
from engines.text import IncrementalText


@dataclass
class Running:
    """One admitted request's decoding state."""

    handle: object  # BuiltinHandle
    sampling: SamplingParams
    gamma: int  # γ_max: the most tokens drafted per round
    draft: str | None
    tokens: list[int]  # prompt + output so far
    prompt_len: int
    cache: KVCache
    proposer: object | None
    draws: Draws  # its random numbers, by output position
    stats: GenerationStats
    text: IncrementalText
    started: float
    reserved: int  # KV positions reserved at admission
    min_confidence: float = 0.0
    fixed: bool = False  # verify the full γ every round (no adaptation)
    priced: str | None = None  # the draft whose measured seconds per drafted token price its drafting
    # the draft's recent acceptance: whether it is worth running this round (a hybrid's: its model part's)
    acceptance: budget.AcceptanceEstimate = field(default_factory=budget.AcceptanceEstimate)
    bias: dict[str, budget.RequestBias] = field(default_factory=dict)  # per draft part: scales its estimates
    slowdown: budget.Slowdown = field(default_factory=budget.Slowdown)  # under max_stretch: what others may cost it
    prefilled: int = 0
    out_ids: list[int] = field(default_factory=list)
    finish: str | None = None  # stop, length, cancelled, error
    error: BaseException | None = None

    @property
    def produced(self) -> int:
        return len(self.out_ids)

    def part(self, prop: Proposal) -> str:
        """The draft that made `prop`: a hybrid's part, else the row's draft."""
        return prop.source or self.draft

    def bias_of(self, prop: Proposal) -> budget.RequestBias:
        """The request's bias for the part that drafted `prop`: a hybrid's lookup copying its
        prompt says nothing of how its model draft fares on the same request."""
        part = self.part(prop)
        bias = self.bias.get(part)  # not setdefault: that would build a RequestBias on every call (per round)
        if bias is None:
            bias = self.bias[part] = budget.RequestBias()
        return bias

    def gates(self, prop: Proposal | None) -> bool:
        """Whether a round of `prop` (None: nothing drafted) tells the acceptance that
        gates drafting: the part that runs a model (or the draft's only part)."""
        return prop is None or self.part(prop) == (self.priced or self.draft)


def calibration_key(draft: str, sampling: SamplingParams) -> tuple[str, bool]:
    """Whose calibration a row's draft scores go to: per draft, greedy apart from sampled."""
    return draft, sampling.temperature == 0


@dataclass
class Plan:
    """What one row feeds this step."""

    kind: str  # prefill | verify | decode
    row: Running
    take: int = 0  # prefill tokens, or drafts verified
    proposal: Proposal | None = None
    drafted: int = 0
    accepted: int = 0
