"""The layers' fused ops (engines/fused.py): built here, each computes what torch's ops
do, a row's result is the same bits alone as beside others (on the calling thread or
the OpenMP team), a forward with them matches one without, and greedy speculation
stays token-identical to plain decoding with them on."""

import pytest
import torch

from engines.api import SamplingParams
from engines.fused import FusedOps, TorchOps, check, fits, fused_ops
from engines.layouts import can_pack_rows, linear, route_columns
from engines.llama import LlamaModel
from engines.proposers import ModelDraftProposer, NgramProposer
from tests.engines.test_attention import assert_same_steps, two_steps
from tests.helpers import engine_over, lean_from_hf, run_together, tiny_hf_model, token_request


@pytest.fixture(scope="module")
def ops() -> FusedOps:
    built = fused_ops()
    assert built is not None, "every machine the tests run on has a C compiler (see the log for the build's error)"
    return built


def test_the_ops_pass_their_own_check(ops):
    assert check(ops) is None


@pytest.mark.parametrize("rows", [1, 3, 16, 40])  # 16 rows and more: the OpenMP team shares them
@pytest.mark.parametrize("width", [8, 37, 576])  # under a vector, a remainder, SmolLM2's
def test_each_op_computes_torch_s_and_a_row_its_own_bits(ops, rows, width):
    g = torch.Generator().manual_seed(rows * 1000 + width)
    x, y = torch.randn(rows, width, generator=g), 3 * torch.randn(rows, width, generator=g)
    w = torch.randn(width, generator=g)
    gu = 8 * torch.randn(rows, 2 * width, generator=g)  # silu's tails on both sides
    H, Hk, D = 3, 1, 16
    qkv = torch.randn(rows, (H + 2 * Hk) * D, generator=g)
    cos, sin = torch.randn(rows, D, generator=g), torch.randn(rows, D, generator=g)

    def close(got, want):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    close(ops.rms_norm(x, w, 1e-5), TorchOps.rms_norm(x, w, 1e-5))
    for got, want in zip(ops.add_rms_norm(x, y, w, 1e-6), TorchOps.add_rms_norm(x, y, w, 1e-6)):
        close(got, want)
    close(ops.silu_mul(gu), TorchOps.silu_mul(gu))
    rotated = ops.rope_qkv(qkv.clone(), cos, sin, H, Hk, D)
    for got, want in zip(rotated, TorchOps.rope_qkv(qkv, cos, sin, H, Hk, D)):
        close(got, want)
    # the last row again, alone: the same bits
    last = slice(rows - 1, rows)
    assert torch.equal(ops.rms_norm(x[last], w, 1e-5), ops.rms_norm(x, w, 1e-5)[last])
    assert torch.equal(ops.add_rms_norm(x[last], y[last], w, 1e-6)[1], ops.add_rms_norm(x, y, w, 1e-6)[1][last])
    assert torch.equal(ops.silu_mul(gu[last]), ops.silu_mul(gu)[last])
    assert torch.equal(ops.rope_qkv(qkv[last].clone(), cos[last], sin[last], H, Hk, D)[1], rotated[1][last])


def test_strided_inputs_read_as_their_values(ops):
    """A matmul routed as W @ xᵀ by MKL gives its rows as a transposed view."""
    g = torch.Generator().manual_seed(1)
    x, y, w = torch.randn(5, 24, generator=g), torch.randn(24, 5, generator=g).t(), torch.randn(24, generator=g)
    assert not y.is_contiguous()
    torch.testing.assert_close(ops.add_rms_norm(x, y, w, 1e-5)[1], TorchOps.add_rms_norm(x, y, w, 1e-5)[1])
    torch.testing.assert_close(ops.rms_norm(y, w, 1e-5), TorchOps.rms_norm(y, w, 1e-5))
    gu = torch.randn(48, 5, generator=g).t()
    torch.testing.assert_close(ops.silu_mul(gu), TorchOps.silu_mul(gu))


def test_fits_only_float32_states_on_cpu(ops):
    assert fits(ops, torch.zeros(2, 8))
    assert not fits(ops, torch.zeros(2, 8, dtype=torch.float64))
    assert not fits(None, torch.zeros(2, 8))


def float32_model(layers=3):
    return lean_from_hf(tiny_hf_model(hidden=64, heads=4, kv_heads=2, layers=layers, dtype=torch.float32),
                        torch.float32)


def test_a_forward_with_the_ops_matches_one_without(ops):
    model = float32_model()
    want = two_steps(model)
    model.fused = ops
    assert_same_steps(two_steps(model), want)


@pytest.mark.skipif(not can_pack_rows(torch.float32), reason="no MKL GEMM in this torch build")
def test_a_forward_with_matmuls_routed_by_mkl_matches(ops):
    model = float32_model()
    want = two_steps(model)
    route_columns(model.weights, 16, 16, panels=False)
    assert linear(torch.randn(3, model.cfg.hidden_size), model.weights.layers[0].qkv).stride(-1) != 1
    model.fused = ops
    assert_same_steps(two_steps(model), want)


@pytest.mark.parametrize("draft", ["ngram", "layers"])
def test_greedy_speculation_stays_token_identical_with_the_ops(ops, draft):
    target = lean_from_hf(tiny_hf_model(seed=0, scale=4.0, dtype=torch.float32), torch.float32)
    target.fused = ops
    layers = LlamaModel(target.cfg, target.weights, [0, 1])
    layers.fused = ops
    proposers = {"ngram": lambda cap: NgramProposer(1, 3), "layers": lambda cap: ModelDraftProposer(layers, cap)}
    sp = SamplingParams(max_tokens=24, temperature=0)
    prompts = [[5, 6, 7, 5, 6], [9, 3, 12, 30, 2, 2, 8], [20]]
    plain = run_together(engine_over(target), [token_request(i, p, **sp.__dict__) for i, p in enumerate(prompts)])
    accepted = 0
    for gamma in (1, 3, 8):
        eng = engine_over(target, **{draft: proposers[draft]})
        got = run_together(eng, [token_request(i, p, f"{draft}:{gamma}", **sp.__dict__)
                                 for i, p in enumerate(prompts)])
        for a, b in zip(plain, got):
            assert list(b.token_ids) == list(a.token_ids), f"{draft} γ={gamma}"
            accepted += b.stats.accepted
    assert accepted > 0, "no draft was ever accepted: the test would prove nothing"
