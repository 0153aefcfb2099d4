"""Prompt-lookup (n-gram) drafting: no model, proposals copied from the context.

If the last n tokens occurred earlier in the prompt or the output, propose the
tokens that followed that occurrence. Longer n first (a longer match is a
better predictor); among equal-length matches the most recent one wins (output
tends to continue what it was just copying).

Each request keeps an index of its context's n-grams, extended by the tokens
committed since its last round, so a round's lookup costs a few dictionary
probes whatever the context's length (a scan of a 500-token context took ~60 us
per row and round: ~1% of a 16-row step, for rows the budget mostly does not
verify).
"""

from __future__ import annotations

import torch

from engines.api import SamplingParams
from engines.proposers.base import Proposal, ProposerBase
from engines.sampling import DraftPicks


class NgramProposer(ProposerBase):
    # optimistic but light (0.6, worth 2.5 tries): a bin never verified is never learned, a lookup costs
    # no drafting, and a few misses must suffice to stop probing where a verification costs a whole step
    calibration_prior = (1.5, 2.5)

    def __init__(self, min_n: int = 1, max_n: int = 3, device: str = "cpu"):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram needs 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.device = min_n, device
        self.index = NgramIndex(max_n)

    def propose(self, context: list[int], gamma: int, sampling: SamplingParams,
                picks: DraftPicks) -> Proposal:
        tokens, n = self.index.continuation(context, gamma, self.min_n)
        return Proposal(torch.tensor(tokens, dtype=torch.long, device=self.device), None,
                        torch.tensor([match_score(n, j) for j in range(len(tokens))]))


def match_score(n: int, j: int) -> float:
    """A coarse, ordered score for the j-th token copied after a match of n
    tokens: which of nine calibration bins it falls in (the scheduler learns
    what each is worth, engines/budget.py). Longer matches and tokens deeper into
    a copy that is holding predict better; beyond three tokens of match or of
    copy the bins stop telling them apart."""
    length = min(n, 3) - 1  # 0, 1, 2
    depth = 0 if j == 0 else 1 if j <= 2 else 2
    return (3 * length + depth + 0.5) / 10


class NgramIndex:
    """Where each n-gram (n <= max_n) of a growing context last ended.

    `ends[gram]` is the end (exclusive) of the gram's latest occurrence among
    those that end before the context's last token, i.e. every occurrence but
    the context's own suffix. The scheduler's context only grows; one that is
    not the last one extended (shorter, or with other first or last tokens) is
    indexed afresh."""

    def __init__(self, max_n: int):
        self.max_n = max_n
        self.ends: dict[tuple[int, ...], int] = {}
        self.seen = 0  # tokens of the context indexed: every end up to seen - 1 is in
        self.edges: tuple[int, int] | None = None  # its first and last token

    def _extend(self, context: list[int]) -> None:
        seen = self.seen
        if seen and (seen > len(context) or self.edges != (context[0], context[seen - 1])):
            self.ends, seen = {}, 0
        ends, L = self.ends, len(context)
        for end in range(max(seen, 1), L):  # occurrences ending before the last position
            for n in range(1, min(self.max_n, end) + 1):
                ends[tuple(context[end - n:end])] = end
        self.seen, self.edges = L, (context[0], context[-1]) if L else None

    def continuation(self, context: list[int], gamma: int, min_n: int = 1) -> tuple[list[int], int]:
        """Up to `gamma` tokens that followed the latest earlier occurrence of
        the context's last n tokens, for the largest n in [min_n, max_n] that
        matches; and that n (0: no match)."""
        self._extend(context)
        L = len(context)
        for n in range(min(self.max_n, L - 1), min_n - 1, -1):
            start = self.ends.get(tuple(context[L - n:]))
            if start is not None:
                return context[start:start + gamma], n
        return [], 0
