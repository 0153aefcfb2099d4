"""How much to verify, per round and per step.

Per round, each speculative row estimates how likely each drafted token is to
be accepted (given the ones before it):

    prompt lookup   its match length and the token's place in the copy (a
                    longer match and a copy already running predict the next
                    token better), calibrated online against what the target
                    accepted (scaled per request by how its own drafts fare
                    against that); the prior is optimistic, because a bin never
                    verified is never learned and a lookup costs no drafting
    model drafts    the draft's confidence in its token, calibrated online
                    against what the target accepted (per draft, greedy or not)

A token's survival is the product of the estimates up to it: the expected number
of tokens it adds if verified.

Per step, the batch has one budget: the target forward costs about
a + b·(matmul rows) + c·rows + e·(rows feeding more than one token) (+ d once
it feeds more than one token) seconds, and a lone row what was measured for
its token count (the step-cost model, engines/stepcost.py: profiled at
start-up, refitted from every step). Verifying one more draft token adds
about b seconds, a row's first one b + e, and its survival in expected tokens;
rows are opened with their best prefix and extended a draft at a time, in
order of expected tokens per added second, while that beats the batch's
decoding rate (tokens emitted per second of a step without prefill chunks:
what an accepted token saves is its row's share of a decode step): expected
tokens over added seconds > emitted / seconds. A forward's cost is not linear
in its tokens (it jumps where the matmuls leave BLAS's small-matrix kernels for
the MKL-packed copies, and after the first token): the admissions are cut to
the prefix whose exact price gives the best rate.
A lone decoding row's prefixes are judged whole against its measured steps.
Alone, plausible drafts are verified; in a saturated batch only near-certain
ones are. Verifying fewer drafts is only a smaller k: output stays exactly the
target's.

Drafting is priced the same way: a model draft starts only if some prefix,
at the row's recent acceptance, pays for its verification and its measured
drafting seconds, and keeps drafting while its next token's survival beats
(b + its drafting seconds per token) · rate.

The tail: maximising the batch's rate lets a row that gains nothing pay for
the others' verification in every step it shares with them (in a closed loop
at concurrency 16, p99 11-18% above plain's at the same throughput). Under a
bound S, each request keeps an account (`Slowdown`): every shared step credits
it S of the step without verification, each of its accepted drafts the decode
step it no longer needs, and debits it what drafting, verification and judging
the verified drafts added to the step. A step may add no more than its poorest
row's balance (its room), whose drafts are admitted first (a row never verified
never earns), so no request ends more than about S slower than plain, whoever
it shares steps with, while rows that all gain may verify freely; a row drafts
no more than the room leaves to verify: a draft nobody may verify is drafting
paid for nothing.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from engines.stepcost import StepCost


class AcceptanceEstimate:
    """A request's recent per-token acceptance: whether a model draft is worth
    running at all this round, before it has drafted anything to calibrate.

    Counts of draft tokens tried (up to the first rejection) and accepted, older
    rounds fading by `decay` (about twenty rounds' memory), over `weight`
    pseudo-tokens at the prior: a run of rejections moves it little, a collapse
    closes the gate within about fifteen rounds. (A moving average at 0.3 per
    round closed it after three rejections in a row, which a head accepted 28% of
    the time meets every few rounds: at concurrency 1 and T=0.7 it drafted nothing
    in 30% of rounds, where one token always paid.)"""

    def __init__(self, prior: float = 0.5, weight: float = 4.0, decay: float = 0.95, relax: float = 0.1):
        self.prior, self.weight, self.decay, self.relax = prior, weight, decay, relax
        self.accepted = self.tried = 0.0

    @property
    def value(self) -> float:
        return (self.prior * self.weight + self.accepted) / (self.weight + self.tried)

    def _add(self, accepted: float, tried: float) -> None:
        self.accepted = self.accepted * self.decay + accepted
        self.tried = self.tried * self.decay + tried

    def observe(self, verified: int, accepted: int) -> None:
        if verified <= 0:
            # nothing verified this round: the evidence fades toward the prior (a collapsed
            # row becomes worth a probe again once the batch has room)
            self.accepted *= 1.0 - self.relax
            self.tried *= 1.0 - self.relax
            return
        self._add(accepted, accepted + (1 if accepted < verified else 0))  # tokens tried until the first rejection

    def settle(self, belief: float) -> None:
        """Drafted but not verified: evidence at what the draft believed its first token worth,
        counted as `weight` tokens (a calibrated belief, not one token's luck), so a draft
        judged weak round after round (as under load) closes its own gate within about five
        rounds: drafting nobody verifies lengthens every row's step."""
        self._add(belief * self.weight, self.weight)


class RequestBias:
    """How one request's drafts fare against the engine-wide calibration:
    accepted over expected on the tokens it tried, recent rounds weighing most,
    with a prior of M tried tokens at the calibrated rate (no evidence: as
    calibrated). A request that copies its prompt accepts more than the shared
    bins predict, a chatty one less; its estimates are scaled by the ratio.

    Two ratios: one for a draft's first token (does a copy start right), one for
    the tokens after an accepted one (does it hold). Prompt lookup at T=0.7 on
    free text had its first token accepted at ~0.16 and a second after an
    accepted first at ~0.65: one ratio, learned mostly on first tokens, scaled
    every later token's estimate down again (the j-th token's survival by r^j),
    and the adaptive arm verified one token in rounds where two paid.

    The prior counts tried tokens, not expected ones: a prior of M expected
    tokens weighs like M / 0.2 tried tokens at lookup's first-token estimates of
    ~0.2, so with M = 2 a request whose lookups are all rejected would keep half
    the shared estimate (2 / (10 · 0.2 + 2) over the ratio's memory of ~10
    rounds), above the price of one verified draft, and verify one every round
    for nothing (0.96–0.99x plain on free text at T=0.7)."""

    M = 4.0  # tried tokens
    DECAY = 0.9  # per round with evidence: the ratio follows a request that stops copying

    def __init__(self):
        self.observed = [0.0, 0.0]  # [first tokens, later tokens]
        self.expected = [0.0, 0.0]
        self.tried = [0.0, 0.0]

    def ratio(self, later: bool = False) -> float:
        if self.expected[later] <= 0.0:
            return 1.0  # nothing tried (or only at estimates of zero): as calibrated
        prior = self.M * self.expected[later] / self.tried[later]  # M tried at their mean estimate
        return (self.observed[later] + prior) / (self.expected[later] + prior)

    def apply(self, estimates: torch.Tensor) -> torch.Tensor:
        out = estimates * self.ratio(True)
        out[:1] = estimates[:1] * self.ratio(False)
        return out.clamp(0.0, 0.99)

    def observe(self, estimates: torch.Tensor, accepted: int) -> None:
        """Calibrated estimates of the tokens verified, and how many were accepted."""
        tried = min(len(estimates), accepted + 1)
        if tried:
            self._add(0, min(accepted, 1), float(estimates[0]), 1)
        if tried > 1:  # the tokens after the first, up to the first rejected
            self._add(1, accepted - 1, float(estimates[1:tried].sum()), tried - 1)

    def _add(self, i: int, accepted: float, expected: float, tried: int) -> None:
        self.observed[i] = self.observed[i] * self.DECAY + accepted
        self.expected[i] = self.expected[i] * self.DECAY + expected
        self.tried[i] = self.tried[i] * self.DECAY + tried


class Calibration:
    """Acceptance against a draft's score of its token, in bins, per (draft,
    greedy): turns a model draft's top probability, or prompt lookup's match
    score, into an estimate of acceptance."""

    BINS = 10

    def __init__(self, decay: float = 0.995):
        self.decay = decay
        self._tables: dict[tuple, np.ndarray] = {}
        self._priors: dict[tuple, np.ndarray] = {}

    def start(self, key, prior: tuple[float, float]) -> None:
        """The prior for `key` (accepted, tried pseudo-counts per bin), if it has no table yet."""
        if key not in self._tables:
            self._priors[key] = np.stack([np.full(self.BINS, prior[0]), np.full(self.BINS, prior[1])])
            self._tables[key] = self._priors[key].copy()

    def _table(self, key) -> np.ndarray:
        # default prior: an even chance, worth 4 trials per bin, so that every bin gets verified and learned
        self.start(key, (2.0, 4.0))
        return self._tables[key]

    def value(self, key, confidence: float) -> float:
        """One token's estimate (what a model draft multiplies while it drafts)."""
        t = self._table(key)
        b = min(max(int(confidence * self.BINS), 0), self.BINS - 1)
        return float(t[0][b] / t[1][b])

    def estimate(self, key, confidence: torch.Tensor) -> torch.Tensor:
        t = self._table(key)
        bins = (confidence.clamp(0, 0.9999) * self.BINS).long().numpy()
        return torch.from_numpy(t[0][bins] / t[1][bins]).float()

    def observe(self, key, confidence: torch.Tensor, accepted: int) -> None:
        """The tokens tried (up to and including the first rejected) and which were accepted."""
        t = self._table(key)
        # old evidence fades toward the prior: a bin judged weak and no longer verified
        # drifts back to worth a try, as the traffic it was judged on may have changed
        t *= self.decay
        t += (1.0 - self.decay) * self._priors[key]
        tried = min(len(confidence), accepted + 1)
        for i in range(tried):
            b = min(int(float(confidence[i]) * self.BINS), self.BINS - 1)
            t[1][b] += 1.0
            t[0][b] += 1.0 if i < accepted else 0.0


class Slowdown:
    """One request's account under a bound S on what sharing steps with drafting
    and verification may cost it against plain decoding (see the module's
    docstring): seconds the others may still spend on verification without
    making it more than S slower than plain."""

    def __init__(self):
        self.balance = 0.0

    def settle(self, bound: float, step_s: float, decode_s: float, saved: int, added_s: float) -> None:
        """One shared step: `step_s` its seconds without drafting or verification,
        `decode_s` a decode step's (what an accepted draft saves), `saved` this
        row's accepted drafts, `added_s` what drafting, verification and judging
        the verified drafts added."""
        self.balance += bound * step_s + saved * decode_s - added_s


def room(bound: float | None, balances: list[float], step_s: float) -> float | None:
    """Seconds drafting and verification may add to a step shared by these
    rows (None: no bound, or a lone row, whose drafts harm nobody): the
    poorest row's balance with this step's credit."""
    if bound is None or len(balances) <= 1:
        return None
    return max(min(balances) + bound * step_s, 0.0)


def admit(survivals: list[list[float]], base_tokens: int, emitted: int, cost: StepCost, rows: int,
          room_s: float | None = None, prefill: int = 0, chunks: int = 0, verifying: int = 0,
          first: list[float] | None = None) -> list[int]:
    """How many drafted tokens to verify for each row.

    survivals[r][j]: expected tokens added by verifying row r's j+1-th draft
    (non-increasing in j). base_tokens: tokens the decoding rows feed anyway
    (one each, and drafts verified whole by `verifying` rows); prefill: prefill
    chunks' tokens in the same forward, fed by `chunks` rows; emitted: tokens
    the step emits anyway (one per decoding row). Greedy on expected tokens per
    added second while that beats the batch's decoding rate, and, with
    `room_s`, while verification adds at most that many seconds to a step
    shared by several rows; with `first` (a value per row), a row with a lower
    value is served before any with a higher one, whatever their offers.

    A row's first verified draft also pays its leaving the one-token path (e),
    so a row is opened with the prefix that brings the most per second, and
    extended one draft at a time after that.

    Offers are ranked by a draft token's average price over all the drafts
    offered; what is admitted is then cut to the prefix of the admissions with
    the best rate at the forward's exact price. A forward's cost jumps where its
    matmuls leave the small-matrix kernels (engines/stepcost.py): the token
    that crosses costs the jump, so one slot may not pay for crossing where
    several do.

    A slot costs what it adds to the whole forward, prefill included; the rate
    it must beat is the decoding rows' alone, emitted over a step without the
    prefill: an accepted token saves its row a decode step's share, not a share
    of a long prefill step (priced that way, drafts looked nearly free in every
    step that prefilled a newcomer)."""
    if base_tokens == 1 and len(survivals) == 1 and not prefill:
        return [_best_prefix(survivals[0], emitted, cost, rows)]
    full, multi = base_tokens + prefill, verifying + chunks
    seconds = cost.step(full, rows, multi)
    rate_s = cost.step(base_tokens, rows, verifying) if prefill else seconds  # the decoding rows' step
    longest = seconds + room_s if room_s is not None and rows > 1 else None
    # over every draft offered: a pack's jump shared by all the drafts it could carry
    token_s = max(token_price(cost, full, rows, multi + 1, sum(map(len, survivals))), 1e-9)
    row_s = max(cost.step(full, rows, multi + 1) - seconds, 0.0)
    tier = first or [0.0] * len(survivals)
    heap = [(tier[r], *_opening(ss, r, token_s, row_s)) for r, ss in enumerate(survivals) if ss]
    heapq.heapify(heap)
    ranked, gain, ranked_s = [0] * len(survivals), float(emitted), rate_s  # the greedy, at ranking prices
    tokens, opened = full, multi
    admitted = []  # in order: (row, its drafts verified now, the batch's rate at the exact price)
    while heap:
        _, _, r, k, added, added_s = heapq.heappop(heap)  # the most expected tokens per second left
        more, opens = k - ranked[r], ranked[r] == 0
        exact_s = cost.step(tokens + more, rows, opened + opens)
        if longest is not None and exact_s > longest:
            continue  # no room for it: the row stops here, a smaller offer may still fit
        if added * ranked_s <= added_s * max(gain, 1e-9):  # added / added_s <= gain / ranked_s: it would lower the rate
            continue
        ranked[r], gain, ranked_s = k, gain + added, ranked_s + added_s
        tokens, opened = tokens + more, opened + opens
        admitted.append((r, k, gain / (rate_s + exact_s - seconds)))
        if k < len(survivals[r]):
            s = survivals[r][k]
            heapq.heappush(heap, (tier[r], -s / token_s, r, k + 1, s, token_s))
    best = max(range(len(admitted)), key=lambda i: admitted[i][2], default=None)
    take = [0] * len(survivals)
    if best is not None and admitted[best][2] > emitted / rate_s:
        for r, k, _ in admitted[:best + 1]:
            take[r] = k
    return take


def token_price(cost: StepCost, tokens: int, rows: int, multi: int, span: int) -> float:
    """A draft token's seconds on average over the next `span` added to a forward
    of `tokens`: the forward's cost jumps (engines/stepcost.py), so the next
    token alone may cost a whole jump."""
    span = max(span, 1)
    return (cost.step(tokens + span, rows, multi) - cost.step(tokens, rows, multi)) / span


def drafting_price(old: float | None, seconds: float, tokens: int) -> float:
    """A model draft's drafting price, seconds per drafted token: a moving average
    of its calls, each call's share capped at 3x the average. The drafts' clocks
    leave a catch-up out (engines/proposers/base.py: DraftingClock); a call timed
    whole (a draft without a clock) may still read a prompt through the draft, up
    to 18x a round's drafting per token on the EAGLE head. Capped, a machine that
    really slows is still followed (the price may rise 1.2x a call)."""
    share = seconds / tokens
    return share if old is None else 0.9 * old + 0.1 * min(share, 3.0 * old)


def _opening(survivals: list[float], r: int, token_s: float, row_s: float) -> tuple:
    """A row's first admission: the prefix with the most expected tokens per added second."""
    best, total = None, 0.0
    for k, s in enumerate(survivals, start=1):
        total += s
        cost_s = k * token_s + row_s
        if best is None or total / cost_s > -best[0]:
            best = (-total / cost_s, r, k, total, cost_s)
    return best


def _best_prefix(survivals: list[float], emitted: int, cost: StepCost, rows: int) -> int:
    """A lone decoding row: the first verified token also pays the step-cost jump
    (d), so prefixes are judged whole: the k that maximises tokens per second."""
    best_k, best_rate, gain = 0, emitted / cost.step(1, rows), float(emitted)
    for k, s in enumerate(survivals, start=1):
        gain += s
        rate = gain / cost.step(1 + k, rows)
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k


def survival(estimates: torch.Tensor) -> list[float]:
    """Per-token acceptance estimates -> expected tokens added by each prefix."""
    out, p = [], 1.0
    for e in estimates.tolist():
        p *= min(max(e, 0.0), 1.0)
        out.append(p)
    return out


def threshold(cost: StepCost, tokens: int, rows: int, emitted: int, drafting_s: float = 0.0,
              span: int = 8) -> float:
    """The least survival worth drafting and verifying one more token on top
    of a first, in a step of this size: the token costs what it adds to the
    forward (on average over the `span` tokens after the first: the forward's
    cost jumps) and its drafting (`drafting_s`, zero for
    prompt lookup), and must bring at least the batch's rate back."""
    if emitted <= 0:
        return 0.0
    added = max(token_price(cost, tokens + 1, rows, 1, span), 0.0)
    return min(1.0, (added + drafting_s) * emitted / max(cost.step(tokens, rows), 1e-9))


def stretch_room(cost: StepCost, tokens: int, rows: int, room_s: float | None, drafting_s: float = 0.0,
                 limit: int = 64) -> int:
    """Draft tokens that `room_s` seconds leave room to draft and verify in a
    step of this size (at most `limit`): what one row may draft at all, since
    no row gets more than the whole step's room. Unbounded (`limit`) without a
    bound or for a lone row. A model draft's drafting lengthens the step too,
    so its seconds per token count against the room."""
    if room_s is None or rows <= 1:
        return limit
    longest = cost.step(tokens, rows) + room_s
    n = 0
    while n < limit and cost.step(tokens + n + 1, rows, 1) + (n + 1) * drafting_s <= longest:
        n += 1
    return n


def worth_drafting(acceptance: float, k: int, cost: StepCost, tokens: int, rows: int, emitted: int,
                   drafting_s: float = 0.0) -> bool:
    """Whether a row should draft at all this step: some prefix of up to k
    tokens, each kept with the row's recent acceptance, must raise the step's
    rate once its verification and drafting are paid. Judged by prefix, because
    for a step feeding one token the first draft also pays the jump beyond one
    token, which the tokens after it share."""
    if emitted <= 0:
        return True
    base = cost.step(tokens, rows)
    gain, p = float(emitted), 1.0
    for j in range(1, k + 1):
        p *= min(max(acceptance, 0.0), 1.0)
        gain += p
        if gain * base > emitted * (cost.step(tokens + j, rows, 1) + j * drafting_s):
            return True
    return False
