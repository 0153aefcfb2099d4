"""The proposer interface: what every draft implements.

One proposer per request (a model draft keeps a KV cache of its own for it).
The scheduler asks for up to k tokens each round and verifies as many of them
as the step budget admits; what was accepted it tracks itself (engines/budget.py),
and a proposer that reads the target's hidden states gets those of the
positions committed (`observe_states`). Proposers that
share something batchable (the same draft model) draft together through their
class's `propose_batch`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from engines.api import SamplingParams
from engines.sampling import DraftPicks


@dataclass
class Proposal:
    token_ids: torch.Tensor  # [k] long, k <= γ (k = 0: nothing to propose this round)
    probs: torch.Tensor | None  # [k, V] the draft's q, shaped like the target's p; None = one-hot
    confidence: torch.Tensor | None = None  # [k] the draft's score of each token, which the scheduler calibrates
    source: str | None = None  # the draft that made it, where a proposer has parts (None: the row's draft)
    # (seconds, tokens) of its drafting that price a drafted token (DraftingClock); None: the caller times the call
    cost: tuple[float, int] | None = None

    def truncate(self, k: int) -> Proposal:
        """The first k tokens (what the step budget admits for verification)."""
        if k >= self.token_ids.shape[0]:
            return self
        return Proposal(self.token_ids[:k], None if self.probs is None else self.probs[:k],
                        None if self.confidence is None else self.confidence[:k], self.source, self.cost)


class Proposer(Protocol):
    needs_states: tuple[int, ...] | bool  # target layers (-1: final) whose states it reads at every position
    batch_key: object  # proposers with the same non-None key draft together (propose_batch)
    drafting_costs: bool  # drafting runs a model (skip it when its tokens would not be verified)
    lookup_first: bool  # looks up (free) before running a model: asked even when a model's drafts would not pay,
    #                     with `model_on` (set by the scheduler each round) saying whether its model may run
    min_confidence: float  # a model draft stops once its running estimate falls below this
    calibrate: object  # None, or confidence -> estimated acceptance (set by the scheduler)
    calibration_prior: tuple[float, float]  # what the scheduler's calibration assumes before evidence

    def propose(self, context: list[int], gamma: int, sampling: SamplingParams,
                picks: DraftPicks) -> Proposal:
        """Up to `gamma` tokens to follow `context` (prompt + output so far)."""
        ...

    def parts(self, name: str) -> list[tuple[str, ProposerBase]]:
        """(draft name, proposer) for each draft whose proposals it returns:
        each has its own calibration and drafting price. `name`: its own."""
        ...

    def observe_states(self, states: torch.Tensor) -> None:
        """The target's hidden states [T, E · layers] for the positions it just
        committed (only called when needs_states)."""
        ...


class ProposerBase:
    """Defaults for a proposer that reads no hidden states and drafts alone."""

    needs_states = False
    batch_key = None
    drafting_costs = False
    lookup_first = False
    min_confidence = 0.0
    calibrate = None
    calibration_prior = (2.0, 4.0)  # (accepted, tried) per confidence bin before any verification: an even chance

    def estimate(self, confidence: float) -> float:
        """A drafted token's chance of acceptance: calibrated when the scheduler
        has a calibration for this draft, else the raw confidence."""
        return confidence if self.calibrate is None else self.calibrate(confidence)

    def parts(self, name: str) -> list[tuple[str, ProposerBase]]:
        return [(name, self)]

    def observe_states(self, states: torch.Tensor) -> None:
        pass


class DraftingClock:
    """What a model draft's drafting costs per drafted token, per row: each row's
    share (by positions fed) of the laps it took part in, a lap being one batched
    forward and the work on the tokens before it, one token per lap. A first lap
    that reads more than `CATCH_UP` positions of a row (the prompt, or the
    positions of rounds it did not draft) is left out with its token: that
    reading is paid once whatever is drafted next, while a drafted token costs a
    one-position forward. Counted whole, such calls priced serving's drafting at
    2.2 to 3.6x what a round's forwards took (4.3 ms a token against 1.2), which
    kept the draft off, which made the next catch-up longer."""

    CATCH_UP = 4

    def __init__(self):
        self.rows: dict[int, tuple[float, int]] = {}
        self.since = time.perf_counter()

    def lap(self, fed: dict[int, int], first: bool = False) -> None:
        """A forward has just fed `fed[row]` positions of each row."""
        now = time.perf_counter()
        seconds, total, self.since = now - self.since, sum(fed.values()), now
        for row, n in fed.items():
            s, k = self.rows.get(row, (0.0, 0))
            if not (first and n > self.CATCH_UP):
                s, k = s + seconds * n / total, k + 1
            self.rows[row] = (s, k)

    def stop(self) -> None:
        """The work after the last forward (on the last tokens), shared by the priced rows."""
        now = time.perf_counter()
        priced = [row for row, (_, k) in self.rows.items() if k]
        for row in priced:
            s, k = self.rows[row]
            self.rows[row] = (s + (now - self.since) / len(priced), k)
        self.since = now

    def cost(self, row: int) -> tuple[float, int]:
        return self.rows.get(row, (0.0, 0))


def empty(device) -> Proposal:
    return Proposal(torch.empty(0, dtype=torch.long, device=device), None)
