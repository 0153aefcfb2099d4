"""Attention on CPU: every row of a step over its own cache.

Two ways, the same arithmetic:
    attend          one row's causal attention as three torch ops (two bmm and a
                    softmax); what runs where the kernel does not
    RaggedAttention the step's rows in one call a layer to the kernel built
                    beside the panels (engines/kernels/attention.c): a decode
                    row's attention at SmolLM2's size is a few microseconds of
                    arithmetic under a dozen torch dispatches, so the rows'
                    dispatches, not their arithmetic, were its cost

LlamaModel.forward_many uses the kernel where the model holds one
(`attention_kernel`, set at start-up where it built and agreed with `attend`:
float32, a head size the vectors divide).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from engines.panels import Kernel, kernel

log = logging.getLogger(__name__)
MAX_VECTORS = 32  # a head's vectors the kernel holds at most (attention.c: MAXC)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, T: int) -> torch.Tensor:
    """Causal attention of the last T positions over a cache, as three plain ops.

    q [Hk, G·T, D] (query t of group g at row g·T + t), k and v [Hk, S, D] with
    the T new positions last -> [Hk, G·T, D]. On CPU this was faster than
    F.scaled_dot_product_attention at every decode, verification and
    prefill-chunk shape measured, 1.6-2.4x for one token (SmolLM2's 3x3 heads:
    27 against 65 us per row and layer over 300 positions) down to 1.04x for a
    128-token chunk over 500, because SDPA's dispatch costs more than the
    attention; and only the T x T corner needs a mask."""
    s = torch.bmm(q, k.transpose(1, 2)).mul_(q.shape[-1] ** -0.5)  # [Hk, G T, S]
    if T > 1:
        Hk, S = k.shape[0], k.shape[1]
        s.view(Hk, -1, T, S)[..., S - T:].add_(_future(T, s.dtype, s.device))
    half = s.dtype in (torch.float16, torch.bfloat16)
    p = s.float().softmax(-1).to(v.dtype) if half else s.softmax(-1)  # half precision: softmax in float32
    return torch.bmm(p, v)


def by_kv_head(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A row's queries [T, H, D] as `attend` takes them: [Hk, G·T, D], query head h
    under kv head h // G (GQA without copying keys)."""
    T, H, D = q.shape
    return q.view(T, kv_heads, H // kv_heads, D).permute(1, 2, 0, 3).reshape(kv_heads, H // kv_heads * T, D)


def by_token(a: torch.Tensor, T: int) -> torch.Tensor:
    """`attend`'s result [Hk, G·T, D] back as the row's tokens [T, H·D]."""
    Hk, GT, D = a.shape
    return a.view(Hk, GT // T, T, D).permute(2, 0, 1, 3).reshape(T, GT // T * Hk * D)


@functools.lru_cache(maxsize=256)
def _future(T: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[T, T]: -inf where query t would see a later position t' > t, else 0. Made once
    per T: building a boolean mask every layer and filling through it cost a verifying
    row ~10% more attention than adding this."""
    return torch.zeros(T, T, dtype=dtype, device=device).masked_fill_(
        torch.ones(T, T, dtype=torch.bool, device=device).triu(1), float("-inf"))


@functools.cache
def attention_kernel() -> Kernel | None:
    """The kernel, once a process, where it built and its attention agrees with
    `attend` (logged either way); None: torch attends."""
    k = kernel()
    problem = "the kernel did not build" if k is None else check(k)
    if problem:
        log.warning("attention kernel: %s; attention stays in torch", problem)
        return None
    log.info("attention kernel: the step's rows in one call a layer (%d lanes)", k.attention_lanes)
    return k


def fits(k: Kernel | None, cache_k: torch.Tensor, head_dim: int) -> bool:
    """Whether the kernel can attend over caches like this one ([L, B, Hk, S, D])."""
    return (k is not None and cache_k.device.type == "cpu" and cache_k.dtype == torch.float32
            and head_dim % k.attention_lanes == 0 and head_dim <= MAX_VECTORS * k.attention_lanes
            and cache_k.stride(-1) == 1)


class RaggedAttention:
    """One forward's rows for the kernel: per row its tokens, its offset among the
    forward's tokens, its cached positions and its caches' addresses, laid out once
    a forward; then one call a layer. `rows`: (T, start, cache) per row attended
    here, in token order, `offsets` their first token's index among the forward's."""

    def __init__(self, k: Kernel, rows: list[tuple[int, int, object]], offsets: list[int], heads: int,
                 kv_heads: int, head_dim: int):
        n = len(rows)
        self.k, self.n, self.H, self.Hk, self.D = k, n, heads, kv_heads, head_dim
        longs = ctypes.c_long * n
        self.T = longs(*(t for t, _, _ in rows))
        self.off = longs(*offsets)
        self.start = longs(*(s for _, s, _ in rows))
        caches = [c for _, _, c in rows]
        self.kc = (ctypes.c_void_p * n)(*(c.k.data_ptr() for c in caches))  # layer 0, this row
        self.vc = (ctypes.c_void_p * n)(*(c.v.data_ptr() for c in caches))
        self.ls = longs(*(c.k.stride(0) for c in caches))
        self.hs = longs(*(c.k.stride(2) for c in caches))
        self.ps = longs(*(c.k.stride(3) for c in caches))
        self.scale = head_dim ** -0.5
        self.threads = torch.get_num_threads()

    def __call__(self, slot: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        """Store layer `slot`'s new keys and values and attend: q [N, H, D], k and v
        [N, Hk, D], into out [N, H·D] (contiguous). The kernel reads a token's heads
        as one run of memory; a matmul routed as W @ xᵀ by MKL gives its rows as a
        transposed view, so inputs laid out otherwise are copied first."""
        q, k, v = (x if x.stride(-1) == 1 and x.stride(-2) == self.D else x.contiguous() for x in (q, k, v))
        failed = self.k.lib.ragged_attend(self.n, self.T, self.off, self.start, self.kc, self.vc, self.ls, slot,
                                          self.hs, self.ps, q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0),
                                          v.data_ptr(), v.stride(0), out.data_ptr(), self.H, self.Hk, self.D,
                                          self.scale, self.threads)
        if failed:
            raise RuntimeError("attention kernel: " + ("no memory for its scores" if failed == 1 else
                                                       f"a head of {self.D} is more than it holds"))


def check(k: Kernel) -> str | None:
    """What is wrong with the kernel's attention (None: nothing): rows decoding,
    verifying and prefilling beside each other against `attend`, and a token's
    result the same bits alone as beside drafts and other rows."""
    from engines.llama import KVCache

    g = torch.Generator().manual_seed(0)
    H, Hk, D = 6, 2, 4 * k.attention_lanes
    feeds = [(1, 7), (3, 5), (1, 0), (9, 11)]  # (tokens fed, positions cached)
    caches = [KVCache(2, 1, Hk, 32, D, torch.float32, "cpu") for _ in feeds]
    for c in caches:
        c.k.copy_(torch.randn(c.k.shape, generator=g))
        c.v.copy_(torch.randn(c.v.shape, generator=g))
    N = sum(t for t, _ in feeds)
    q, kn, vn = (torch.randn(N, n, D, generator=g) for n in (H, Hk, Hk))
    out = torch.empty(N, H * D)
    offsets = [sum(t for t, _ in feeds[:i]) for i in range(len(feeds))]
    RaggedAttention(k, [(t, s, c) for (t, s), c in zip(feeds, caches)], offsets, H, Hk, D)(1, q, kn, vn, out)
    for (t, s), c, o in zip(feeds, caches, offsets):
        kc, vc = c.k[1, 0], c.v[1, 0]  # [Hk, S, D]
        if not (torch.equal(kc[:, s:s + t], kn[o:o + t].transpose(0, 1))
                and torch.equal(vc[:, s:s + t], vn[o:o + t].transpose(0, 1))):
            return "the new keys and values are not where the cache keeps them"
        want = by_token(attend(by_kv_head(q[o:o + t], Hk), kc[:, :s + t], vc[:, :s + t], t), t)
        if not torch.allclose(out[o:o + t], want, rtol=1e-4, atol=1e-5):
            return f"a row feeding {t} tokens after {s} differs from torch's attention"
    # the last row's last token again, alone: the same bits
    t, s = feeds[-1]
    alone = torch.empty(1, H * D)
    RaggedAttention(k, [(1, s + t - 1, caches[-1])], [0], H, Hk, D)(
        1, q[N - 1:], kn[N - 1:], vn[N - 1:], alone)
    if not torch.equal(alone, out[N - 1:]):
        return "a token's attention depends on what else the step holds"
    return None
