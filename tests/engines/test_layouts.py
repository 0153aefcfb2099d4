"""CPU weight layouts: every layout computes what dense weights do, for every
row count (bfloat16 matmuls: what the bfloat16 product is), and laying out and
back leaves the weights as they were."""

import pytest
import torch
import torch.nn.functional as F

from engines.layouts import (
    LAYOUTS,
    Bf16,
    Columns,
    RowPacked,
    can_pack_rows,
    dense,
    linear,
    pack_for_cpu,
    pack_rows,
    packs_agree,
    route_columns,
    route_rows,
    routed,
    to_bf16,
    to_dense,
    unrouted,
)
from engines.profile import (
    HEAD_TRIALS,
    LAYER_TRIALS,
    choose_head,
    choose_layer_route,
    choose_layout,
    layouts_to_try,
    upto_where_faster,
)
from tests.helpers import lean_from_hf, tiny_hf_model

needs_mkl = pytest.mark.skipif(not can_pack_rows(torch.float32), reason="no MKL packed GEMM in this torch build")
LEAST = 4  # forwards of at least this many rows run the packed copy


@needs_mkl
def test_a_row_packed_weight_computes_the_dense_matmul_for_any_number_of_rows():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(48, 24, generator=g), torch.randn(48, generator=g)
    packed = RowPacked(w, LEAST)
    for m in (*range(1, 21), 127, 128, 129, 300):  # dense below LEAST; one copy, packed once, for any rows above
        x = torch.randn(m, 24, generator=g)
        out = linear(x, packed, b)
        assert out.shape == (m, 48)
        torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    x = torch.randn(12, 48, generator=g)[:, ::2]  # a strided input, as a slice of a wider activation
    torch.testing.assert_close(linear(x, packed), F.linear(x, w), rtol=1e-5, atol=1e-5)


@needs_mkl
def test_a_row_s_result_on_the_packed_copy_depends_on_the_rows_beside_it_only_by_rounding():
    # One packed copy serves every forward of LEAST rows or more, so a row verified among
    # 9 must come out as it would among 40: on the Intel Xeon bit for bit; on an AMD EPYC
    # (family 25) MKL rounds a 9-row call differently by an ulp, as its dense sgemm does at
    # 1, 2 and 9 rows, so the bound is float rounding, which greedy ties aside changes nothing
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=g)
    packed = RowPacked(w, LEAST)
    x = torch.randn(40, 64, generator=g)
    whole = linear(x, packed)
    for m in (LEAST, 9, 17, 33):
        torch.testing.assert_close(linear(x[:m], packed), whole[:m], rtol=1e-6, atol=4e-6)  # values up to ~30


@needs_mkl
def test_packs_agree_catches_a_packed_copy_that_computes_something_else():
    w = lean_from_hf(tiny_hf_model(vocab=64, hidden=32), torch.float32).weights
    pack_rows(w, LEAST)
    assert packs_agree(w)
    other = RowPacked(torch.randn_like(w.layers[1].o.dense), LEAST)
    w.layers[1].o.packed = other.packed  # a copy packed from different values
    assert not packs_agree(w)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")
def test_a_onednn_weight_takes_dense_activations_and_a_dense_bias():
    """linear() hands oneDNN dense activations and a dense bias: the same bits as
    converting them to its format and back, and the dense product up to rounding."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(48, 24, generator=g), torch.randn(48, generator=g)
    packed = w.to_mkldnn()
    for m in (1, 2, 9, 40):
        x = torch.randn(m, 24, generator=g)
        for bias in (None, b):
            out = linear(x, packed, bias)
            assert not out.is_mkldnn and out.shape == (m, 48)
            converted = torch._C._nn.mkldnn_linear(x.to_mkldnn(), packed, None if bias is None else bias.to_mkldnn())
            assert torch.equal(out, converted.to_dense())
            torch.testing.assert_close(out, F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    strided = torch.randn(6, 48, generator=g)[:, ::2]  # a slice of a wider activation
    assert torch.equal(linear(strided, packed, b), linear(strided.contiguous(), packed, b))


def test_a_bf16_weight_computes_the_bfloat16_product_in_float32_activations():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(48, 24, generator=g), torch.randn(48, generator=g)
    half = Bf16(w)
    assert half.dense is w and half.half.dtype == torch.bfloat16
    for m in (1, 3, 4, 9, 17):
        x = torch.randn(m, 24, generator=g)
        out = linear(x, half, b)
        assert out.dtype == torch.float32 and out.shape == (m, 48)
        assert torch.equal(out, F.linear(x.bfloat16(), w.bfloat16()).float() + b)  # the bias added in float32
        # no further from float32 than rounding both factors to 8 bits of mantissa can take it (and the result)
        bound = 3 * 2.0**-8 * (x.abs() @ w.abs().T)
        assert ((out - F.linear(x, w, b)).abs() <= bound + 1e-6).all()


@needs_mkl
@pytest.mark.parametrize("layout", ["rows", "onednn", "bf16"])
def test_a_ragged_forward_matches_dense_weights_in_every_layout(layout):
    if layout == "onednn" and not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN")
    hf = tiny_hf_model(vocab=64, hidden=32)
    ref, packed = lean_from_hf(hf, torch.float32), lean_from_hf(hf, torch.float32)
    {"rows": lambda w: pack_rows(w, LEAST), "onednn": pack_for_cpu, "bf16": to_bf16}[layout](packed.weights)
    tol = 5e-2 if layout == "bf16" else 1e-4  # bfloat16 rounds inputs to 8 bits of mantissa
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 64, (n,), generator=g) for n in (5, 9, 3, 7)]
    caches = {m: [m.new_cache(40) for _ in prompts] for m in (ref, packed)}
    for m in (ref, packed):
        m.forward_many([(p, c, False) for p, c in zip(prompts, caches[m])])
    # a decode row, two verifying rows and a prefill chunk (12 tokens), then 7 tokens twice (row
    # packs: on the packed copies); the head sees the same row counts, every position wanting logits
    for feeds in ([1, 5, 4, 2], [1, 1, 2, 3], [4, 1, 1, 1]):
        ids = [torch.randint(0, 64, (n,), generator=g) for n in feeds]
        outs = {m: m.forward_many([(i, c, True) for i, c in zip(ids, caches[m])]) for m in (ref, packed)}
        for a, b in zip(outs[ref], outs[packed]):
            torch.testing.assert_close(b, a, rtol=tol, atol=tol)


@needs_mkl
def test_laying_out_and_back_restores_the_dense_weights_and_a_tied_head():
    hf = tiny_hf_model(vocab=64, hidden=32)
    lean = lean_from_hf(hf, torch.float32)
    w = lean.weights
    w.lm_head = w.embed  # tied
    before = [t.clone() for t in (w.layers[0].qkv, w.layers[-1].down)]
    pack_rows(w, LEAST)
    assert isinstance(w.layers[0].qkv, RowPacked) and isinstance(w.lm_head, RowPacked)
    pack_for_cpu(w)  # from one layout straight to another
    assert w.layers[0].qkv.is_mkldnn
    to_bf16(w)
    assert isinstance(w.layers[0].qkv, Bf16) and isinstance(w.lm_head, Bf16) and w.lm_head.dense is w.embed
    to_dense(w)
    assert w.lm_head is w.embed
    assert torch.equal(dense(w.layers[0].qkv), before[0]) and torch.equal(w.layers[-1].down, before[1])
    pack_rows(w, None)  # no copies: plain dense
    assert not isinstance(w.layers[0].qkv, RowPacked) and w.lm_head is w.embed


@needs_mkl
def test_repacking_keeps_the_copies_already_packed_and_routing_packs_nothing():
    lean = lean_from_hf(tiny_hf_model(vocab=64, hidden=32), torch.float32)
    w = lean.weights
    pack_rows(w, 1)
    copy, head_copy = w.layers[0].qkv.packed, w.lm_head.packed
    pack_rows(w, LEAST)  # from another row count: the copies are the same tensors
    assert w.layers[0].qkv.packed is copy and w.lm_head.packed is head_copy and w.layers[0].qkv.least == LEAST
    x = torch.randn(6, 32)
    packed_out = linear(x, w.layers[0].qkv)
    route_rows(w, None)  # every forward dense, the copies left as they are
    assert w.layers[0].qkv.least is None and w.layers[0].qkv.packed is copy
    torch.testing.assert_close(linear(x, w.layers[0].qkv), F.linear(x, w.layers[0].qkv.dense))
    torch.testing.assert_close(packed_out, F.linear(x, w.layers[0].qkv.dense), rtol=1e-5, atol=1e-5)


def test_the_config_decides_which_layouts_the_profile_times():
    assert layouts_to_try("auto", "auto") == ["dense", "packed", "bf16"]
    assert layouts_to_try("auto", False) == ["dense", "packed"]
    assert layouts_to_try(False, "auto") == ["dense", "bf16"]
    assert layouts_to_try(True, "auto") == ["packed"] and layouts_to_try("auto", True) == ["bf16"]
    assert layouts_to_try(False, False) == ["dense"]


def test_the_profile_leaves_the_layout_it_chose_in_place_for_every_weight_set():
    hf = tiny_hf_model(vocab=64, hidden=32)
    target, other = lean_from_hf(hf, torch.float32), lean_from_hf(hf, torch.float32)
    threads = torch.get_num_threads()
    try:
        prof = choose_layout(target, [target.weights, other.weights], False, 1, bf16=True)
        assert prof.layout == "bf16" and prof.threads == 1 and set(prof.step_s) == {"1t/bf16"}
        assert all(isinstance(unrouted(w.layers[0].gate_up), Bf16) for w in (target.weights, other.weights))
        assert prof.cost.a > 0 and sorted(prof.cost.lone) == list(range(1, 10))
        prof = choose_layout(target, [target.weights, other.weights], False, 1, bf16=False)
        assert prof.layout == "dense" and not isinstance(unrouted(other.weights.layers[0].gate_up), Bf16)
        assert not routed(other.weights)  # the routes are the target's alone
        prof = choose_layout(target, [target.weights], False, 1, routes=False)  # target.matmul_routes: false
        assert prof.layers_upto == prof.head_upto == 0 and not routed(target.weights)
        assert not isinstance(target.weights.lm_head, Columns) and prof.cost.columns_upto == 0
        assert set(LAYOUTS) >= {prof.layout}
    finally:
        torch.set_num_threads(threads)


@needs_mkl
@pytest.mark.parametrize("layout", ["dense", "rows", "onednn"])
@pytest.mark.parametrize("tied", [True, False])
def test_weights_routed_as_w_x_transposed_compute_the_layouts_results_and_lay_out_again_as_they_were(layout, tied):
    if layout == "onednn" and not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN")
    hf = tiny_hf_model(vocab=64, hidden=32)
    ref, lean = lean_from_hf(hf, torch.float32), lean_from_hf(hf, torch.float32)
    w = lean.weights
    if tied:
        w.lm_head = ref.weights.lm_head = w.embed
    want = {"qkv": dense(w.layers[0].qkv).clone(), "head": dense(w.lm_head).clone()}
    {"dense": to_dense, "rows": lambda w: pack_rows(w, LEAST), "onednn": pack_for_cpu}[layout](w)
    laid = (w.layers[0].qkv, w.lm_head)
    route_columns(w, 2, 3)
    qkv, head = w.layers[0].qkv, w.lm_head
    assert isinstance(qkv, Columns) and isinstance(head, Columns) and (qkv.w, head.w) == laid
    assert (head.dense is w.embed) == tied and (qkv.dense is laid[0]) == (layout == "dense")  # copies only if needed
    assert len(routed(w)) == 4 * len(w.layers) and qkv.upto == 2 and head.upto == 3
    for m in range(1, 7):  # a lone row (fed as two), a few rows as W @ xᵀ, then the layout's own kernels
        for got, weight, n_in in ((qkv, want["qkv"], 32), (head, want["head"], 32)):
            x = torch.randn(m, n_in)
            out = linear(x, got)
            assert out.shape == (m, weight.shape[0])
            torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)
    # whole forwards, every row count from a decode step to past the route, as the reference computes them
    g = torch.Generator().manual_seed(2)
    for n in (1, 2, 3, 5):
        ids = torch.randint(0, 64, (n,), generator=g)
        torch.testing.assert_close(lean.forward(ids, lean.new_cache(8)), ref.forward(ids, ref.new_cache(8)),
                                   rtol=1e-4, atol=1e-4)
    route_columns(w, 0, 0)  # unrouted: the layout's weights again, the copies dropped
    assert (w.layers[0].qkv, w.lm_head) == laid and not routed(w)
    route_columns(w, 5, 5)
    to_dense(w)  # laying out again drops the routes (and ties the head again)
    assert not isinstance(w.lm_head, Columns) and (w.lm_head is w.embed) == tied and not routed(w)
    assert torch.equal(dense(w.lm_head), want["head"]) and torch.equal(w.layers[0].qkv, want["qkv"])


def test_the_profile_routes_each_part_up_to_the_rows_where_w_x_transposed_stops_winning():
    # W @ xᵀ faster for 1-5 rows, slower at 6, faster again at 12: routed up to 5
    assert upto_where_faster({1: (3.7, 2.9), 2: (4.8, 2.8), 5: (5.7, 5.0), 6: (6.0, 6.2), 12: (7.6, 7.0)}) == 5
    assert upto_where_faster({1: (3.7, 2.9), 2: (4.8, 2.8), 3: (5.0, 4.9)}) == 2  # 2% faster at 3: within noise
    assert upto_where_faster({1: (3.7, 9.2), 2: (4.8, 2.8)}) == 0  # losing at one row: never
    assert upto_where_faster({m: (2.0, 1.0) for m in HEAD_TRIALS}) == HEAD_TRIALS[-1]
    lean = lean_from_hf(tiny_hf_model(vocab=64, hidden=32), torch.float32)
    layers, layers_s, panels, panels_s = choose_layer_route(lean)  # on this machine: whatever it measured, in place
    head_upto, head_s = choose_head(lean, panels=panels)
    assert set(layers_s) == set(LAYER_TRIALS) and layers == upto_where_faster(layers_s)
    # the kernel that took less over every size, and the route runs it
    assert panels == (bool(panels_s) and sum(p for _, p in panels_s.values()) < sum(m for m, _ in panels_s.values()))
    assert all(c.on_panels == panels for c in routed(lean.weights))
    assert set(head_s) == set(HEAD_TRIALS) and head_upto == upto_where_faster(head_s)
    assert all(c.upto == layers for c in routed(lean.weights)) and len(routed(lean.weights)) == (
        4 * len(lean.weights.layers) if layers else 0)
    head = lean.weights.lm_head
    assert (head.upto if isinstance(head, Columns) else 0) == head_upto
    assert not isinstance(head, Columns) or head.on_panels == panels  # the layers' kernel
