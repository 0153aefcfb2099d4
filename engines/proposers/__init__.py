"""Draft proposers: each proposes up to γ tokens from the context; the policy, not the
proposer, chooses which proposer and which γ a request uses."""

from engines.proposers.base import Proposal, Proposer
from engines.proposers.model_draft import ModelDraftProposer
from engines.proposers.ngram import NgramProposer

__all__ = ["Proposal", "Proposer", "NgramProposer", "ModelDraftProposer"]
