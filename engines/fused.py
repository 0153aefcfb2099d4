"""A decoder layer's small ops: in torch, or one kernel call each.

Between its matmuls a layer runs two RMS norms with their residual adds, RoPE over
its queries and keys, and SiLU(gate)·up. In torch that is some thirty ops a layer,
each a few microseconds of dispatch over a few hundred floats for a decode row: on
2 cores, 30 layers of them were ~3.5 ms of a ~15 ms lone step, and an EAGLE head's
drafted token pays the same per layer. `FusedOps` runs each as one call to
engines/kernels/fused.c, built into the panels' library; `TorchOps` is the same
arithmetic in torch, for GPUs, other dtypes, and where the kernel did not build.

Both compute every row alone in one order, so a token's result is the same bits
whatever else its forward holds (what keeps greedy outputs token-identical across
arms); the two differ from each other in the last bits (the kernel's sums and
exponential are its own), so a model runs one of them for all its forwards.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch
import torch.nn.functional as F

from engines.panels import Kernel, kernel

log = logging.getLogger(__name__)
_F, _L, _E, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_int


class TorchOps:
    """The layer's small ops as torch ops."""

    @staticmethod
    def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, eps)

    @staticmethod
    def add_rms_norm(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + y, rms_norm(x + y) · w)"""
        s = x + y
        return s, F.rms_norm(s, (s.shape[-1],), w, eps)

    @staticmethod
    def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, head_dim: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [N, (H + 2 Hk) D], cos and sin [N, D] -> q [N, H, D] and k [N, Hk, D]
        rotated, v [N, Hk, D]."""
        N, H, Hk, D = qkv.shape[0], heads, kv_heads, head_dim
        q, k, v = qkv.split([H * D, Hk * D, Hk * D], dim=-1)
        return apply_rope(q.view(N, H, D), cos, sin), apply_rope(k.view(N, Hk, D), cos, sin), v.view(N, Hk, D)

    @staticmethod
    def silu_mul(gu: torch.Tensor) -> torch.Tensor:
        """gu [N, 2 I] (gate, up) -> silu(gate) · up [N, I]"""
        gate, up = gu.chunk(2, dim=-1)
        return F.silu(gate) * up


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (Hugging Face's convention). x: [T, heads, D]; cos/sin: [T, D]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class FusedOps:
    """The same ops, one call each to the kernel (float32 on CPU), rows from 16 up shared
    by as many threads as torch runs (the start-up profile chooses them)."""

    def __init__(self, k: Kernel):
        lib = self.lib = k.lib
        lib.fused_rms_norm.argtypes = [_F, _L, _F, _F, _L, _L, _E, _I]
        lib.fused_add_rms_norm.argtypes = [_F, _F, _L, _F, _F, _F, _L, _L, _E, _I]
        lib.fused_rope.argtypes = [_F, _L, _L, _F, _F, _L, _L, _I]
        lib.fused_silu_mul.argtypes = [_F, _F, _L, _L, _I]
        for f in (lib.fused_rms_norm, lib.fused_add_rms_norm, lib.fused_rope, lib.fused_silu_mul):
            f.restype = None

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        x = _rows(x)
        N, E = x.shape
        h = torch.empty(N, E)
        self.lib.fused_rms_norm(x.data_ptr(), x.stride(0), w.data_ptr(), h.data_ptr(), N, E, eps,
                                torch.get_num_threads())
        return h

    def add_rms_norm(self, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = x.contiguous(), _rows(y)
        N, E = x.shape
        s, h = torch.empty(N, E), torch.empty(N, E)
        self.lib.fused_add_rms_norm(x.data_ptr(), y.data_ptr(), y.stride(0), w.data_ptr(), s.data_ptr(),
                                    h.data_ptr(), N, E, eps, torch.get_num_threads())
        return s, h

    def rope_qkv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                 head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As TorchOps.rope_qkv; rotates qkv's queries and keys in place (the matmul's
        fresh output) and returns views of it."""
        qkv = qkv.contiguous()  # a matmul routed as W @ xᵀ by MKL gives its rows as a transposed view
        N, H, Hk, D = qkv.shape[0], heads, kv_heads, head_dim
        cos, sin = cos.contiguous(), sin.contiguous()
        self.lib.fused_rope(qkv.data_ptr(), qkv.stride(0), H + Hk, cos.data_ptr(), sin.data_ptr(), N, D,
                            torch.get_num_threads())
        q, k, v = qkv.split([H * D, Hk * D, Hk * D], dim=-1)
        return q.view(N, H, D), k.view(N, Hk, D), v.view(N, Hk, D)

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        gu = gu.contiguous()
        N, I2 = gu.shape
        out = torch.empty(N, I2 // 2)
        self.lib.fused_silu_mul(gu.data_ptr(), out.data_ptr(), N, I2 // 2, torch.get_num_threads())
        return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [N, E] with its rows' floats adjacent (rows may lie apart)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def fits(ops: FusedOps | None, x: torch.Tensor) -> bool:
    """Whether `ops` can take this forward's states: float32 on CPU, one row a token."""
    return ops is not None and x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2


@functools.cache
def fused_ops() -> FusedOps | None:
    """The kernel's ops, once a process, where it built and agrees with torch (logged
    either way); None: torch's."""
    k = kernel()
    problem = "the kernel did not build" if k is None else check(FusedOps(k))
    if problem:
        log.warning("fused ops: %s; the layers' small ops stay in torch", problem)
        return None
    log.info("fused ops: a layer's norms, RoPE and SiLU one kernel call each")
    return FusedOps(k)


def check(ops: FusedOps) -> str | None:
    """What is wrong with the kernel's ops (None: nothing): each against torch's on rows
    of odd sizes, and a row's result the same bits alone as beside others."""
    g = torch.Generator().manual_seed(0)
    N, E, H, Hk, D, eps = 17, 3 * 16 + 5, 3, 1, 16, 1e-5  # 17 rows: the threads share them
    x, y = torch.randn(N, E, generator=g), torch.randn(N, E, generator=g)
    w = torch.randn(E, generator=g)
    gu = 6 * torch.randn(N, 2 * 37, generator=g)
    qkv = torch.randn(N, (H + 2 * Hk) * D, generator=g)
    cos, sin = torch.randn(N, D, generator=g), torch.randn(N, D, generator=g)
    ref = TorchOps
    pairs = [
        ("rms_norm", ops.rms_norm(x, w, eps), ref.rms_norm(x, w, eps)),
        ("rms_norm of a strided view", ops.rms_norm(x.t().contiguous().t(), w, eps), ref.rms_norm(x, w, eps)),
        ("add_rms_norm", torch.cat(ops.add_rms_norm(x, y, w, eps)), torch.cat(ref.add_rms_norm(x, y, w, eps))),
        ("silu_mul", ops.silu_mul(gu), ref.silu_mul(gu)),
        ("rope_qkv", torch.cat([t.reshape(N, -1) for t in ops.rope_qkv(qkv.clone(), cos, sin, H, Hk, D)], 1),
         torch.cat([t.reshape(N, -1) for t in ref.rope_qkv(qkv, cos, sin, H, Hk, D)], 1)),
    ]
    for name, got, want in pairs:
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            return f"{name} differs from torch's"
    alone = [ops.rms_norm(x[-1:], w, eps), ops.add_rms_norm(x[-1:], y[-1:], w, eps)[1], ops.silu_mul(gu[-1:]),
             ops.rope_qkv(qkv[-1:].clone(), cos[-1:], sin[-1:], H, Hk, D)[0]]
    beside = [ops.rms_norm(x, w, eps)[-1:], ops.add_rms_norm(x, y, w, eps)[1][-1:], ops.silu_mul(gu)[-1:],
              ops.rope_qkv(qkv.clone(), cos, sin, H, Hk, D)[0][-1:]]
    if not all(torch.equal(a, b) for a, b in zip(alone, beside)):
        return "a row's result depends on the rows beside it"
    return None
