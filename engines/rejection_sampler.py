"""Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

Glossary, in the papers' letters:
    p            the TARGET model's distribution (the one output must follow).
    q            the DRAFT's distribution that proposed the tokens. A deterministic
                 proposer (n-gram lookup) is a one-hot q: q(x) = 1 for its token.
    γ (gamma)    draft tokens proposed this round (here k <= γ: a proposer may
                 propose fewer, e.g. no n-gram match).
    draft tokens x_1..x_k, drawn from q_1..q_k.
    accepted     x_i is kept with probability min(1, p_i(x_i) / q_i(x_i)); the first
                 rejection ends the round.
    recovered    on rejection at i, a token is drawn from the residual
                 norm(max(0, p_i - q_i)) instead of x_i.
    bonus        when all k drafts are accepted, one more token is drawn from
                 p_{k+1}, which the verification forward computed anyway.

Every round therefore emits accepted + 1 tokens, and each has exactly the
distribution plain sampling from p would give. p and q must both already be
shaped by the request's temperature / top-k / top-p (see `sampling.logits_to_probs`).
Under greedy decoding p is one-hot at the argmax, which turns the same rule into
"accept while the draft equals the target's argmax".

The uniforms are given, one per position (`sampling.Draws`): u_sample[i] draws
the target's own token at position i by inverting p_i's CDF, u_accept[i] tests a
model draft's x_i. For a one-hot q the rule above is applied as a coupling: the
target draws y_i from p_i at u_sample[i], and x_i is accepted exactly when y_i =
x_i (probability p_i(x_i) = min(1, p_i(x_i) / q_i(x_i))); the first y_i that
differs is the recovered token (given y_i != x_i, y_i follows the residual
norm(p_i with x_i removed)), and y_k the bonus. Every emitted token is then the
one plain sampling would have drawn with the same uniforms.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engines.sampling import sample_index


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [k] long
    draft_probs: torch.Tensor | None,  # [k, V] q, or None for one-hot drafts
    target_probs: torch.Tensor,  # [k + 1, V] p; row k is the bonus position
    u_sample: Sequence[float],  # [k + 1] the target's draws, one per position
    u_accept: Sequence[float],  # [k] the acceptance tests of a model draft's tokens
) -> tuple[int, list[int]]:
    """Returns (accepted count n in 0..k, emitted tokens: the n accepted drafts plus
    one recovered or bonus token)."""
    k = draft_token_ids.shape[0]
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs has {target_probs.shape[0]} rows, expected k + 1 = {k + 1}")
    if len(u_sample) != k + 1 or len(u_accept) != k:
        raise ValueError(f"{len(u_sample)} and {len(u_accept)} uniforms for {k} drafts: expected k + 1 and k")
    if draft_probs is None:
        drafts = draft_token_ids.tolist()
        emitted = []
        for i in range(k + 1):  # the target's own draws, until one is not the draft's token
            emitted.append(sample_index(target_probs[i], u_sample[i]))
            if i == k or emitted[i] != drafts[i]:
                return i, emitted
    idx = torch.arange(k, device=target_probs.device)
    p_x = target_probs[idx, draft_token_ids]  # [k]
    q_x = draft_probs[idx, draft_token_ids]
    u = torch.tensor(u_accept, dtype=p_x.dtype, device=p_x.device)
    # u < p/q written without the division; strict so that p(x) = 0 never accepts.
    accept = (u * q_x) < p_x  # [k]
    rejected = (~accept).nonzero()
    n = int(rejected[0]) if rejected.numel() else k
    emitted = draft_token_ids[:n].tolist()
    if n == k:
        last = target_probs[k]  # bonus
    else:
        p = target_probs[n]
        residual = (p - draft_probs[n]).clamp_min(0)
        # Rejection implies p(x) < q(x) somewhere, so the residual has mass; the
        # fallback only guards floating-point round-off. (sample_index normalises.)
        last = residual if residual.sum() > 0 else p
    emitted.append(sample_index(last, u_sample[n]))
    return n, emitted
