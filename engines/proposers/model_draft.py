"""Drafting with a small causal LM that shares the target's tokenizer, or with the
target's own subset of layers (self-speculation: same tensors, no extra weights).

The draft keeps its own KV cache per request. Before each proposal it keeps the
longest prefix of what it has cached that still matches the context and feeds
the rest, so rejected drafts roll back without any bookkeeping by the caller.
Several requests drafting with the same model draft together: each of the γ
draft steps is one batched forward (`propose_many`).
"""

from __future__ import annotations

import torch

from engines.api import SamplingParams
from engines.llama import LlamaModel
from engines.proposers.base import DraftingClock, Proposal, ProposerBase
from engines.sampling import DraftPicks, argmax, logits_to_probs


class ModelDraftProposer(ProposerBase):
    drafting_costs = True

    def __init__(self, model: LlamaModel, capacity: int):
        self.model = model
        self.batch_key = model
        self.cache = model.new_cache(capacity)
        self.cached_ids: list[int] = []

    def catch_up(self, context: list[int]) -> torch.Tensor:
        """Roll the cache back to its common prefix with `context`; the ids still to
        feed (at least one, so that there are logits for the next token)."""
        common = 0
        limit = min(len(self.cached_ids), len(context) - 1)
        while common < limit and self.cached_ids[common] == context[common]:
            common += 1
        self.cache.lengths[0] = common
        self.cached_ids = list(context)
        return torch.tensor(context[common:], dtype=torch.long, device=self.model.device)

    def room(self, context: list[int]) -> int:
        return self.cache.capacity - len(context)

    def propose(self, context: list[int], gamma: int, sampling: SamplingParams,
                picks: DraftPicks) -> Proposal:
        return propose_many(self.model, [(self, context, gamma, sampling, picks)])[0]

    @staticmethod
    def propose_batch(requests) -> list[Proposal]:
        return propose_many(requests[0][0].model, requests)



def propose_many(model: LlamaModel, requests: list[tuple[ModelDraftProposer, list[int], int, SamplingParams,
                                                         DraftPicks]]) -> list[Proposal]:
    """Proposals for several requests whose proposers share `model`, drafted in
    lockstep: one batched forward per draft position."""
    empty = Proposal(torch.empty(0, dtype=torch.long, device=model.device), None)
    gammas = [min(g, p.room(ctx)) for p, ctx, g, _, _ in requests]
    live = [i for i, g in enumerate(gammas) if g > 0]
    tokens: dict[int, list[torch.Tensor]] = {i: [] for i in live}
    probs: dict[int, list[torch.Tensor]] = {i: [] for i in live}
    conf: dict[int, list[float]] = {i: [] for i in live}
    running = dict.fromkeys(live, 1.0)  # the survival estimate of the drafts so far
    clock = DraftingClock()
    if live:
        feeds = {i: requests[i][0].catch_up(requests[i][1]) for i in live}
        outs = model.forward_many([(feeds[i], requests[i][0].cache, False) for i in live])
        clock.lap({i: int(ids.numel()) for i, ids in feeds.items()}, first=True)
        logits = dict(zip(live, outs))
        active = list(live)
        for step in range(max(gammas[i] for i in live)):
            feed = []
            for i in active:
                proposer, _, _, sampling, picks = requests[i]
                q = logits_to_probs(logits[i], sampling)  # [1, V]
                # confidence from the unshaped distribution (greedy shaping is one-hot: always 1)
                top = float(logits[i][0].float().softmax(-1).max())
                conf[i].append(top)
                running[i] *= proposer.estimate(top)
                if sampling.temperature == 0:
                    tok = argmax(q)
                else:
                    tok = torch.tensor([picks.pick(q[0], step)], device=q.device)
                tokens[i].append(tok)
                probs[i].append(q)
                if step + 1 < gammas[i] and running[i] >= proposer.min_confidence:
                    # the last draft token is never fed: verification will
                    proposer.cached_ids.append(int(tok))
                    feed.append(i)
            if not feed:
                break
            active = feed
            outs = model.forward_many([(tokens[i][-1], requests[i][0].cache, False) for i in feed])
            clock.lap(dict.fromkeys(feed, 1))
            logits.update(zip(feed, outs))
        clock.stop()
    # the draft's confidence in each token: its top probability (calibrated by the scheduler)
    return [Proposal(torch.cat(tokens[i]), torch.cat(probs[i]), torch.tensor(conf[i]), cost=clock.cost(i))
            if i in tokens else empty
            for i in range(len(requests))]
