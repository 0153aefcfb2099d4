"""Drafting with a small causal LM that shares the target's tokenizer, or with the
target's own subset of layers (self-speculation: same tensors, no extra weights).

The draft keeps its own KV cache per request. Before each proposal it keeps the
longest prefix of what it has cached that still matches the context and feeds
the rest, so rejected drafts roll back without any bookkeeping by the caller.
"""

from __future__ import annotations

import torch

from engines.api import SamplingParams
from engines.llama import LlamaModel
from engines.proposers.base import Proposal
from engines.sampling import logits_to_probs


class ModelDraftProposer:
    def __init__(self, model: LlamaModel, capacity: int):
        self.model = model
        self.cache = model.new_cache(capacity)
        self.cached_ids: list[int] = []

    def _sync(self, context: list[int]) -> torch.Tensor:
        """Roll the cache back to the common prefix with `context`, feed the rest and
        return logits [1, V] for the next token."""
        common = 0
        limit = min(len(self.cached_ids), len(context) - 1)  # always feed >= 1 token
        while common < limit and self.cached_ids[common] == context[common]:
            common += 1
        self.cache.lengths[0] = common
        new = context[common:]
        ids = torch.tensor(new, dtype=torch.long, device=self.model.device)
        logits = self.model.forward(ids, self.cache, all_logits=False)
        self.cached_ids = self.cached_ids[:common] + list(new)
        return logits

    def propose(self, context: list[int], gamma: int, sampling: SamplingParams,
                generator: torch.Generator) -> Proposal:
        room = self.cache.capacity - len(context)
        gamma = min(gamma, room)
        if gamma <= 0:
            return Proposal(torch.empty(0, dtype=torch.long, device=self.model.device), None)
        logits = self._sync(context)
        tokens, probs = [], []
        for i in range(gamma):
            q = logits_to_probs(logits, sampling)  # [1, V]
            if sampling.temperature == 0:
                tok = q.argmax(dim=-1)
            else:
                tok = torch.multinomial(q, 1, generator=generator).squeeze(-1)
            tokens.append(tok)
            probs.append(q)
            if i + 1 < gamma:  # the last draft token is never fed: verification will
                logits = self.model.forward(tok, self.cache, all_logits=False)
                self.cached_ids.append(int(tok))
        return Proposal(torch.cat(tokens), torch.cat(probs))

    def observe(self, num_accepted: int) -> None:
        pass
