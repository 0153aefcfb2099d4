"""Greedy decoding's head in two stages, exact.

A greedy row needs only the argmax of its logits, and on CPU the target's head is
the largest single weight a step reads (SmolLM2's 49,152 x 576 in float32, 113 MB,
3.4 ms of a ~25 ms decode step on an AMD EPYC). So greedy rows take the head in
two stages:

    screen     approximate logits from an int8 copy of the head (oneDNN's int8
               matmul: each weight row on its own int8 grid, each input row on
               its own 7-bit one), plus the few input channels that carry
               outliers in float32 (on SmolLM2, with 16 of them kept apart the
               screen left 180 candidates a row on average, with 32 ten)
    bound      how far an approximate logit can be from the real one, from the
               quantization errors alone (no statistics): |w - ŵ|_2 |x|_2 +
               |ŵ|_2 |x - x̂|_2 by Cauchy-Schwarz, the weight's error norms
               computed once, the input's per call, and a slack for float32
               rounding
    recompute  the candidates, the tokens whose approximate logit plus its bound
               reaches the best one's minus its bound, exactly: each one's row of
               the float32 head times x, summed; every other logit is -inf

The argmax of the result is the argmax over the whole vocabulary of those exact
dot products (a candidate set always holds it, by the bound), and each is a
function of its row and its token alone: a greedy row's token does not depend on
what it was batched with, nor on how many tokens it verified. It may differ from
a full float32 matmul's argmax only where two logits tie to float32 rounding, as
two BLAS kernels may. Sampling needs every logit and never comes here.

Shapes: N rows, E hidden size, V vocabulary, K candidates (all rows together).
"""

from __future__ import annotations

import logging
import math
import time

import torch

log = logging.getLogger(__name__)

OUTLIERS = 32  # channels kept in float32 (SmolLM2: 16 left 180 candidates a row on average, 32 left 10, 64 left 7)
SLACK = 2e-4  # of max|w| * |x|_1: float32 rounding of a 576-term dot product is under 4e-5 of it
CALIBRATION_TOKENS = 256  # random tokens after the text: outlier channels show on any input
WIN = 1.1  # "auto" keeps the two stages where they run the head this many times faster
# what the start-up calibration reads (engines/builtin.py tokenizes it): states of the kind a prompt's are
CALIBRATION_TEXT = (
    "Summarize the following passage in two sentences, then list three questions it leaves open.\n\n"
    "The city council approved the new transit budget on Tuesday after months of debate. The plan adds "
    "twelve bus routes, extends light rail service to the airport by 2028, and raises parking fees downtown "
    "to pay for it. Supporters say it will cut commute times; critics argue the fee increase hurts small "
    "businesses. def total(xs):\n    return sum(x * 2 for x in xs)  # 3 + 4 = 7")


class GreedyHead:
    """The head `weight` [V, E] (float32, dense; kept by reference) for greedy rows."""

    def __init__(self, weight: torch.Tensor, outliers: torch.Tensor):
        V, E = weight.shape
        self.weight = weight
        self.outliers = outliers.sort().values  # [k] channels screened in float32
        keep = torch.ones(E, dtype=torch.bool)
        keep[self.outliers] = False
        self.main = keep.nonzero()[:, 0]  # [E - k] channels screened in int8
        w_main = weight[:, self.main]
        self.w_step = (w_main.abs().amax(1) / 127).clamp_min(1e-30)  # [V]: each row's int8 step
        q = torch.round(w_main / self.w_step[:, None]).to(torch.int8)  # [V, E - k]
        self.packed = torch.ops.onednn.qlinear_prepack(q, [1, E - len(self.outliers)])
        self.w_zero = torch.zeros(V, dtype=torch.long)
        self.outlier_t = weight[:, self.outliers].t().contiguous()  # [k, V]: x_o @ it is [N, V]
        w_hat = q.float() * self.w_step[:, None]
        # the bound, per token, is [|x_m|_2, |e|_2, |x|_1] @ coef (Cauchy-Schwarz on each error, a slack for rounding)
        self.coef = torch.stack([(w_main - w_hat).norm(dim=1), w_hat.norm(dim=1), SLACK * weight.abs().amax(1)])
        self.screens = self.candidates = 0  # rows screened, candidates recomputed (their ratio is reported)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, E] (normed final states) -> [N, V]: exact logits at each row's
        candidates, -inf elsewhere."""
        if not bool(x.isfinite().all()):  # no bound holds: the full head, whose logits say what went wrong
            return x @ self.weight.t()
        xm, xo = x.index_select(1, self.main), x.index_select(1, self.outliers)  # [N, E-k], [N, k]
        # each row quantized on its own 7-bit grid (levels 1..127 around 64: no int16 sum of two
        # products saturates on CPUs without VNNI), its error e known exactly
        step = (xm.abs().amax(1, keepdim=True) / 63).clamp_min(1e-30)  # [N, 1]
        q = torch.round(xm / step).clamp_(-63, 63)  # [N, E-k]
        e = xm - q * step
        approx = torch.ops.onednn.qlinear_pointwise((q + 64).to(torch.uint8), 1.0, 64, self.packed, self.w_step,
                                                    self.w_zero, None, 1.0, 0, torch.float32, "none", [], "")
        approx.mul_(step).add_(xo @ self.outlier_t)  # [N, V]
        # |logit - approx| <= |w - ŵ|_2 |x_m|_2 + |ŵ|_2 |e|_2 + slack: a token is a candidate if its upper
        # end reaches the best lower end in its row (the exact argmax always does)
        norms = torch.cat([xm.norm(dim=1, keepdim=True), e.norm(dim=1, keepdim=True),
                           x.abs().sum(1, keepdim=True)], 1)  # [N, 3]
        eps = norms @ self.coef  # [N, V]
        rows, cols = (approx + eps >= (approx - eps).amax(1, keepdim=True)).nonzero().unbind(1)  # [K] each
        out = torch.full_like(approx, -math.inf)
        # one row of the head times x per candidate: the same sum whatever else is recomputed with it
        out[rows, cols] = (self.weight.index_select(0, cols) * x.index_select(0, rows)).sum(-1)
        self.screens += x.shape[0]
        self.candidates += len(cols)
        return out

    @staticmethod
    def supported(device: torch.device, dtype: torch.dtype) -> bool:
        """oneDNN's int8 matmul: a float32 model on the CPU, where torch has it."""
        return (device.type == "cpu" and dtype == torch.float32
                and hasattr(torch.ops.onednn, "qlinear_pointwise") and torch.backends.mkldnn.is_available())


def outlier_channels(states: torch.Tensor, k: int = OUTLIERS) -> torch.Tensor:
    """The k channels with the largest magnitude over `states` [T, E] (normed final states),
    at most a quarter of them: the int8 screen reads the rest."""
    return states.abs().amax(0).topk(min(k, states.shape[1] // 4)).indices


def calibrate(model, text_ids: list[int]) -> tuple[GreedyHead, torch.Tensor]:
    """A GreedyHead for `model`'s head, its outlier channels from a forward over
    `text_ids` then random tokens (the channels are the model's, whatever the
    text), and the text's normed final states [T, E]."""

    from engines.layouts import dense

    cfg = model.cfg
    g = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.tensor(text_ids, dtype=torch.long),
                     torch.randint(0, cfg.vocab_size, (CALIBRATION_TOKENS,), generator=g)]).to(model.device)
    cache = model.new_cache(len(ids))
    _, states = model.forward_many([(ids, cache, False)], hidden=True)
    normed = model.final_norm(states[0])  # [T, E]
    w, embed = dense(model.weights.lm_head), model.weights.embed
    if w is not embed and w.shape == embed.shape and torch.equal(w, embed):
        w = embed  # a head tied to the embedding laid out for oneDNN: the embedding, not a copy of it
    return GreedyHead(w, outlier_channels(normed)), normed[:len(text_ids)]


def choose_greedy_head(model, setting: bool | str, text_ids: list[int], rounds: int = 6) -> GreedyHead | None:
    """`setting` True: a GreedyHead wherever it is supported; "auto": where it is, if
    it runs one and four rows at least WIN times faster than the head as laid out
    (timed alternately on the last states of `text_ids`, which should read like a
    prompt); False: None."""
    from engines.layouts import linear
    from engines.profile import fastest_alternated

    if not setting or not GreedyHead.supported(model.device, model.dtype):
        return None
    t0 = time.perf_counter()
    head, states = calibrate(model, text_ids)
    if setting is True:
        return head
    xs = {n: states[-n:].contiguous() for n in (1, 4)}
    two = [False]

    def switch(on: bool) -> None:
        two[0] = on
    best = fastest_alternated(switch, lambda x: head(x) if two[0] else linear(x, model.weights.lm_head), xs,
                              2 * rounds, model.device)  # as laid out, two-stage
    wins = all(best[1][n] * WIN <= best[0][n] for n in xs)
    log.info("greedy rows' head in two stages (int8 screen, exact candidates): %s; 1 row %.2f against %.2f ms, "
             "4 rows %.2f against %.2f ms (%.1f s)", "on" if wins else "off", best[1][1] * 1e3, best[0][1] * 1e3,
             best[1][4] * 1e3, best[0][4] * 1e3, time.perf_counter() - t0)
    return head if wins else None
