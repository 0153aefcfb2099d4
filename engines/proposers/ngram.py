"""Prompt-lookup (n-gram) drafting: no model, proposals copied from the context.

If the last n tokens occurred earlier in the prompt or the output, propose the
tokens that followed that occurrence. Longer n first (a longer match is a
better predictor); among equal-length matches the most recent one wins (output
tends to continue what it was just copying).
"""

from __future__ import annotations

import numpy as np
import torch

from engines.api import SamplingParams
from engines.proposers.base import Proposal, ProposerBase


class NgramProposer(ProposerBase):
    # optimistic but light (0.6, worth 2.5 tries): a bin never verified is never learned, a lookup costs
    # no drafting, and a few misses must suffice to stop probing where a verification costs a whole step
    calibration_prior = (1.5, 2.5)

    def __init__(self, min_n: int = 1, max_n: int = 3, device: str = "cpu"):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram needs 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n, self.device = min_n, max_n, device

    def propose(self, context: list[int], gamma: int, sampling: SamplingParams,
                generator: torch.Generator) -> Proposal:
        tokens, n = find_continuation(context, gamma, self.min_n, self.max_n)
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


def find_continuation(context: list[int], gamma: int, min_n: int, max_n: int) -> tuple[list[int], int]:
    """Up to `gamma` tokens that followed the latest earlier occurrence of the
    context's last n tokens, for the largest n in [min_n, max_n] that matches;
    and that n (0: no match)."""
    arr = np.asarray(context, dtype=np.int64)
    L = len(arr)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = arr[L - n:]
        # windows[i] = arr[i:i+n]; exclude the suffix itself (i = L - n).
        windows = np.lib.stride_tricks.sliding_window_view(arr[: L - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start: start + gamma].tolist(), n
    return [], 0
