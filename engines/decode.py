"""The decode rules of one sequence, as functions the batching scheduler
(engines/scheduler.py) applies to every running row:

    prefill            the prompt, in chunks           -> the first token (sample_token)
    a round            draft_budget -> propose -> verification_input
                       -> target forward (batched) -> verify -> rollback
                       -> settle (max_tokens, EOS) -> record_round

Plain decoding is the round with nothing drafted. Bookkeeping convention: the
target's KV cache holds every token of the sequence except the last one, which
is fed at the start of the next round.
"""

from __future__ import annotations

import torch

from engines.api import GenerationStats, SamplingParams
from engines.llama import KVCache
from engines.proposers.base import Proposal
from engines.rejection_sampler import rejection_sample
from engines.sampling import Draws, argmax, logits_to_probs, sample_index


def sample_token(logits: torch.Tensor, sampling: SamplingParams, draws: Draws, position: int) -> int:
    """logits [1, V] -> the token at output position `position` (argmax when greedy)."""
    if sampling.temperature == 0:
        return int(argmax(logits[0]))
    probs = logits_to_probs(logits, sampling)
    if draws.coupled:
        return draws.pick(probs[0], position)
    return sample_index(probs[0], draws.sample(position))


def draft_budget(gamma: int, produced: int, max_tokens: int, cache: KVCache) -> int:
    """Most tokens worth drafting this round: never past what may still be
    emitted (a round emits accepted + 1), nor past the KV room."""
    return max(0, min(gamma, max_tokens - produced - 1, cache.capacity - cache.lengths[0] - 1))


def verification_input(last_token: int, drafts: torch.Tensor) -> torch.Tensor:
    """[k + 1]: the last emitted token, then the k drafts."""
    return torch.cat([torch.tensor([last_token], device=drafts.device), drafts])


def verify(logits: torch.Tensor, proposal: Proposal, sampling: SamplingParams, draws: Draws,
           position: int) -> tuple[int, list[int]]:
    """logits [k + 1, V] of the verification forward (row i predicts what follows
    input i), the first at output position `position` -> (accepted n, emitted
    tokens: the n accepted drafts + one more). Sampled: speculative sampling
    (rejection_sampler.py), or under coupled sampling the target's own picks, a
    draft kept while it is the pick (the same rule for lookup and model drafts)."""
    drafts = proposal.token_ids  # [k]
    k = drafts.shape[0]
    if sampling.temperature == 0:
        # The one-hot special case of rejection_sample, without a softmax over V.
        best = argmax(logits)  # [k + 1]
        mismatch = (best[:k] != drafts).nonzero()
        n = int(mismatch[0]) if mismatch.numel() else k
        return n, drafts[:n].tolist() + [int(best[n])]
    probs = logits_to_probs(logits, sampling)  # [k + 1, V]
    if draws.coupled:
        # every draft, model or lookup, was a guess of the target's own picks: kept while it is one
        emitted = []
        for i in range(k + 1):
            emitted.append(draws.pick(probs[i], position + i))
            if i == k or emitted[-1] != int(drafts[i]):
                return i, emitted
    return rejection_sample(drafts, proposal.probs, probs,
                            [draws.sample(position + i) for i in range(k + 1)],
                            [draws.accept(position + i) for i in range(k)])


def rollback(cache: KVCache, drafted: int, accepted: int) -> None:
    """After a verification forward of 1 + drafted tokens: keep the last token
    and the accepted drafts, forget the rejected ones (their entries are
    overwritten by the next forward and never attended to)."""
    cache.lengths[0] -= drafted - accepted


def settle(emitted: list[int], produced: int, sampling: SamplingParams,
           eos_ids: frozenset[int]) -> tuple[list[int], bool]:
    """Cut a round's tokens at max_tokens and after the first EOS; returns the
    tokens to emit and whether an EOS ends the sequence."""
    emitted = emitted[: sampling.max_tokens - produced]
    if not sampling.ignore_eos:
        for i, t in enumerate(emitted):
            if t in eos_ids:
                return emitted[: i + 1], True
    return emitted, False


def record_round(stats: GenerationStats, drafted: int | None, accepted: int, draft_s: float,
                 verify_s: float) -> None:
    """Per-round telemetry. `drafted=None`: a plain round (no draft configured);
    a speculative round that proposed nothing records (0, 0)."""
    stats.rounds += 1
    stats.draft_s += draft_s
    stats.verify_s += verify_s
    if drafted is not None:
        stats.drafted_per_round.append(drafted)
        stats.accepted_per_round.append(accepted)
