"""The attention kernel (engines/attention.py): built here, it attends as torch
does for rows decoding, verifying and prefilling in one step, stores their keys
and values where torch would, gives a token the same bits whatever else the step
holds, and a forward with it matches one without."""

import pytest
import torch

from engines.attention import RaggedAttention, attention_kernel, check, fits
from engines.layouts import can_pack_rows, linear, route_columns
from engines.llama import KVCache
from tests.helpers import lean_from_hf, tiny_hf_model


@pytest.fixture(scope="module")
def k():
    built = attention_kernel()
    assert built is not None, "every machine the tests run on has a C compiler (see the log for the build's error)"
    return built


def test_the_kernel_passes_its_own_check(k):
    assert check(k) is None


def test_a_tokens_attention_is_the_same_bits_decoded_or_verified(k):
    g = torch.Generator().manual_seed(3)
    H, Hk, D = 4, 2, 2 * k.attention_lanes
    cache = KVCache(1, 1, Hk, 64, D, torch.float32, "cpu")
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    q, kn, vn = (torch.randn(5, n, D, generator=g) for n in (H, Hk, Hk))
    verified = torch.empty(5, H * D)
    RaggedAttention(k, [(5, 20, cache)], [0], H, Hk, D)(0, q, kn, vn, verified)  # 5 tokens after 20
    for t in range(5):  # each token decoded alone, in order, at its own position
        alone = torch.empty(1, H * D)
        RaggedAttention(k, [(1, 20 + t, cache)], [0], H, Hk, D)(0, q[t:t + 1], kn[t:t + 1], vn[t:t + 1], alone)
        assert torch.equal(alone, verified[t:t + 1]), t


def test_fits_only_float32_caches_the_vectors_divide(k):
    lanes = k.attention_lanes
    assert fits(k, torch.zeros(1, 1, 2, 8, lanes), lanes)
    assert not fits(k, torch.zeros(1, 1, 2, 8, lanes, dtype=torch.float64), lanes)
    assert not fits(k, torch.zeros(1, 1, 2, 8, lanes + 1), lanes + 1)
    assert not fits(None, torch.zeros(1, 1, 2, 8, lanes), lanes)


def two_steps(model) -> tuple:
    """Rows prefilling (one from scratch past the fused kernel's size, which SDPA keeps),
    then a step where a row decodes, one verifies 4 tokens and one feeds a chunk after
    its prompt: both steps' logits and states, and the caches after them."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, model.cfg.vocab_size, (n,), generator=g) for n in (7, 20, 3)]
    nxt = [torch.randint(2, model.cfg.vocab_size, (n,), generator=g) for n in (1, 4, 9)]
    caches = [model.new_cache(64) for _ in prompts]
    first = model.forward_many([(p, c, True) for p, c in zip(prompts, caches)], hidden=True)
    second = model.forward_many([(x, c, True) for x, c in zip(nxt, caches)], hidden=True)
    return first, second, [(c.k.clone(), c.v.clone(), c.lengths[0]) for c in caches]


def assert_same_steps(got, want) -> None:
    for step in (0, 1):
        (lt, st), (lk, sk) = want[step], got[step]
        for a, b in zip(lt + st, lk + sk):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    for (kt, vt, nt), (kk, vk, nk) in zip(want[2], got[2]):
        assert nt == nk
        torch.testing.assert_close(kk[..., :nt, :], kt[..., :nt, :], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(vk[..., :nt, :], vt[..., :nt, :], rtol=1e-4, atol=1e-4)


def kernel_sized_model(k):
    hf = tiny_hf_model(hidden=4 * 2 * k.attention_lanes, heads=4, kv_heads=2, layers=3, dtype=torch.float32)
    return lean_from_hf(hf, torch.float32)


def test_a_forward_with_the_kernel_matches_one_without(k):
    model = kernel_sized_model(k)
    model.attention_kernel = None
    want = two_steps(model)
    model.attention_kernel = k
    assert_same_steps(two_steps(model), want)


@pytest.mark.skipif(not can_pack_rows(torch.float32), reason="no MKL GEMM in this torch build")
def test_the_kernel_reads_the_transposed_rows_of_matmuls_routed_by_mkl(k):
    """A matmul routed as W @ xᵀ by MKL (engines/layouts.py: Columns) gives its rows
    as a transposed view, so q, k and v reach the kernel with a token's heads strided:
    the forward still matches torch's attention over the weights as laid out."""
    model = kernel_sized_model(k)
    model.attention_kernel = None
    want = two_steps(model)
    route_columns(model.weights, 16, 16, panels=False)
    model.attention_kernel = k
    qkv = linear(torch.randn(3, model.cfg.hidden_size), model.weights.layers[0].qkv)
    assert qkv.stride(-1) != 1  # the layout the kernel must not misread
    assert_same_steps(two_steps(model), want)
