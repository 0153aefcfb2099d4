"""How matmul weights are laid out on CPU, and the one `linear` that runs them.

Four layouts, chosen by the start-up profile (engines/profile.py) because the
project's CPUs disagree about which is fastest:

    dense       plain tensors, BLAS (MKL) matmuls
    oneDNN      weights re-laid in oneDNN's blocked format (won 1.4x on an AMD
                EPYC, lost 1.4-1.6x on an Intel Xeon)
    bfloat16    the matmuls alone in bfloat16 (weights and inputs rounded to it,
                products summed in float32 by the CPU's bfloat16 kernels: AMX,
                AVX512-BF16); everything else stays float32. On an Intel Xeon
                with AMX a forward of SmolLM2's matmuls cost about the same for 1
                to 16 rows, where float32's doubled from 3 rows up: a lone row
                verifying 8 drafts took 1.17x a decode step instead of 1.5-2.1x,
                16 rows decoding 0.73x float32's time. Off unless configured
                (target.bf16_matmuls): rounding to bfloat16 makes float32's
                last-bit differences between forward shapes visible, so greedy
                outputs of different arms may differ at near-ties.
    row packs   dense, plus one copy MKL pre-packed (cblas_sgemm_pack) that runs
                every forward of at least `least` rows (measured at start-up),
                called with its own rows. A BLAS matmul of a few rows repacks
                the whole weight on every call: on the Intel Xeon a forward of
                SmolLM2 feeding 4 tokens cost 1.6x one feeding 1 dense, 1.2x
                packed. The copy is packed once, for PACKED_FOR rows, and
                serves any row count (MKL's packed B does not depend on the
                rows it was packed for; `packs_agree` checks that at start-up):
                one copy for every size, without padding, was 12-18% faster
                than copies per size padded to it for 4-6 tokens and for 18
                rows, equal at 9, 4% slower at 16, and costs one copy of the
                weights in memory instead of three.

Over this, any matmul may run as W @ xᵀ over a dense copy of its weight for
forwards of up to `upto` rows (Columns; the layers and the head each get their
own bound, measured at start-up): MKL's GEMM with the weight as its left
operand and the few rows as columns streams the weight from memory faster than
oneDNN's or BLAS's x @ Wᵀ kernels do for a few rows. A decode step reads every
weight once from memory (SmolLM2 in float32: ~0.5 GB a step), so that speed is
the step's: on an AMD EPYC, 30 layers' matmuls for one row took 12.9 ms as
W @ xᵀ (the row fed as two: a lone column takes BLAS's slower matrix-vector
path) against oneDNN's 20.8, 2 rows 12.3 against 21.7, 5 rows 24.1 against
26.5; from 6 rows oneDNN is faster. The copy costs memory: the layers once more
where the layout is not dense (a dense layout, and a head tied to the
embedding, use the weight itself). Drafts with weights of their own take the
target's bounds (Drafts.route_columns): the same kernels, on weights as cold in
cache between two target forwards. Where it builds and the start-up profile
times it faster, the route runs the panels kernel instead of MKL
(engines/panels.py: a copy of the weight laid out as one stream, read as fast
for 4 rows as MKL reads it for 1, and the same bits for a row whatever rows
are fed with it).

A row's result does not depend on the layout beyond float rounding (the same
kind of difference as between BLAS kernels for different row counts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engines.panels import Panel, kernel

if TYPE_CHECKING:
    from engines.llama import LlamaWeights

MATMULS = ("qkv", "o", "gate_up", "down")


PACKED_FOR = 128  # the rows MKL packs each copy for: its blocking for prefill chunks, as good as packing for 9-32 below


class RowPacked:
    """A dense weight [out, in] and one MKL-packed copy of it, which runs every
    forward of at least `least` rows (None: none)."""

    def __init__(self, dense: torch.Tensor, least: int | None, packed: torch.Tensor | None = None):
        self.dense = dense
        self.least = least
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(dense, PACKED_FOR) if packed is None else packed

    def __call__(self, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        m = x.shape[0]
        if not runs_packed(m, self.least):
            return F.linear(x, self.dense, b)
        return torch.ops.mkl._mkl_linear(x.contiguous(), self.packed, self.dense, b, m)  # m: the rows it runs


class Bf16:
    """A float32 weight [out, in] whose matmuls run in bfloat16 (the float32 one
    kept: what dense() and to_dense() give back)."""

    def __init__(self, dense: torch.Tensor):
        self.dense = dense
        self.half = dense.to(torch.bfloat16)

    def __call__(self, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        y = F.linear(x.to(torch.bfloat16), self.half).to(x.dtype)
        return y if b is None else y + b


class Columns:
    """A weight in the layout `w`, run as W @ xᵀ for forwards of up to `upto` rows
    (0: never, the copies kept) and as laid out beyond: over its dense form
    `dense_w` by MKL, or, where it has a `panel` and `on_panels` is set, by the
    panels kernel (engines/panels.py). MKL's results come back as a transposed
    view: [rows, out], not contiguous (what reads them reads rows). `copied`: the
    dense form is a copy made for the route (not the weight itself, nor a tied
    embedding), which drop_copy frees while the panels run it."""

    def __init__(self, w, upto: int, dense_w: torch.Tensor, panel: Panel | None = None, copied: bool = False):
        self.w, self._dense, self.upto, self.panel, self.copied = w, dense_w, upto, panel, copied
        self.on_panels = panel is not None

    @property
    def dense(self) -> torch.Tensor:
        """The weight as a plain tensor (unpacked from the panels where its copy was dropped)."""
        return self._dense if self._dense is not None else self.panel.unpack()

    def run_panels(self, on: bool) -> None:
        """Run by the panels (where it has them) or by MKL, whose dense copy comes back if dropped."""
        self.on_panels = on and self.panel is not None
        if not self.on_panels and self._dense is None:
            self._dense = self.panel.unpack()

    def drop_copy(self) -> int:
        """Free the dense copy while the panels run this weight (nothing else reads it);
        gives the bytes freed."""
        if not (self.copied and self.on_panels and self._dense is not None):
            return 0
        freed, self._dense = self._dense.numel() * self._dense.element_size(), None
        return freed

    def __call__(self, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        m = x.shape[0]
        if m > self.upto:
            return linear(x, self.w, b)
        if self.on_panels:
            y = self.panel(x)  # [m, out]
            return y if b is None else y + b
        # contiguous rows: MKL takes their transpose as a column-major operand (strided ones ran slower);
        # a lone row goes as two, else BLAS takes its matrix-vector path (2.6x slower for SmolLM2's head)
        cols = x.contiguous() if m > 1 else x.expand(2, -1).contiguous()  # [max(m, 2), in]
        y = torch.mm(self._dense, cols.t()).t()[:m]  # [m, out]
        return y if b is None else y + b


def route_columns(weights: LlamaWeights, layers: int, head: int, panels: bool = False) -> None:
    """Run the layers' matmuls as W @ xᵀ for forwards of up to `layers` rows and the
    head for up to `head` (0: as laid out, the copies dropped), by the panels kernel
    where `panels` (and it was built and fits the weight), else by MKL. Laying the
    weights out again (LAYOUTS, pack_rows: to_dense first) drops the routes."""
    for lw in weights.layers:
        for name in MATMULS:
            setattr(lw, name, route_matmul(getattr(lw, name), layers, panels=panels))
    weights.lm_head = route_matmul(weights.lm_head, head, tied=weights.embed, panels=panels)


def routed(weights: LlamaWeights) -> list[Columns]:
    """The layers' routed matmuls (what the start-up profile toggles)."""
    return [w for lw in weights.layers for w in (getattr(lw, n) for n in MATMULS) if isinstance(w, Columns)]


def pass_rows(weights: LlamaWeights) -> int:
    """Input rows one pass over the layers' routed weights takes where the panels run
    them (the fewest, should formats differ), 0 where none does: a routed forward's
    tokens read the layers' weights once per that many."""
    return min((c.panel.inputs for c in routed(weights) if c.on_panels), default=0)


def route_matmul(w, upto: int, tied: torch.Tensor | None = None, panels: bool = False):
    """One weight run as W @ xᵀ for forwards of up to `upto` rows (0: as laid out);
    `tied`: the tensor a dense copy may be instead of a copy; `panels`: by the
    panels kernel, given a copy in panels (made once, kept while routed)."""
    if isinstance(w, Columns):
        if not upto:
            return w.w
        w.upto = upto
    elif not upto:
        return w
    else:
        d = dense(w)
        if tied is not None and d is not tied and d.shape == tied.shape and torch.equal(d, tied):
            d = tied  # the embedding, not a copy of it
        copied = d is not tied and isinstance(w, torch.Tensor) and w.is_mkldnn  # to_dense() made d
        w = Columns(w, upto, d, copied=copied)
    k = kernel() if panels else None
    if k is not None and w.panel is None and k.fits(w.dense):
        w.panel = Panel(w.dense, k)
    w.run_panels(panels)
    return w


def drop_dense_copies(weights: LlamaWeights) -> int:
    """Free the dense copies of weights the panels run (Columns.drop_copy): once the
    routes are final, MKL's route reads them no more. Gives the bytes freed."""
    return sum(c.drop_copy() for c in [*routed(weights), weights.lm_head] if isinstance(c, Columns))


def unrouted(w):
    """A weight as laid out, whether routed as W @ xᵀ or not."""
    return w.w if isinstance(w, Columns) else w


def runs_packed(rows: int, least: int | None) -> bool:
    """Whether a forward of this many rows runs the MKL-packed copies (the step
    cost prices the switch by the same rule)."""
    return least is not None and rows >= least


def can_pack_rows(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 and torch._C.has_mkl and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


def linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] @ w [out, in]^T (+ b), whatever w's layout."""
    if isinstance(w, (RowPacked, Bf16, Columns)):
        return w(x, b)
    if w.is_mkldnn:
        # oneDNN's linear with dense activations: the same kernel, bit for bit, as converting
        # them to its format and back, without the two conversions (~30 us per matmul on an
        # AMD EPYC, a tenth of a decode step over SmolLM2's 121 matmuls)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, b, "none", [], "")
    return F.linear(x, w, b)


def dense(w) -> torch.Tensor:
    """The plain tensor of a weight in any layout."""
    if isinstance(w, (RowPacked, Bf16, Columns)):
        return w.dense
    return w.to_dense() if w.is_mkldnn else w


def pack_for_cpu(weights: LlamaWeights) -> None:
    """Re-lay the matmul weights in oneDNN's blocked format (fp32 CPU only).

    Measured on an AMD EPYC (SmolLM2-135M, fp32): a decode step went from ~68 ms
    to ~49 ms and verifying 8 drafts from 1.9x to 1.5x a step, because oneDNN's
    small-M kernels beat the BLAS path for 2..16 rows there.
    """
    to_dense(weights)
    for lw in weights.layers:
        for name in MATMULS:  # biases stay dense: linear() adds them in oneDNN's kernel as they are
            setattr(lw, name, getattr(lw, name).to_mkldnn())
    weights.lm_head = weights.lm_head.to_mkldnn()


def to_bf16(weights: LlamaWeights) -> None:
    """Run the matmuls (and the head) in bfloat16; the float32 weights are kept for to_dense."""
    to_dense(weights)
    for lw in weights.layers:
        for name in MATMULS:
            setattr(lw, name, Bf16(getattr(lw, name)))
    weights.lm_head = Bf16(weights.lm_head)


def can_run_bf16(dtype: torch.dtype) -> bool:
    """float32 weights on a CPU whose oneDNN runs bfloat16 natively (else it is emulated: not worth timing)."""
    return dtype == torch.float32 and torch.backends.mkldnn.is_available() and \
        bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_rows(weights: LlamaWeights, least: int | None) -> None:
    """Dense weights, each with one MKL-packed copy for forwards of at least
    `least` rows (None: plain dense, no copies); copies already packed are kept."""
    known = {id(w.dense): w.packed for w in _row_packed(weights)}
    to_dense(weights)
    if least is None:
        return
    for lw in weights.layers:
        for name in MATMULS:
            t = getattr(lw, name)
            setattr(lw, name, RowPacked(t, least, known.get(id(t))))
    weights.lm_head = RowPacked(weights.lm_head, least, known.get(id(weights.lm_head)))


def route_rows(weights: LlamaWeights, least: int | None) -> None:
    """From how many rows row-packed weights run their packed copies (None: never),
    packing nothing: what the start-up profile times."""
    for w in _row_packed(weights):
        w.least = least


def packs_agree(weights: LlamaWeights, rows: tuple[int, ...] = (1, 5, 40), tol: float = 1e-4) -> bool:
    """Whether every packed copy computes what its dense weight does at these
    row counts (relative to the result's scale): one copy serves every size
    only because MKL's packed layout does not depend on the rows it was packed
    for, which no documentation promises."""
    g = torch.Generator().manual_seed(0)
    for w in _row_packed(weights):
        for m in rows:
            x = torch.randn(m, w.dense.shape[1], generator=g, dtype=w.dense.dtype)
            want = F.linear(x, w.dense)
            got = torch.ops.mkl._mkl_linear(x, w.packed, w.dense, None, m)
            if not torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max())):
                return False
    return True


def _row_packed(weights: LlamaWeights) -> list[RowPacked]:
    return [w for w in map(unrouted, [*(getattr(lw, n) for lw in weights.layers for n in MATMULS), weights.lm_head])
            if isinstance(w, RowPacked)]


def to_dense(weights: LlamaWeights) -> None:
    """Back to plain tensors from any layout; a tied head stays the embedding."""
    for lw in weights.layers:
        for name in (*MATMULS, "qkv_bias"):
            t = getattr(lw, name)
            if t is not None:
                setattr(lw, name, dense(t))
    head = dense(weights.lm_head)
    weights.lm_head = weights.embed if head is not weights.embed and torch.equal(head, weights.embed) else head


# the start-up profile's choices, by the name it logs: weights of every kind laid out one way
LAYOUTS = {"dense": to_dense, "packed": pack_for_cpu, "bf16": to_bf16}
