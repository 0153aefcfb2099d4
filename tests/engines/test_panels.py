"""The panels kernel (engines/panels.py): built here, it computes what float64
products do at every row count, a row's result does not depend on the rows fed
with it, and the routes fall back to MKL where it cannot be built or used."""

import pytest
import torch
import torch.nn.functional as F

from engines import panels
from engines.layouts import (
    Columns,
    dense,
    drop_dense_copies,
    pack_for_cpu,
    pass_rows,
    route_columns,
    route_matmul,
    routed,
)
from tests.helpers import lean_from_hf, tiny_hf_model


@pytest.fixture(scope="module")
def k() -> panels.Kernel:
    built = panels.kernel()
    assert built is not None, "every machine the tests run on has a C compiler (see the log for the build's error)"
    return built


@pytest.mark.parametrize("out, chunks", [(1, 1), (5, 2), (37, 3), (64, 36)])
def test_products_match_float64_at_every_row_count(k, out, chunks):
    g = torch.Generator().manual_seed(out)
    w = torch.randn(out, chunks * k.lanes, generator=g)
    p = panels.Panel(w, k)
    assert torch.equal(p.unpack(), w)
    for m in range(1, 14):  # one pass of rows and several, full and partial
        x = torch.randn(m, w.shape[1], generator=g)
        want = x.double() @ w.double().t()
        got = p(x)
        assert got.shape == (m, out) and got.is_contiguous()
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max())), m


def test_a_rows_result_does_not_depend_on_its_batch(k):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(45, 6 * k.lanes, generator=g)
    p = panels.Panel(w, k)
    x = torch.randn(13, w.shape[1], generator=g)
    whole = p(x)
    for i in range(13):
        assert torch.equal(p(x[i:i + 1]), whole[i:i + 1]), i  # bit for bit, alone or among 12 others
    assert torch.equal(p(x[3:8]), whole[3:8])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # and whatever the threads
    try:
        assert torch.equal(p(x), whole)
    finally:
        torch.set_num_threads(threads)


def test_a_routed_matmul_runs_the_panels_up_to_its_rows_and_adds_the_bias(k):
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(40, 2 * k.lanes, generator=g), torch.randn(40, generator=g)
    c = route_matmul(w, 3, panels=True)
    assert isinstance(c, Columns) and c.on_panels and c.panel is not None
    for m in (1, 3, 4):  # 4 rows: beyond the route, as laid out
        x = torch.randn(m, w.shape[1], generator=g)
        assert torch.allclose(c(x, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert route_matmul(c, 3, panels=False).on_panels is False  # MKL again, the copy kept for the profile
    assert c.panel is not None and route_matmul(c, 0) is w  # unrouted: the weight as laid out, the copies gone


def test_the_dense_copies_the_panels_leave_unread_are_freed_and_come_back_for_mkl(k):
    lean = lean_from_hf(tiny_hf_model(vocab=64, hidden=32), torch.float32)
    want = {"qkv": dense(lean.weights.layers[0].qkv).clone(), "head": dense(lean.weights.lm_head).clone()}
    ids = torch.arange(5)
    before = lean.forward(ids, lean.new_cache(8))
    pack_for_cpu(lean.weights)  # oneDNN's layout: the routes' dense forms are copies
    route_columns(lean.weights, 8, 8, panels=True)
    layers = [*routed(lean.weights), lean.weights.lm_head]  # this tiny model's head is its own, not tied
    assert all(isinstance(c, Columns) and c.copied for c in layers)
    freed = drop_dense_copies(lean.weights)
    assert all(c._dense is None for c in layers) and freed == sum(dense(c).numel() * 4 for c in layers)
    torch.testing.assert_close(lean.forward(ids, lean.new_cache(8)), before)  # the panels run them as before
    qkv = lean.weights.layers[0].qkv
    assert torch.equal(qkv.dense, want["qkv"])  # unpacked on demand
    qkv.run_panels(False)  # MKL's route: its copy back
    assert qkv._dense is not None and torch.equal(qkv._dense, want["qkv"])
    assert torch.allclose(qkv(torch.ones(2, 32), None), torch.ones(2, 32) @ want["qkv"].t(), rtol=1e-5, atol=1e-5)
    dense_model = lean_from_hf(tiny_hf_model(vocab=64, hidden=32), torch.float32)  # dense layout: no copies
    route_columns(dense_model.weights, 8, 8, panels=True)
    assert drop_dense_copies(dense_model.weights) == 0 and not any(c.copied for c in routed(dense_model.weights))


def test_a_pass_takes_the_kernels_own_rows_and_the_step_cost_reads_them_from_the_routes(k):
    # float32 panels take as many input rows a pass as the registers hold accumulators for (4 with
    # AVX-512, 3 with AVX2); a block format as many or, on AVX2, twice as many in halves
    assert k.inputs["float32"] in (3, 4)
    assert all(k.inputs[f] in (k.inputs["float32"], 2 * k.inputs["float32"]) for f in panels.FORMATS)
    g = torch.Generator().manual_seed(4)
    w = panels.exactly("q4", 8, panels.BLOCK, g)
    assert panels.Panel(w, k).inputs == k.inputs["q4"]
    assert panels.Panel(w, k, formats=False).inputs == k.inputs["float32"]
    lean = lean_from_hf(tiny_hf_model(vocab=64, hidden=32), torch.float32)
    assert pass_rows(lean.weights) == 0  # not routed
    route_columns(lean.weights, 8, 8, panels=True)
    assert pass_rows(lean.weights) == k.inputs["float32"]  # random weights: float32 panels
    for c in routed(lean.weights):
        c.run_panels(False)
    assert pass_rows(lean.weights) == 0  # MKL runs the route: no passes of the panels to price


def test_weights_the_kernel_cannot_take_keep_mkl(k):
    w = torch.randn(8, k.lanes + 1)  # columns not a multiple of the lanes
    c = route_matmul(w, 4, panels=True)
    assert isinstance(c, Columns) and c.panel is None and not c.on_panels
    x = torch.randn(2, w.shape[1])
    assert torch.allclose(c(x, None), x @ w.t(), rtol=1e-5, atol=1e-5)


def test_without_a_compiler_the_routes_keep_mkl(monkeypatch):
    monkeypatch.setenv("CC", "/bin/false")  # a compiler that fails
    panels.kernel.cache_clear()
    try:
        assert panels.kernel() is None
        lean = lean_from_hf(tiny_hf_model(vocab=64, hidden=32), torch.float32)
        route_columns(lean.weights, 4, 4, panels=True)
        assert routed(lean.weights) and not any(c.on_panels or c.panel for c in routed(lean.weights))
    finally:
        panels.kernel.cache_clear()  # the next caller builds the real one


def test_a_kernel_whose_own_program_fails_is_not_loaded(monkeypatch, tmp_path):
    # the library would build; its self-test program exits 1, as one killed by an illegal instruction would not 0
    src = tmp_path / "panels.c"
    src.write_text(panels.SOURCE.read_text().replace("int main(void) {", "int main(void) {\n    return 1;", 1))
    monkeypatch.setattr(panels, "SOURCE", src)
    panels.kernel.cache_clear()
    try:
        assert panels.kernel() is None
    finally:
        panels.kernel.cache_clear()


@pytest.mark.parametrize("wrong, says", [
    (lambda y, x: y * (1 + 1e-3), "differ from float64"),
    (lambda y, x: y + 1e-7 * (x.shape[0] > 1), "depends on the rows beside it"),
])
def test_the_start_up_check_refuses_a_kernel_that_computes_otherwise(k, monkeypatch, wrong, says):
    call = panels.Panel.__call__
    monkeypatch.setattr(panels.Panel, "__call__", lambda self, x: wrong(call(self, x), x))
    assert says in (panels.check(k) or "")
    monkeypatch.undo()
    assert panels.check(k) is None


@pytest.mark.parametrize("fmt, bytes_per_weight", [("q4", 0.75), ("q8", 1.125), ("bfloat16", 2.0)])
def test_a_weight_in_a_block_format_streams_in_it_to_the_float32_panels_bits(k, fmt, bytes_per_weight):
    g = torch.Generator().manual_seed(3)
    w = panels.exactly(fmt, 37, 3 * panels.BLOCK, g)  # a partial last panel
    p, f32 = panels.Panel(w, k), panels.Panel(w, k, formats=False)
    assert (p.fmt, f32.fmt) == (fmt, "float32")
    assert p.packed.numel() * p.packed.element_size() == 40 * w.shape[1] * bytes_per_weight  # 10 panels of 4 rows
    assert torch.equal(p.unpack(), w)
    for m in range(1, 14):
        x = torch.randn(m, w.shape[1], generator=g)
        got = p(x)
        assert torch.equal(got, f32(x)), m  # the same values summed in the same order
        want = x.double() @ w.double().t()
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max())), m


def test_weights_through_ggufs_own_quantizers_are_recognised_and_nothing_is_approximated(k):
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    g = torch.Generator().manual_seed(4)
    w = torch.randn(24, 4 * panels.BLOCK, generator=g) * 0.05
    for qtype, fmt in ((Q.Q4_1, "q4"), (Q.Q8_0, "q8")):
        back = torch.from_numpy(dequantize(quantize(w.numpy(), qtype), qtype).reshape(w.shape).copy())
        assert panels.Panel(back, k).fmt == fmt
        nudged = back.clone()
        nudged[5, 7] = torch.nextafter(nudged[5, 7], torch.tensor(1.0))  # one value off its format
        p = panels.Panel(nudged, k)
        assert p.fmt != fmt and torch.equal(p.unpack(), nudged)
    assert panels.encode(w) is None and panels.Panel(w, k).fmt == "float32"
    odd = w[:, :3 * k.lanes].bfloat16().float()  # bfloat16 values, but not whole blocks (3 · 8 or 3 · 16 columns)
    assert panels.Panel(odd, k).fmt == "float32"


@pytest.mark.parametrize("fmt, levels", [("q8", 255), ("q4", 16)])
def test_weights_rounded_to_a_block_format_are_its_nearest_values_and_stream_in_it(k, fmt, levels):
    """round_to: what a quantizer writes (each value within half a step of the weight, a step
    being the block's span over its levels, with a half-precision scale), recognised as the
    format; a block of zeros stays zeros."""
    g = torch.Generator().manual_seed(6)
    w = torch.randn(37, 3 * panels.BLOCK, generator=g) * torch.rand(37, 1, generator=g)
    w[4, :panels.BLOCK] = 0.0
    r = panels.round_to(w, fmt)
    assert panels.Panel(r, k).fmt == fmt and torch.equal(panels.round_to(r, fmt), r)
    b, rb = w.reshape(37, -1, panels.BLOCK), r.reshape(37, -1, panels.BLOCK)
    span = 2 * b.abs().amax(-1) if fmt == "q8" else b.amax(-1) - b.amin(-1)
    step = span / (levels - 1)
    assert ((rb - b).abs() <= 0.5 * step[..., None] * 1.002 + 1e-7).all()
    assert not torch.equal(r, w) and torch.equal(r[4, :panels.BLOCK], w[4, :panels.BLOCK])
    with pytest.raises(ValueError, match="q8 or q4"):
        panels.round_to(w, "q5")


def test_the_start_up_check_refuses_block_formats_that_compute_otherwise(k, monkeypatch):
    call = panels.Panel.__call__
    monkeypatch.setattr(panels.Panel, "__call__",
                        lambda self, x: call(self, x) * (1 + 1e-6 * (self.fmt == "q8")))
    assert "q8 panel are not the float32 panel's bits" in (panels.check(k) or "")
