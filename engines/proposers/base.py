"""The proposer interface."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engines.api import SamplingParams


@dataclass
class Proposal:
    token_ids: torch.Tensor  # [k] long, k <= γ (k = 0: nothing to propose this round)
    probs: torch.Tensor | None  # [k, V] the draft's q, shaped like the target's p; None = one-hot


class Proposer(Protocol):
    """One per request: a model draft keeps its own KV cache for that request."""

    def propose(self, context: list[int], gamma: int, sampling: SamplingParams,
                generator: torch.Generator) -> Proposal:
        """Propose up to `gamma` tokens to follow `context` (prompt + output so far)."""
        ...

    def observe(self, num_accepted: int) -> None:
        """Told after verification how many of the last proposal were accepted."""
        ...
