"""Turning logits into the distribution a request samples from, and the draws it
samples with.

The same shaping (temperature, then top-k, then top-p) is applied to the target's
and the draft's logits, so that speculative sampling reproduces exactly the
distribution plain sampling would draw from. A token is drawn by inverting the
distribution's cumulative sum at a uniform number (`sample_index`); a request's
uniforms are fixed by its seed and the output position they serve (`Draws`).
With coupled sampling (`EngineConfig.coupled_sampling`) a token is instead the
Gumbel-max of its distribution under noise fixed by seed, position and token
(`Draws.pick`), which a model draft's guesses share (`DraftPicks`).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from engines.api import SamplingParams
from engines.errors import InvalidRequest

MIN_TEMPERATURE = 1e-4  # below it, sampling is greedy but for exact ties


def validate_sampling(p: SamplingParams, max_new_tokens_allowed: int) -> None:
    """Raise InvalidRequest naming the first bad field."""
    if not isinstance(p.max_tokens, int) or p.max_tokens <= 0:
        raise InvalidRequest("max_tokens", f"must be a positive integer, got {p.max_tokens!r}")
    if p.max_tokens > max_new_tokens_allowed:
        raise InvalidRequest(
            "max_tokens",
            f"{p.max_tokens} does not fit in the context window "
            f"({max_new_tokens_allowed} tokens left after the prompt)",
        )
    if not (p.temperature >= 0) or p.temperature > 100:  # also rejects NaN
        raise InvalidRequest("temperature", f"must be in [0, 100], got {p.temperature!r}")
    if not (0 < p.top_p <= 1):
        raise InvalidRequest("top_p", f"must be in (0, 1], got {p.top_p!r}")
    if not isinstance(p.top_k, int) or p.top_k < 0:
        raise InvalidRequest("top_k", f"must be an integer >= 0 (0 disables it), got {p.top_k!r}")
    if p.seed is not None and not (0 <= p.seed < 2**63):
        raise InvalidRequest("seed", f"must be in [0, 2^63), got {p.seed!r}")
    if len(p.stop) > 16 or any((not s) or len(s) > 256 for s in p.stop):
        raise InvalidRequest("stop", "at most 16 non-empty stop strings of at most 256 characters")


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Indices of the largest values along the last dim (the first on ties, as
    torch.argmax): max() is vectorised on CPU where argmax is not (21 against 62 µs
    over SmolLM2's 49,152 logits, a step's decoding rows each paying it)."""
    return x.max(dim=-1).indices


def sample_index(probs: torch.Tensor, u: float) -> int:
    """The index of `probs` [V] (non-negative weights, not necessarily
    normalised) at the uniform draw `u` in [0, 1), by inverting their cumulative
    sum: the distribution torch.multinomial draws from, 11x faster on CPU over
    SmolLM2's 49,152 tokens (90 against 1,000 µs, paid by every sampled token
    and by every sampled verification's recovered or bonus token). Accumulated
    in float64, so each token's interval is its probability to ~1e-16."""
    cdf = probs.double().cumsum(-1)  # [V]
    x = (cdf[-1] * u).view(1)
    i = int(torch.searchsorted(cdf, x, right=True))  # the first index whose cdf exceeds x: one with mass
    if i >= cdf.shape[0]:  # x rounded up to the total: the last index with mass
        i = int(probs.nonzero()[-1])
    return i


def uniform(generator: torch.Generator) -> float:
    """The next uniform draw in [0, 1) of a generator (a draft's sampling)."""
    return float(torch.rand((), generator=generator, dtype=torch.float64, device=generator.device))


_MASK = (1 << 64) - 1
SAMPLE, ACCEPT, DRAFT, NOISE, TAIL, TAIL_PICK = 1, 2, 3, 4, 5, 6  # Draws' streams
# Coupled sampling. The tokens a pick gives their own noise: those within this share of the most
# likely one's probability (the rest, one item by their summed mass, is the tail). Simulated on the
# shipped EAGLE head's rounds over 13 dev prompts (one per category, none of the benchmarks' first
# three; each position's 512 likeliest tokens, 200 noise draws): the tail won 0.8% of the target's
# picks at T=0.7 and 1.7% at T=1 (at shares of 1e-2: 3.1% and 9.1%; 1e-4: 0.1% and 0.2%), and
# guesses matched picks at 0.387 and 0.350 per drafted token (1e-2: 0.379, 0.316; 1e-4: 0.389, 0.357).
HEAD_SHARE = 1e-3
# A model draft's guess scales the noise by this: where the draft is unsure of the target, its own
# likelier tokens are the better guess. In the same simulation, unscaled guesses matched at 0.376
# (T=0.7) and 0.337 (T=1), against speculative sampling's acceptance of 0.407 and 0.395 there; with
# every token its own noise 0.75 was the best scale too (0.390, 0.360; at 0.5: 0.384, 0.333; 0.9: 0.386, 0.359).
SHARPEN = 0.75


def _mix(x: int) -> int:
    """splitmix64's step: a 64-bit integer to a well-scrambled one."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _mix_array(x: np.ndarray) -> np.ndarray:
    """_mix over uint64 values (numpy's uint64 arithmetic wraps, as the masks do)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _gumbel(u: np.ndarray | float):
    """Standard Gumbel values from uniforms in (0, 1)."""
    return -np.log(-np.log(u))


class Draws:
    """A request's random numbers, fixed by its seed and by the output position
    each one serves, not by the order they are asked for.

    The target's token at output position t is the inverse of its CDF at
    `sample(t)`, however the request is decoded: by a plain step, or verified
    after a one-hot draft (prompt lookup), whose token is kept exactly when the
    target's own draw at t picks it (rejection_sampler.py). So a seeded sampled
    request writes the same text under plain decoding and under prompt lookup at
    any γ, and the arm a policy picks for it (which follows the load) changes
    only its speed, as long as the target's logits are the same bits: a step whose
    token count moves the matmuls to another kernel (a prefill chunk beside the
    row, many verified drafts) rounds them differently, and a draw that close to
    the boundary between two tokens picks the other (plain decoding's own text
    moves the same way between batches: at concurrency 16, a few requests in a
    hundred diverge somewhere in 96 tokens; bench/sampled_texts.py). A model
    draft's acceptance tests draw from their own stream (`accept(t)`), and its
    tokens are sampled by `drafting`, a generator seeded apart: output stays
    exactly the target's distribution, but not plain's text; under coupled
    sampling (`coupled`) every token is `pick(p, t)` instead, and a model draft's
    are its guesses of those picks (DraftPicks), so every draft writes plain's text.
    (One generator consumed in order made every arm's text its own: at T > 0 two
    arms compared on a prompt were two different answers.)"""

    def __init__(self, seed: int, device: torch.device | str = "cpu", coupled: bool = False):
        self.seed = _mix(seed & _MASK)
        self.coupled = coupled
        self.drafting = torch.Generator(device=device).manual_seed(self._bits(DRAFT, 0) >> 1)

    def _bits(self, stream: int, position: int) -> int:
        return _mix(_mix(self.seed ^ stream) ^ position)

    def sample(self, position: int) -> float:
        """The uniform in [0, 1) that picks the target's token at output position `position`."""
        return (self._bits(SAMPLE, position) >> 11) * 2.0**-53

    def accept(self, position: int) -> float:
        """The uniform in [0, 1) that tests a model draft's token at `position`."""
        return (self._bits(ACCEPT, position) >> 11) * 2.0**-53

    def _open(self, stream: int, position: int) -> float:
        """A uniform in (0, 1), never 0: what a Gumbel value takes the log of twice."""
        return ((self._bits(stream, position) >> 11) + 0.5) * 2.0**-53

    def pick(self, probs: torch.Tensor, position: int, ids: torch.Tensor | None = None,
             sharpen: float = 1.0) -> int:
        """Coupled sampling: the index of `probs` [V] (the distribution over the tokens `ids`
        [V], or over token ids 0..V-1) at output position `position`, as the argmax of
        log p + sharpen · g over items: each token of the head (within HEAD_SHARE of the
        likeliest) with its own Gumbel value g, fixed by seed, position and token id, and
        the tail as one item at its summed mass, with a Gumbel value of its own; where the
        tail wins, a token of it by inverting its cumulative sum. With sharpen = 1 that is
        exactly a draw from probs (Gumbel-max over items by their masses, then one within
        the tail by its share), and the head is chosen from probs alone, so the noise a
        token gets does not depend on what else is likely. A model draft's guess is the
        same pick over its own q (sharpened): it matches the target's exactly where the
        draft would have drawn the target's token, and the emitted token is always the
        target's own pick, whatever the draft guessed."""
        a = probs.detach().float().cpu().numpy()  # [V] (numpy: 3-5x torch's CPU dispatch at this size)
        head = np.flatnonzero(a >= a.max() * HEAD_SHARE)  # [m]: the likeliest is always in
        mass = a[head].astype(np.float64)  # [m]
        token_ids = (head if ids is None else ids.cpu().numpy()[head]).astype(np.uint64)
        key = np.full(1, self._bits(NOISE, position), dtype=np.uint64)
        noise = _gumbel(((_mix_array(key ^ token_ids) >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53)
        score = np.log(mass) + sharpen * noise  # [m]
        best = int(score.argmax())
        tail = float(a.sum()) - float(mass.sum())
        if tail > 0.0 and math.log(tail) + sharpen * float(_gumbel(self._open(TAIL, position))) > score[best]:
            rest = probs.clone()
            rest[torch.from_numpy(head).to(probs.device)] = 0
            if float(rest.sum()) > 0.0:  # else the tail was the sums' rounding, not mass
                return sample_index(rest, self._open(TAIL_PICK, position))
        return int(head[best])


class DraftPicks:
    """How a model draft samples the tokens it drafts this round, the i-th of which
    would be output position `start + i`: from its q with the request's drafting
    generator, or, under coupled sampling, as its guess of the target's pick there
    (`Draws.pick` over q, sharpened)."""

    def __init__(self, draws: Draws, start: int):
        self.draws, self.start = draws, start

    def pick(self, q: torch.Tensor, i: int, ids: torch.Tensor | None = None) -> int:
        """The index of q [V] (over the tokens `ids`, or ids 0..V-1) to draft as the round's i-th token."""
        if self.draws.coupled:
            return self.draws.pick(q, self.start + i, ids, SHARPEN)
        return sample_index(q, uniform(self.draws.drafting))


def logits_to_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits [N, V] -> probs [N, V] float32. Greedy (temperature 0) gives one-hot argmax
    rows, which makes the rejection sampler exact for greedy too."""
    logits = logits.float()
    if p.temperature == 0:
        probs = torch.zeros_like(logits)
        probs.scatter_(-1, argmax(logits).unsqueeze(-1), 1.0)
        return probs
    # A denormal temperature would turn the logits into infinities (and the softmax into NaN).
    logits = logits / max(p.temperature, MIN_TEMPERATURE)
    vocab = logits.shape[-1]
    if 0 < p.top_k < vocab:
        kth = torch.topk(logits, p.top_k, dim=-1).values[..., -1:]  # [N, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens strictly before it already cover top_p;
        # the most likely token always stays.
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = before >= p.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)
