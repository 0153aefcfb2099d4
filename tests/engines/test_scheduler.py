"""Continuous batching: outputs do not depend on the batch, the statistical
lossless property holds batched, admission is FIFO within the KV budget, long
prefills are chunked, and forward_many equals separate forwards."""

import dataclasses

import pytest
import torch

from engines.api import SamplingParams
from engines.builtin import BuiltinEngine, BuiltinHandle
from engines.config import EngineConfig, NgramDraftConfig, TargetConfig
from engines.layouts import Columns, route_columns
from engines.layouts import routed as routed_columns
from engines.llama import LlamaModel
from engines.proposers import ModelDraftProposer, NgramProposer
from engines.scheduler import Scheduler
from tests.helpers import (
    WORDS,
    as_gguf,
    assert_follows,
    engine_over,
    exact_joint_of_first_tokens,
    lean_from_hf,
    run_together,
    tiny_hf_model,
    tiny_loaded,
    token_request,
)

CONFIG = EngineConfig(target=TargetConfig(max_context=128), drafts=[NgramDraftConfig()], gamma_max=8,
                      max_queue=64, max_batch=16, prefill_chunk=16)


def make_engine(config=CONFIG, dtype=torch.float64):
    target = tiny_loaded(scale=4.0, dtype=dtype)
    sub = LlamaModel(target.model.cfg, target.model.weights, [0, 1])
    drafts = {"ngram": lambda cap: NgramProposer(1, 3), "half": lambda cap: ModelDraftProposer(sub, cap)}
    return BuiltinEngine(target, drafts, config, start_worker=False)


def make_scheduler(config=CONFIG):
    """A scheduler fed by hand, step by step (what the engine's loop does)."""
    eng = make_engine(config)
    sched = Scheduler(eng.model, eng.tokenizer, eng.eos_ids, eng.drafts, config.gamma_max, config.kv_budget_tokens,
                      config.max_batch, config.prefill_chunk)
    return eng, sched


def enqueue(eng, sched, request) -> BuiltinHandle:
    handle = BuiltinHandle(request, list(request.prompt_token_ids))
    sched.waiting.append(handle)
    return handle


req = token_request
PROMPTS = [[5, 6, 7, 5, 6], [9, 3, 12, 30, 2, 2, 8, 9, 3, 12, 30, 2, 2, 8, 4, 4, 4, 4, 9, 10, 11, 12, 13],
           [20], list(range(2, 34)), [33, 34, 33, 34, 33], [3, 3, 3], [10, 11, 10, 11], [8, 9, 10, 11, 12, 13]]


def test_forward_many_equals_separate_forwards():
    model = lean_from_hf(tiny_hf_model())
    seqs = [torch.randint(0, 30, (n,)) for n in (1, 5, 9)]
    sep = [model.forward(s, model.new_cache(16)) for s in seqs]
    together = model.forward_many([(s, model.new_cache(16), True) for s in seqs])
    for a, b in zip(sep, together):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_greedy_output_is_the_same_alone_with_plain_neighbours_and_with_mixed_arms():
    alone = run_together(make_engine(), [req(0, PROMPTS[1], "ngram:4")])[0].token_ids
    with_plain = run_together(make_engine(), [req(0, PROMPTS[1], "ngram:4")] +
                              [req(i, p) for i, p in enumerate(PROMPTS[:7], start=1)])
    arms = ["half:3", "ngram:1", "plain", "half:6", "ngram:8", "plain", "half:1"]
    # two neighbours verify their whole draft every round (fixed γ): whether the adaptive budget
    # verifies anything depends on the step times this machine measures, and the test needs drafts
    # verified beside the others whatever it measured
    fixed = {1, 5}
    mixed = run_together(make_engine(), [req(0, PROMPTS[1], "ngram:4")] +
                         [dataclasses.replace(req(i, p, arms[i - 1]), fixed_gamma=i in fixed)
                          for i, p in enumerate(PROMPTS[:7], start=1)])
    assert with_plain[0].token_ids == alone == mixed[0].token_ids
    # and every neighbour got what it gets alone, whatever its arm
    for i, p in enumerate(PROMPTS[:7], start=1):
        solo = run_together(make_engine(), [req(i, p)])[0].token_ids
        assert with_plain[i].token_ids == solo == mixed[i].token_ids, f"prompt {i} ({arms[i - 1]})"
    assert sum(r.stats.accepted for r in mixed) > 0


@pytest.mark.parametrize("panels", [False, True, "gguf"])
def test_weights_routed_as_w_x_transposed_change_no_greedy_output_of_any_arm(panels):
    """The routes (engines/layouts.py: Columns, here the layers for up to 3 tokens, the
    head for up to 2 rows; by MKL or by the panels kernel, which takes float32 weights)
    move logits by rounding only; weights as a GGUF model loads them (Q4_1 layers, a
    Q8_0 head) stream in those formats, to the same bits."""
    arms = ["ngram:4", "half:2", "plain", "half:6", "ngram:1"]
    reqs = [dataclasses.replace(req(i, p, a), fixed_gamma=True) for i, (p, a) in enumerate(zip(PROMPTS, arms))]
    dtype = torch.float32 if panels else torch.float64

    def unrouted():
        eng = make_engine(dtype=dtype)
        if panels == "gguf":
            as_gguf(eng.model.weights)
        return eng

    def routed():
        eng = unrouted()
        route_columns(eng.model.weights, 3, 2, panels=bool(panels))
        head = eng.model.weights.lm_head
        assert isinstance(head, Columns) and head.on_panels == bool(panels)
        if panels == "gguf":
            assert head.panel.fmt == "q8" and {c.panel.fmt for c in routed_columns(eng.model.weights)} == {"q4"}
        return eng
    for r in reqs:  # alone: one row, its verifications of 1-6 drafts on either side of the route
        assert run_together(routed(), [r])[0].token_ids == run_together(unrouted(), [r])[0].token_ids
    together = run_together(routed(), reqs)
    assert [r.token_ids for r in together] == [r.token_ids for r in run_together(unrouted(), reqs)]
    assert sum(r.stats.accepted for r in together) > 0


def test_seeded_sampling_is_reproducible_regardless_of_neighbours():
    """With the step budget off (every row verifies its full γ): the budget
    verifies fewer drafts as the batch grows, and so draws fewer samples."""
    def target(neighbours):
        reqs = [req(0, PROMPTS[0], "half:3", temperature=1.0, seed=42)]
        reqs += [req(i, p, "ngram:2", temperature=0.8) for i, p in enumerate(PROMPTS[2:2 + neighbours], start=1)]
        return run_together(make_engine(CONFIG.model_copy(update={"adaptive": False})), reqs)[0].token_ids

    assert target(0) == target(3) == target(6)


def test_batched_speculative_sampling_follows_the_target_distribution():
    target = lean_from_hf(tiny_hf_model(vocab=10, seed=3, scale=1.5, layers=3))
    sub = LlamaModel(target.cfg, target.weights, [0])
    sp = SamplingParams(max_tokens=4, temperature=1.0, top_p=0.8, ignore_eos=True)
    prompt = [2, 3, 4, 2, 3, 4, 2]
    exact = exact_joint_of_first_tokens(target, prompt, sp, 4)
    eng = engine_over(target, WORDS[:10], max_context=64, gamma_max=2, half=lambda cap: ModelDraftProposer(sub, cap),
                      ngram=lambda cap: NgramProposer(1, 2))
    trials = 1500
    results = run_together(eng, [req(s, prompt, "half:2" if s % 2 else "ngram:2", **{**sp.__dict__, "seed": s})
                                 for s in range(trials)])
    counts: dict = {}
    for r in results:
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
    assert_follows(exact, counts, trials, "mixed batch")


def test_admission_is_fifo_within_the_kv_budget():
    cfg = CONFIG.model_copy(update={"kv_budget_tokens": 80, "max_batch": 8})
    eng, sched = make_scheduler(cfg)
    # each reserves 5 + 20 + 8 + 1 = 34 positions: two fit, the third waits
    handles = [enqueue(eng, sched, req(i, PROMPTS[0], max_tokens=20, ignore_eos=True)) for i in range(5)]
    sched.admit()
    assert [r.handle.request_id for r in sched.running] == ["0", "1"] and len(sched.waiting) == 3
    assert sched.kv_used == 68 <= 80
    order = []
    while sched.running or sched.waiting:
        sched.step()
        sched.admit()
        order += [h.request_id for h in handles if h.done and h.request_id not in order]
        assert sched.kv_used <= 80
    assert order == ["0", "1", "2", "3", "4"]


def test_a_long_prefill_is_chunked_and_does_not_stall_running_decodes():
    eng, sched = make_scheduler(CONFIG.model_copy(update={"prefill_chunk": 8}))
    enqueue(eng, sched, req(0, PROMPTS[0], max_tokens=30, ignore_eos=True))
    sched.admit()
    sched.step()  # short prefilled, first token out
    enqueue(eng, sched, req(1, list(range(2, 34)) * 2, max_tokens=3))  # 64 prompt tokens
    sched.admit()
    for _ in range(4):  # 64 / 8 = 8 steps of prefill; the short one decodes at every one of them
        before = len(sched.running[0].out_ids)
        sched.step()
        assert len(sched.running[0].out_ids) > before
        assert sched.last_step_tokens <= 8 + 1


def test_cancel_frees_the_slot_at_the_next_step():
    eng, sched = make_scheduler()
    h = enqueue(eng, sched, req(0, PROMPTS[0], max_tokens=50, ignore_eos=True))
    sched.admit()
    sched.step()
    assert sched.kv_used > 0
    h.cancel()
    sched.step()
    assert not sched.running and sched.kv_used == 0
    assert h.wait(1).stats.finish_reason == "cancelled"


def test_each_request_says_what_its_drafting_and_verification_added_to_its_steps():
    """The learner's yardstick where plain requests are few: a request's decode time
    less what its own speculation added is what its rounds would have taken undrafted.
    Plain rows added nothing; drafted and verified rows added some of their time, not
    all of it; and the figure survives the worker protocol (unset: an engine that does
    not say)."""
    from gateway.pbconv import result_from_pb, result_pb

    arms = ["plain", "half:3", "ngram:4", "plain"]
    reqs = [dataclasses.replace(req(i, PROMPTS[i + 1], a), fixed_gamma=a != "plain") for i, a in enumerate(arms)]
    results = run_together(make_engine(), reqs)
    for res, arm in zip(results, arms):
        s = res.stats
        if arm == "plain":
            assert s.speculation_s == 0.0
        else:
            assert s.drafted > 0 and 0.0 < s.speculation_s < s.total_s - s.prefill_s, (arm, s)
        assert result_from_pb(res.request_id, result_pb(res)).stats.speculation_s == s.speculation_s
    unsaid = dataclasses.replace(results[0], stats=dataclasses.replace(results[0].stats, speculation_s=None))
    assert result_from_pb("x", result_pb(unsaid)).stats.speculation_s is None
