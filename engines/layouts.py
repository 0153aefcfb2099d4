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
    row packs   dense, plus copies MKL pre-packed for forwards of exactly n
                rows (cblas_sgemm_pack). A BLAS matmul of a few rows repacks
                the whole weight on every call: on the Intel Xeon a forward of
                SmolLM2 feeding 4 tokens cost 1.5x one feeding 3, and 9 tokens
                2.1x one. A forward of m rows pads its input to the smallest
                packed size that serves it (`buckets`: measured at start-up,
                so only where padding beats the plain matmul); the padded rows
                cost little next to reading the weights once. Each size costs
                a copy of the weights in memory.

A row's result does not depend on the layout beyond float rounding (the same
kind of difference as between BLAS kernels for different row counts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from engines.llama import LlamaWeights

MATMULS = ("qkv", "o", "gate_up", "down")


class RowPacked:
    """A dense weight [out, in] and MKL-packed copies of it, one per row count in `buckets`."""

    def __init__(self, dense: torch.Tensor, buckets: tuple[tuple[int, int], ...],
                 known: dict[int, torch.Tensor] | None = None):
        self.dense = dense
        self.buckets = buckets  # (least rows, packed rows): forwards of least..packed rows pad to packed
        known = known or {}  # copies already packed, by rows: not packed again
        self.packed = {n: known[n] if n in known else torch.ops.mkl._mkl_reorder_linear_weight(dense, n)
                       for _, n in buckets}

    def __call__(self, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        m = x.shape[0]
        n = packed_rows(m, self.buckets)
        if n is None:
            return F.linear(x, self.dense, b)
        xp = x.contiguous() if m == n else torch.cat([x, x.new_zeros(n - m, x.shape[1])])  # [n, in]
        return torch.ops.mkl._mkl_linear(xp, self.packed[n], self.dense, b, n)[:m]


class Bf16:
    """A float32 weight [out, in] whose matmuls run in bfloat16 (the float32 one
    kept: what dense() and to_dense() give back)."""

    def __init__(self, dense: torch.Tensor):
        self.dense = dense
        self.half = dense.to(torch.bfloat16)

    def __call__(self, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        y = F.linear(x.to(torch.bfloat16), self.half).to(x.dtype)
        return y if b is None else y + b


def packed_rows(m: int, buckets: tuple[tuple[int, int], ...]) -> int | None:
    """The packed size a forward of m rows pads to (None: the plain matmul)."""
    for least, n in buckets:
        if least <= m <= n:
            return n
    return None


def can_pack_rows(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 and torch._C.has_mkl and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


def linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] @ w [out, in]^T (+ b), whatever w's layout."""
    if isinstance(w, (RowPacked, Bf16)):
        return w(x, b)
    if w.is_mkldnn:
        return torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), w, b).to_dense()
    return F.linear(x, w, b)


def dense(w) -> torch.Tensor:
    """The plain tensor of a weight in any layout."""
    if isinstance(w, (RowPacked, Bf16)):
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
        for name in (*MATMULS, "qkv_bias"):
            t = getattr(lw, name)
            if t is not None:
                setattr(lw, name, t.to_mkldnn())
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


def pack_rows(weights: LlamaWeights, buckets: tuple[tuple[int, int], ...]) -> None:
    """Dense weights with MKL-packed copies for these buckets (none: plain dense);
    a copy already packed for a size is kept, not packed again."""
    known = {id(w.dense): w.packed for w in _row_packed(weights)}
    to_dense(weights)
    if not buckets:
        return
    for lw in weights.layers:
        for name in MATMULS:
            t = getattr(lw, name)
            setattr(lw, name, RowPacked(t, buckets, known.get(id(t))))
    weights.lm_head = RowPacked(weights.lm_head, buckets, known.get(id(weights.lm_head)))


def route_rows(weights: LlamaWeights, buckets: tuple[tuple[int, int], ...]) -> None:
    """Which forwards row-packed weights pad to which of their packed sizes, without
    packing anything (() : every forward dense): what the start-up profile times."""
    for w in _row_packed(weights):
        w.buckets = buckets


def _row_packed(weights: LlamaWeights) -> list[RowPacked]:
    return [w for w in [*(getattr(lw, n) for lw in weights.layers for n in MATMULS), weights.lm_head]
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
