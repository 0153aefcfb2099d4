"""CPU weight layouts: every layout computes what dense weights do, for every
row count, and laying out and back leaves the weights as they were."""

import pytest
import torch
import torch.nn.functional as F

from engines.layouts import RowPacked, can_pack_rows, dense, linear, pack_for_cpu, pack_rows, route_rows, to_dense
from tests.helpers import lean_from_hf, tiny_hf_model

needs_mkl = pytest.mark.skipif(not can_pack_rows(torch.float32), reason="no MKL packed GEMM in this torch build")
BUCKETS = ((4, 9), (10, 16))


@needs_mkl
def test_a_row_packed_weight_computes_the_dense_matmul_for_any_number_of_rows():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(48, 24, generator=g), torch.randn(48, generator=g)
    packed = RowPacked(w, BUCKETS)
    for m in range(1, 21):  # below, inside and above the buckets, padded or not
        x = torch.randn(m, 24, generator=g)
        out = linear(x, packed, b)
        assert out.shape == (m, 48)
        torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    x = torch.randn(12, 48, generator=g)[:, ::2]  # a strided input, as a slice of a wider activation
    torch.testing.assert_close(linear(x, packed), F.linear(x, w), rtol=1e-5, atol=1e-5)


@needs_mkl
@pytest.mark.parametrize("layout", ["rows", "onednn"])
def test_a_ragged_forward_matches_dense_weights_in_every_layout(layout):
    if layout == "onednn" and not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN")
    hf = tiny_hf_model(vocab=64, hidden=32)
    ref, packed = lean_from_hf(hf, torch.float32), lean_from_hf(hf, torch.float32)
    pack_rows(packed.weights, BUCKETS) if layout == "rows" else pack_for_cpu(packed.weights)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 64, (n,), generator=g) for n in (5, 9, 3, 7)]
    caches = {m: [m.new_cache(40) for _ in prompts] for m in (ref, packed)}
    for m in (ref, packed):
        m.forward_many([(p, c, False) for p, c in zip(prompts, caches[m])])
    # a decode row, two verifying rows and a prefill chunk (12 tokens: padded to 16), then 7 tokens
    # (padded to 9); the head sees the same row counts, every position wanting logits
    for feeds in ([1, 5, 4, 2], [1, 1, 2, 3], [4, 1, 1, 1]):
        ids = [torch.randint(0, 64, (n,), generator=g) for n in feeds]
        outs = {m: m.forward_many([(i, c, True) for i, c in zip(ids, caches[m])]) for m in (ref, packed)}
        for a, b in zip(outs[ref], outs[packed]):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


@needs_mkl
def test_laying_out_and_back_restores_the_dense_weights_and_a_tied_head():
    hf = tiny_hf_model(vocab=64, hidden=32)
    lean = lean_from_hf(hf, torch.float32)
    w = lean.weights
    w.lm_head = w.embed  # tied
    before = [t.clone() for t in (w.layers[0].qkv, w.layers[-1].down)]
    pack_rows(w, BUCKETS)
    assert isinstance(w.layers[0].qkv, RowPacked) and isinstance(w.lm_head, RowPacked)
    pack_for_cpu(w)  # from one layout straight to another
    assert w.layers[0].qkv.is_mkldnn
    to_dense(w)
    assert w.lm_head is w.embed
    assert torch.equal(dense(w.layers[0].qkv), before[0]) and torch.equal(w.layers[-1].down, before[1])
    pack_rows(w, ())  # no buckets: plain dense
    assert not isinstance(w.layers[0].qkv, RowPacked) and w.lm_head is w.embed


@needs_mkl
def test_repacking_keeps_the_copies_already_packed_and_routing_packs_nothing():
    lean = lean_from_hf(tiny_hf_model(vocab=64, hidden=32), torch.float32)
    w = lean.weights
    pack_rows(w, BUCKETS)
    nine, head_nine = w.layers[0].qkv.packed[9], w.lm_head.packed[9]
    pack_rows(w, ((4, 9),))  # a size dropped, one kept: the kept copy is the same tensor
    assert w.layers[0].qkv.packed[9] is nine and w.lm_head.packed[9] is head_nine
    assert set(w.layers[0].qkv.packed) == {9}
    x = torch.randn(6, 32)
    packed_out = linear(x, w.layers[0].qkv)
    route_rows(w, ())  # every forward dense, the copies left as they are
    assert w.layers[0].qkv.buckets == () and w.layers[0].qkv.packed[9] is nine
    torch.testing.assert_close(linear(x, w.layers[0].qkv), F.linear(x, w.layers[0].qkv.dense))
    torch.testing.assert_close(packed_out, F.linear(x, w.layers[0].qkv.dense), rtol=1e-5, atol=1e-5)
