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
    def __init__(self, min_n: int = 1, max_n: int = 3, device: str = "cpu"):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram needs 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n, self.device = min_n, max_n, device

    def propose(self, context: list[int], gamma: int, sampling: SamplingParams,
                generator: torch.Generator) -> Proposal:
        return Proposal(torch.tensor(find_continuation(context, gamma, self.min_n, self.max_n),
                                     dtype=torch.long, device=self.device), None)



def find_continuation(context: list[int], gamma: int, min_n: int, max_n: int) -> list[int]:
    """Up to `gamma` tokens that followed the latest earlier occurrence of the
    context's last n tokens, for the largest n in [min_n, max_n] that matches."""
    arr = np.asarray(context, dtype=np.int64)
    L = len(arr)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = arr[L - n:]
        # windows[i] = arr[i:i+n]; exclude the suffix itself (i = L - n).
        windows = np.lib.stride_tricks.sliding_window_view(arr[: L - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start: start + gamma].tolist()
    return []
