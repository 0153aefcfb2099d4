import pytest
import torch

from tests.helpers import lean_from_hf, tiny_hf_model


@pytest.mark.parametrize("model_type,kv_heads,n", [("llama", 2, 12), ("llama", 4, 12), ("qwen2", 2, 12),
                                                    ("llama", 2, 40)])  # 40: the fused causal prefill path
def test_logits_match_hugging_face(model_type, kv_heads, n):
    hf = tiny_hf_model(model_type=model_type, kv_heads=kv_heads)
    lean = lean_from_hf(hf)
    ids = torch.randint(0, hf.config.vocab_size, (n,))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]  # [T, V]
    ours = lean.forward(ids, lean.new_cache(64))
    # HF computes RMSNorm in float32 even for float64 models, hence 1e-6, not 1e-12.
    torch.testing.assert_close(ours.double(), ref, rtol=1e-6, atol=1e-6)


def test_incremental_steps_and_rollback_match_one_full_forward():
    lean = lean_from_hf(tiny_hf_model())
    ids = torch.randint(0, 30, (10,))
    full = lean.forward(ids, lean.new_cache(32))  # [10, V]

    cache = lean.new_cache(32)
    lean.forward(ids[:6], cache)
    # a verification-shaped chunk with wrong tail tokens, then rolled back
    lean.forward(torch.tensor([int(ids[6]), 3, 4, 5]), cache)
    cache.lengths[0] = 7
    rest = torch.cat([lean.forward(ids[i:i + 1], cache) for i in range(7, 10)])
    torch.testing.assert_close(rest, full[7:], rtol=1e-9, atol=1e-9)


def test_last_logits_only_matches_full():
    lean = lean_from_hf(tiny_hf_model())
    ids = torch.randint(0, 30, (7,))
    full = lean.forward(ids, lean.new_cache(16))
    last = lean.forward(ids, lean.new_cache(16), all_logits=False)
    torch.testing.assert_close(last, full[-1:])


def test_cache_overflow_is_an_error_not_a_silent_wrap():
    lean = lean_from_hf(tiny_hf_model())
    cache = lean.new_cache(4)
    with pytest.raises(ValueError, match="KV cache full"):
        lean.forward(torch.arange(5), cache)


def test_layer_subset_model_runs_only_those_layers():
    hf = tiny_hf_model(layers=4)
    lean = lean_from_hf(hf)
    from engines.llama import LlamaModel
    sub = LlamaModel(lean.cfg, lean.weights, [0, 1])
    hf.model.layers = hf.model.layers[:2]
    hf.config.num_hidden_layers = 2
    ids = torch.randint(0, 30, (5,))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    torch.testing.assert_close(sub.forward(ids, sub.new_cache(8)).double(), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("T,S", [(1, 1), (1, 37), (3, 3), (4, 20), (9, 64)])
def test_cpu_attention_matches_masked_sdpa(T, S):
    """attend() (the CPU path) against SDPA with the full causal mask over the
    cache, grouped query heads laid out as forward_many lays them out."""
    import torch.nn.functional as F

    from engines.llama import attend

    Hk, G, D = 2, 3, 8
    q = torch.randn(Hk, G * T, D, dtype=torch.float64)
    k, v = torch.randn(Hk, S, D, dtype=torch.float64), torch.randn(Hk, S, D, dtype=torch.float64)
    mask = torch.ones(T, S, dtype=torch.bool).tril(diagonal=S - T).repeat(G, 1)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(attend(q, k, v, T), ref, rtol=1e-12, atol=1e-12)
    # and the masked positions really are masked: a future key changes nothing for the first query
    if T > 1:
        k2 = k.clone()
        k2[:, -1] += 5.0
        torch.testing.assert_close(attend(q, k2, v, T)[:, 0], attend(q, k, v, T)[:, 0])


def test_cpu_attention_keeps_its_inputs_dtype_float64_and_bfloat16_alike():
    from engines.llama import attend

    q, k, v = torch.randn(2, 6, 8, dtype=torch.float64), torch.randn(2, 9, 8, dtype=torch.float64), \
        torch.randn(2, 9, 8, dtype=torch.float64)
    exact = attend(q, k, v, 2)
    assert exact.dtype == torch.float64
    low = attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), 2)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.double(), exact, rtol=0.05, atol=0.05)


def test_padded_decode_of_rows_at_different_lengths_matches_each_row_alone():
    """decode_padded steps rows of one padded cache, each at its own length (the
    distillation data's path on a GPU): logits and the layer states it returns
    equal what each row's own forward gives, and each row's keys land in its own place."""
    lean = lean_from_hf(tiny_hf_model(layers=3))
    prompts = [torch.randint(0, 30, (n,)) for n in (5, 9, 2)]
    nxt = [torch.randint(0, 30, (3,)) for _ in prompts]
    layers = (1, -1)
    ref = []
    for p, t in zip(prompts, nxt):
        cache = lean.new_cache(16)
        lean.forward(p, cache)
        ref.append([lean.forward_many([(t[i:i + 1], cache, True)], hidden=layers) for i in range(3)])
    padded = lean.new_cache(16, batch=3)
    for b, p in enumerate(prompts):  # prefill each row through its own view
        lean.forward(p, padded.row(b))
        padded.lengths[b] = p.shape[0]
    for i in range(3):
        logits, states = lean.decode_padded(torch.stack([t[i] for t in nxt]), padded, hidden=layers)
        for b in range(3):
            want_logits, want_states = ref[b][i]
            torch.testing.assert_close(logits[b], want_logits[0][0], rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(states[b], want_states[0][0], rtol=1e-9, atol=1e-9)
    assert padded.lengths == [8, 12, 5]
