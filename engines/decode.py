"""The decoding pipeline for one sequence: prefill -> decode_one_token |
speculative_step -> generate. Plain decoding is the γ = 0 case of the same loop.

Bookkeeping convention: the target's KV cache holds every token of the sequence
except the last one, which is fed at the start of the next step.
"""

from __future__ import annotations

import time
from typing import Iterator

import torch

from engines.api import GenerationStats, SamplingParams
from engines.llama import KVCache, LlamaModel
from engines.proposers.base import Proposal, Proposer
from engines.rejection_sampler import rejection_sample
from engines.sampling import logits_to_probs


def prefill(model: LlamaModel, cache: KVCache, prompt_ids: list[int]) -> torch.Tensor:
    """Feed the whole prompt; logits [1, V] for the first output token."""
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=model.device)
    return model.forward(ids, cache, all_logits=False)


def sample_token(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator) -> int:
    """logits [1, V] -> one token id."""
    if sampling.temperature == 0:
        return int(logits[0].argmax())
    probs = logits_to_probs(logits, sampling)
    return int(torch.multinomial(probs[0], 1, generator=generator))


def decode_one_token(model: LlamaModel, cache: KVCache, token: int) -> torch.Tensor:
    """Feed the last token; logits [1, V] for the next one."""
    return model.forward(torch.tensor([token], device=model.device), cache)


def speculative_step(model: LlamaModel, cache: KVCache, last_token: int, proposal: Proposal,
                     sampling: SamplingParams, generator: torch.Generator) -> tuple[int, list[int]]:
    """Verify k drafted tokens in one target forward and roll the cache back past
    the rejected ones. Returns (accepted, emitted tokens: accepted + 1)."""
    start = cache.lengths[0]
    logits = model.forward(verification_input(last_token, proposal, model.device), cache)  # [k + 1, V]
    n, emitted = verify(logits, proposal, sampling, generator)
    cache.lengths[0] = start + 1 + n  # keep last_token and the accepted drafts
    return n, emitted


def verification_input(last_token: int, proposal: Proposal, device) -> torch.Tensor:
    """[k + 1]: the last sampled token, then the drafts."""
    return torch.cat([torch.tensor([last_token], device=device), proposal.token_ids])


def verify(logits: torch.Tensor, proposal: Proposal, sampling: SamplingParams,
           generator: torch.Generator) -> tuple[int, list[int]]:
    """logits [k + 1, V] of the verification forward (row i predicts what follows
    input i) -> (accepted, emitted tokens). The caller rolls its cache back."""
    drafts = proposal.token_ids  # [k]
    k = drafts.shape[0]
    if sampling.temperature == 0:
        # The one-hot special case of rejection_sample, without a softmax over V.
        best = logits.argmax(dim=-1)  # [k + 1]
        mismatch = (best[:k] != drafts).nonzero()
        n = int(mismatch[0]) if mismatch.numel() else k
        return n, drafts[:n].tolist() + [int(best[n])]
    return rejection_sample(drafts, proposal.probs, logits_to_probs(logits, sampling), generator)


def generate(model: LlamaModel, cache: KVCache, prompt_ids: list[int], sampling: SamplingParams,
             generator: torch.Generator, stats: GenerationStats, eos_ids: frozenset[int],
             proposer: Proposer | None = None, gamma: int = 0) -> Iterator[list[int]]:
    """Yield the new tokens of each step until EOS or max_tokens. Timings and
    per-round acceptance go into `stats`. Closing the iterator stops decoding."""
    t0 = time.perf_counter()
    logits = prefill(model, cache, prompt_ids)
    token = sample_token(logits, sampling, generator)
    stats.prefill_s = time.perf_counter() - t0
    tokens = list(prompt_ids) + [token]
    produced = 1
    yield [token]
    stop_on_eos = not sampling.ignore_eos
    if stop_on_eos and token in eos_ids:
        return
    while produced < sampling.max_tokens:
        remaining = sampling.max_tokens - produced
        # Drafting past what may still be emitted is wasted work.
        k_max = min(gamma, remaining - 1, cache.capacity - cache.lengths[0] - 1)
        t1 = time.perf_counter()
        proposal = proposer.propose(tokens, k_max, sampling, generator) if proposer and k_max > 0 else None
        t2 = time.perf_counter()
        if proposal is not None and proposal.token_ids.numel():
            n, emitted = speculative_step(model, cache, tokens[-1], proposal, sampling, generator)
            stats.drafted_per_round.append(int(proposal.token_ids.numel()))
            stats.accepted_per_round.append(n)
            proposer.observe(n)
        else:
            emitted = [sample_token(decode_one_token(model, cache, tokens[-1]), sampling, generator)]
            if proposer is not None:  # a round with nothing to propose still counts
                stats.drafted_per_round.append(0)
                stats.accepted_per_round.append(0)
        stats.draft_s += t2 - t1
        stats.verify_s += time.perf_counter() - t2
        stats.rounds += 1
        emitted = emitted[:remaining]
        if stop_on_eos:
            for i, t in enumerate(emitted):
                if t in eos_ids:
                    emitted = emitted[: i + 1]
                    break
        tokens.extend(emitted)
        produced += len(emitted)
        yield emitted
        if stop_on_eos and emitted[-1] in eos_ids:
            return
