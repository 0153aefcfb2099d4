"""Draft proposers: each proposes up to γ tokens from the context; the policy, not the
proposer, chooses which proposer and which γ bound a request uses.

    base.py          the Proposal and the Proposer protocol
    ngram.py         prompt lookup: tokens copied from an earlier occurrence of the context's end
    model_draft.py   a small causal LM sharing the target's tokenizer, or a subset of its layers
    eagle.py         a trained head reading the target's hidden states (engines/distill/)
    hybrid.py        prompt lookup where it matches, a model draft elsewhere, per round
"""

from engines.proposers.base import Proposal, Proposer, ProposerBase
from engines.proposers.eagle import EagleDraft, EagleProposer
from engines.proposers.hybrid import HybridProposer
from engines.proposers.model_draft import ModelDraftProposer
from engines.proposers.ngram import NgramProposer

__all__ = ["Proposal", "Proposer", "ProposerBase", "NgramProposer", "ModelDraftProposer", "EagleDraft", "EagleProposer",
           "HybridProposer"]
