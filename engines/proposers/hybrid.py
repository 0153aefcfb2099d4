"""Prompt lookup where the context repeats itself, a model draft elsewhere: chosen per round.

A request rarely wants one draft throughout. An answer that quotes its prompt
(code edits, extraction, rewriting) copies long runs that prompt lookup drafts
for free and a small draft guesses token by token; between the quotes, lookup
finds nothing and the model draft is what is left. Each round this proposer
looks the context's last tokens up first (at least `min_match` of them: a
one-token match mostly copies the wrong continuation) and drafts with the model
only where no lookup matched, and only when the scheduler judges the model's
drafts may pay at this load (`model_on`): a lookup costs nothing to try, so it
is tried even when the model would not be.

Each part keeps its own calibration: a proposal names the part that drafted it
(`Proposal.source`), so prompt lookup's match scores and the model draft's top
probabilities are never binned together. The model draft keeps reading the
target's states in rounds it does not draft (EagleProposer feeds them when it
next drafts; a model draft catches up from the context).
"""

from __future__ import annotations

import dataclasses

import torch

from engines.api import SamplingParams
from engines.proposers.base import Proposal, ProposerBase
from engines.proposers.ngram import NgramProposer
from engines.sampling import DraftPicks


class HybridProposer(ProposerBase):
    drafting_costs = True  # rounds without a match run the model draft
    lookup_first = True

    def __init__(self, lookup: NgramProposer, model, names: tuple[str, str], batch_key: object):
        self.lookup, self.model = lookup, model
        self.names = names  # (the lookup's draft name, the model draft's): whose calibration and price
        self.needs_states = model.needs_states
        self.batch_key = batch_key  # one object per configured hybrid: its rows' model drafts run together
        self.model_on = True  # set per round by the scheduler: whether the model draft's tokens may pay

    @property
    def min_confidence(self) -> float:
        return self.model.min_confidence

    @min_confidence.setter
    def min_confidence(self, value: float) -> None:  # the scheduler's stopping rule is the model draft's
        self.model.min_confidence = value

    def parts(self, name: str) -> list[tuple[str, ProposerBase]]:
        return [(self.names[0], self.lookup), (self.names[1], self.model)]

    def observe_states(self, states: torch.Tensor) -> None:
        self.model.observe_states(states)

    def propose(self, context: list[int], gamma: int, sampling: SamplingParams,
                picks: DraftPicks) -> Proposal:
        return HybridProposer.propose_batch([(self, context, gamma, sampling, picks)])[0]

    @staticmethod
    def propose_batch(requests: list[tuple[HybridProposer, list[int], int, SamplingParams, DraftPicks]]
                      ) -> list[Proposal]:
        out: list[Proposal | None] = [None] * len(requests)
        rest = []
        for i, (p, ctx, k, sp, picks) in enumerate(requests):
            found = p.lookup.propose(ctx, k, sp, picks)
            if found.token_ids.numel():
                out[i] = dataclasses.replace(found, source=p.names[0])
            elif p.model_on:
                rest.append(i)
            else:
                out[i] = found  # nothing this round
        if rest:
            model = requests[rest[0]][0].model
            asks = [(requests[i][0].model, *requests[i][1:]) for i in rest]
            made = (type(model).propose_batch(asks) if model.batch_key is not None
                    else [a[0].propose(*a[1:]) for a in asks])
            for i, prop in zip(rest, made):
                out[i] = dataclasses.replace(prop, source=requests[i][0].names[1])
        return out
