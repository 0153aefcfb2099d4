"""The trained-draft path on tiny models: an EAGLE-style head reading the
target's states, with a reduced vocabulary, is lossless (greedy identity,
sampled distribution), its artifact is refused for another target,
distillation learns (the loss falls on the target's own data), and its kept
stages are reused only by a run that would make them the same."""

import json
import random
from dataclasses import replace

import pytest
import torch

from engines.api import SamplingParams
from engines.builtin import BuiltinEngine
from engines.config import EagleDraftConfig, EngineConfig, TargetConfig
from engines.distill.data import Progress, generate, generate_padded, load_samples, save_samples
from engines.distill.model import EagleHead
from engines.distill.prompts import CONTEXT_TASKS, context_prompts, written_requests
from engines.distill.run import Settings, encode, generated, prompt_set, self_prompt_set
from engines.distill.train import agreement, train
from engines.drafts import Drafts, build_drafts
from engines.layouts import Columns
from engines.loading import fingerprint
from engines.panels import encode as weight_format
from engines.proposers.eagle import MATMULS, EagleDraft, EagleProposer, load_draft, save_draft
from tests import helpers
from tests.helpers import (
    WORDS,
    assert_follows,
    exact_joint_of_first_tokens,
    lean_from_hf,
    run_together,
    tiny_hf_model,
    tiny_loaded,
    token_request,
)

LAYERS = (0, -1)  # a low layer and the final state, as the shipped draft reads three


def eagle_for(target, vocab_ids, seed=0) -> EagleDraft:
    torch.manual_seed(seed)
    head = EagleHead(target.weights, target.cfg, vocab_ids, LAYERS)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return EagleDraft(target, {k: v.detach() for k, v in head.export().items()}, vocab_ids, LAYERS)


def engine_over(target, words, **drafts) -> BuiltinEngine:
    return helpers.engine_over(target, words, max_context=96, gamma_max=6, **drafts)


def assert_greedy_is_plain(target, name: str, factory, prompts: list[list[int]], gammas) -> None:
    """Greedy output with draft `name` (its proposer factory) equals plain's at each γ, drafting within γ."""
    plain = run_together(engine_over(target, WORDS), [token_request(i, p, max_tokens=24) for i, p in
                                                      enumerate(prompts)])
    for gamma in gammas:
        spec = run_together(engine_over(target, WORDS, **{name: factory}),
                            [token_request(i, p, f"{name}:{gamma}", max_tokens=24) for i, p in enumerate(prompts)])
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain], gamma
        assert all(d <= gamma for r in spec for d in r.stats.drafted_per_round)
        assert sum(r.stats.drafted for r in spec) > 0


def assert_sampling_follows(target, words, name: str, factory, prompt: list[int], sp: SamplingParams) -> None:
    """2000 seeds at fixed γ 2 (every draft verified, whatever the budget would make of a tiny model):
    the first four tokens follow the target's exact joint, and the draft carried a good share."""
    exact = exact_joint_of_first_tokens(target, prompt, sp, 4)
    trials = 2000
    results = run_together(engine_over(target, words, **{name: factory}),
                           [replace(token_request(s, prompt, f"{name}:2", **{**sp.__dict__, "seed": s}),
                                    fixed_gamma=True) for s in range(trials)])
    counts: dict = {}
    for r in results:
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
    assert sum(r.stats.accepted for r in results) > trials // 4
    assert_follows(exact, counts, trials, name)


def test_greedy_output_with_the_eagle_draft_is_plain_output():
    target = lean_from_hf(tiny_hf_model(seed=0, scale=4.0))
    draft = eagle_for(target, torch.arange(2, 30))  # a reduced vocabulary: the draft cannot say every token
    assert_greedy_is_plain(target, "eagle", lambda cap: EagleProposer(draft, cap),
                           [[5, 6, 7, 5, 6], [9, 3, 12, 30, 2, 2, 8], [20], [33, 34, 33, 34]], (1, 3, 6))


@pytest.mark.parametrize("panels", [False, True])
def test_an_eagle_draft_routed_as_w_x_transposed_drafts_what_it_did(panels):
    """Drafts.route_columns: the draft's layer, head and the matmuls before its
    layer run as W @ xᵀ for forwards of a few rows (layouts.Columns), as the
    target's do; greedy, it drafts and accepts exactly what the unrouted draft
    did, alone (one row) and batched (rows beyond the routes), and the output is
    plain's."""
    target = lean_from_hf(tiny_hf_model(seed=0, scale=4.0), torch.float32 if panels else torch.float64)
    ids = torch.arange(2, 30)
    before, draft = eagle_for(target, ids), eagle_for(target, ids)
    Drafts({}, [draft.model.weights], [draft]).route_columns(3, 2, panels)  # the panels take float32 weights
    w = draft.model.weights
    assert all(isinstance(m, Columns) and m.on_panels == panels
               for m in (draft.fc, draft.reduce, w.lm_head, w.layers[0].qkv, w.layers[0].down))
    assert not isinstance(target.weights.lm_head, Columns)  # the target's are the profile's to route
    prompts = [[5, 6, 7, 5, 6], [9, 3, 12, 30, 2, 2, 8], [20], [33, 34, 33, 34]]
    for batch in [[p] for p in prompts] + [prompts]:
        reqs = [replace(token_request(i, p, "eagle:3", max_tokens=24), fixed_gamma=True) for i, p in enumerate(batch)]
        got = run_together(engine_over(target, WORDS, eagle=lambda cap: EagleProposer(draft, cap)), reqs)
        want = run_together(engine_over(target, WORDS, eagle=lambda cap: EagleProposer(before, cap)), reqs)
        assert [(r.token_ids, r.stats.drafted_per_round, r.stats.accepted) for r in got] == \
            [(r.token_ids, r.stats.drafted_per_round, r.stats.accepted) for r in want]
    assert_greedy_is_plain(target, "eagle", lambda cap: EagleProposer(draft, cap), prompts, (1, 3))


def test_an_eagle_draft_reads_no_more_of_a_prompt_than_its_training_windows(tmp_path):
    """A draft trained on windows of 4 positions (its card's seq_len) reads a
    9-token prompt's last 4: its cache starts there, the positions before are
    skipped, and what it drafts next follows on from them; greedy output stays
    plain's with it drafting and accepted."""
    loaded = tiny_loaded(seed=0, scale=4.0)
    target, ids = loaded.model, torch.arange(2, 30)
    head = EagleHead(target.weights, target.cfg, ids, LAYERS)
    save_draft(tmp_path, head.export(), ids, {"target_fingerprint": fingerprint(loaded),
                                              "feature_layers": list(LAYERS), "training": {"seq_len": 4}})
    cfg = EngineConfig(target=TargetConfig(max_context=96), drafts=[EagleDraftConfig(path=str(tmp_path))])
    draft = build_drafts(cfg, loaded, tmp_path).eagles[0]
    assert draft.context == 4
    prompt = [9, 3, 12, 30, 2, 2, 8, 5, 6]
    greedy = SamplingParams(max_tokens=8, temperature=0.0)

    def states_of(tokens):  # the target's states at every position of tokens
        return target.forward_many([(torch.tensor(tokens), target.new_cache(32), False)], hidden=LAYERS)[1][0]
    p = EagleProposer(draft, 32)
    p.observe_states(states_of(prompt))  # the prefill's states; its token follows the prompt
    ctx = prompt + [7]
    first = p.propose(ctx, 1, greedy, torch.Generator()).token_ids.tolist()
    assert (p.skipped, p.committed, p.cache.lengths[0]) == (5, 9, 4)  # the cache starts at the prompt's tail

    def drafted(d, states, ctx):  # three tokens drafted after reading `states`
        q = EagleProposer(d, 32)
        q.observe_states(states)
        return q.propose(ctx, 3, greedy, torch.Generator())
    as_built = load_draft(tmp_path, fingerprint(loaded), cfg.drafts[0].weights)[:2]  # rounded as the engine's
    unbounded = EagleDraft(target, *as_built, LAYERS)  # reads all it is given
    got, tail = drafted(draft, states_of(prompt), ctx), drafted(unbounded, states_of(prompt)[5:], ctx[5:])
    full = drafted(unbounded, states_of(prompt), ctx)
    assert got.token_ids.tolist() == tail.token_ids.tolist()  # as if the prompt were its last 4 tokens
    assert torch.allclose(got.confidence, tail.confidence, rtol=0, atol=1e-7)
    assert not torch.allclose(full.confidence, tail.confidence, rtol=0, atol=1e-6)  # the skipped ones count
    ctx += first + [11]  # the draft accepted, a bonus token after it
    p.observe_states(states_of(ctx[:-1])[9:])  # the states of the two positions the round committed
    assert len(p.propose(ctx, 2, greedy, torch.Generator()).token_ids) == 2
    assert (p.skipped, p.committed, p.cache.lengths[0]) == (5, 11, 7)  # 4 + 2 fed + 1 drafted on
    assert_greedy_is_plain(target, "eagle", lambda cap: EagleProposer(draft, cap),
                           [prompt, [33, 34, 33, 34, 33, 34], [20]], (1, 3))


@pytest.mark.parametrize("sp", [
    SamplingParams(max_tokens=4, temperature=0.7, top_p=0.9, ignore_eos=True),
    SamplingParams(max_tokens=4, temperature=1.0, top_p=0.8, top_k=6, ignore_eos=True),
])
def test_sampling_with_a_reduced_vocabulary_follows_the_target(sp):
    words = WORDS[:10]
    target = lean_from_hf(tiny_hf_model(vocab=10, seed=3, scale=1.5, layers=3))
    draft = eagle_for(target, torch.tensor([2, 3, 4, 5, 7, 8]))  # q is zero for 0, 1, 6 and 9
    assert_sampling_follows(target, words, "eagle", lambda cap: EagleProposer(draft, cap), [2, 3, 4, 2, 3, 4, 2], sp)


def test_a_draft_made_for_another_target_is_refused_naming_both(tmp_path):
    mine, other = tiny_loaded(seed=0), tiny_loaded(seed=1)
    head = EagleHead(mine.model.weights, mine.model.cfg, torch.arange(10), LAYERS)
    save_draft(tmp_path, head.export(), torch.arange(10), {"target_fingerprint": fingerprint(mine),
                                                           "feature_layers": list(LAYERS)})
    tensors, ids, card = load_draft(tmp_path, fingerprint(mine))
    assert ids.tolist() == list(range(10)) and card["feature_layers"] == [0, -1]
    assert (tmp_path / "draft.safetensors").stat().st_size < 200_000
    with pytest.raises(ValueError) as e:
        load_draft(tmp_path, fingerprint(other))
    assert fingerprint(mine) in str(e.value) and fingerprint(other) in str(e.value)
    assert fingerprint(mine) == fingerprint(tiny_loaded(seed=0))  # the same model, loaded again


@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_a_draft_loaded_with_rounded_weights_streams_its_matmuls_in_that_format_and_stays_lossless(tmp_path, fmt):
    """EagleDraftConfig.weights: its own matmuls' weights rounded to a block format on loading
    (the panels stream them in it), its norms as stored; greedy output is still plain's."""
    mine = tiny_loaded(seed=0, scale=4.0, dtype=torch.float32)
    head = EagleHead(mine.model.weights, mine.model.cfg, torch.arange(2, 30), LAYERS)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.02 * torch.randn_like(p))
    save_draft(tmp_path, head.export(), torch.arange(2, 30), {"target_fingerprint": fingerprint(mine),
                                                               "feature_layers": list(LAYERS)})
    stored, ids, _ = load_draft(tmp_path, fingerprint(mine))
    rounded, _, _ = load_draft(tmp_path, fingerprint(mine), fmt)
    for name, t in rounded.items():
        if name in MATMULS:
            assert weight_format(t)[0] == fmt and not torch.equal(t, stored[name])
            assert torch.allclose(t, stored[name], atol=0.1 * float(stored[name].abs().max()))
        else:
            assert torch.equal(t, stored[name]), name
    draft = EagleDraft(mine.model, rounded, ids, LAYERS)
    Drafts({}, [draft.model.weights], [draft]).route_columns(3, 2, panels=True)
    assert {m.panel.fmt for m in (draft.fc, draft.reduce, draft.model.weights.layers[0].qkv)} == {fmt}
    assert_greedy_is_plain(mine.model, "eagle", lambda cap: EagleProposer(draft, cap),
                           [[5, 6, 7, 5, 6], [9, 3, 12, 30, 2, 2, 8], [20]], (1, 3))


def test_distillation_learns_on_the_targets_own_answers(tmp_path):
    target = lean_from_hf(tiny_hf_model(seed=0, scale=4.0, dtype=torch.float32), dtype=torch.float32)
    prompts = [("t", [int(x) for x in torch.randint(2, 38, (6,), generator=torch.Generator().manual_seed(i))],
                [0.0, 1.0][i % 2]) for i in range(24)]
    samples = generate(target, prompts, 24, frozenset({1}), seed=0, layers=LAYERS, batch=8)
    assert len(samples) == 24 and all(s.states.shape == (s.tokens.shape[0] - 1, 2 * 32) for s in samples)
    save_samples(tmp_path / "d.safetensors", samples)
    again = load_samples(tmp_path / "d.safetensors")
    assert torch.equal(again[3].tokens, samples[3].tokens) and torch.equal(again[3].states, samples[3].states)
    head = EagleHead(target.weights, target.cfg, torch.arange(38), LAYERS)
    before = agreement(head, samples[20:], 32)[0]
    train(head, samples[:20], steps=60, seq_len=32, batch=4, lr=3e-3, seed=0, checkpoint=tmp_path / "ck.pt",
          log=lambda m: None, tts_steps=2, checkpoint_every=20)
    after = agreement(head, samples[:20], 32)
    assert after[0] > before + 0.2 and (tmp_path / "ck.pt").exists()


def test_padded_data_generation_writes_what_the_ragged_one_does():
    """The GPU's padded batches (generate_padded) against the CPU's ragged ones:
    greedy answers token for token, their states equal, prompts of different
    lengths in one batch, an answer ending at EOS early; sampled answers run
    their length with a state for every position but the last. Asked for no
    layers, both write the same answers and keep no states."""
    target = lean_from_hf(tiny_hf_model(seed=0, scale=4.0, dtype=torch.float32), dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    prompts = [("t", [int(x) for x in torch.randint(2, 38, (n,), generator=gen)], 0.0) for n in (3, 7, 5, 11, 4)]
    ragged = generate(target, prompts, 16, frozenset({1, 5}), seed=0, layers=LAYERS, batch=8)
    padded = generate_padded(target, prompts, 16, frozenset({1, 5}), seed=0, layers=LAYERS, batch=3)
    assert any(s.answer_len < 16 for s in ragged)  # an EOS ended one early
    for r, p in zip(ragged, padded):
        assert torch.equal(p.tokens, r.tokens) and p.prompt_len == r.prompt_len
        torch.testing.assert_close(p.states.float(), r.states.float(), rtol=0.02, atol=0.02)  # bfloat16 storage
    for text_only in (generate(target, prompts, 16, frozenset({1, 5}), seed=0, layers=(), batch=8),
                      generate_padded(target, prompts, 16, frozenset({1, 5}), seed=0, layers=(), batch=3)):
        assert [s.tokens.tolist() for s in text_only] == [r.tokens.tolist() for r in ragged]
        assert all(s.states.shape == (s.tokens.shape[0] - 1, 0) for s in text_only)
    sampled = generate_padded(target, [(c, ids, 1.0) for c, ids, _ in prompts], 16, frozenset(), seed=0,
                              layers=LAYERS, batch=5)
    assert all(s.answer_len == 16 and s.states.shape[0] == s.tokens.shape[0] - 1 for s in sampled)
    assert len({tuple(s.tokens.tolist()) for s in sampled}) == len(prompts)


def test_a_time_bound_ends_training_early():
    """train(time_budget_s=...) stops when the time is up and counts only the steps
    taken; a budget that outlasts the steps changes nothing."""
    target = lean_from_hf(tiny_hf_model(seed=0, scale=4.0, dtype=torch.float32), dtype=torch.float32)
    prompts = [("t", [int(x) for x in torch.randint(2, 38, (6,), generator=torch.Generator().manual_seed(i))], 0.0)
               for i in range(4)]
    samples = generate(target, prompts, 12, frozenset(), seed=0, layers=LAYERS, batch=4)
    head = EagleHead(target.weights, target.cfg, torch.arange(38), LAYERS)
    lines: list[str] = []
    out = train(head, samples, steps=10_000, seq_len=16, batch=2, lr=1e-3, seed=0, checkpoint=None, log=lines.append,
                tts_steps=1, time_budget_s=0.5)
    assert 0 < out["steps"] < 10_000 and any("time budget reached" in m for m in lines)
    unbounded = train(EagleHead(target.weights, target.cfg, torch.arange(38), LAYERS), samples, steps=3, seq_len=16,
                      batch=2, lr=1e-3, seed=0, checkpoint=None, log=lines.append, tts_steps=1, time_budget_s=60)
    assert unbounded["steps"] == 3


def test_requests_about_passages_use_every_passage_before_repeating_one():
    """prompts.context_prompts: each prompt carries one passage inside a task from
    CONTEXT_TASKS; every passage is asked about before any is asked about twice;
    the same seed gives the same prompts."""
    texts = [f"passage number {i} about something" for i in range(5)]
    out = context_prompts(random.Random(0), texts, 12)
    assert len(out) == 12 and context_prompts(random.Random(0), texts, 12) == out
    used = [next(t for t in texts if t in p) for _, p in out]
    assert sorted(used[:5]) == sorted(texts) and sorted(used[5:10]) == sorted(texts)
    cats = {c for c, _ in CONTEXT_TASKS}
    assert all(c in cats for c, _ in out) and len({c for c, _ in out}) > 1
    assert context_prompts(random.Random(0), [], 3) == []


def test_a_kept_stage_is_reused_only_by_a_run_with_the_same_settings(tmp_path):
    """`specgate distill` keeps each data stage in its work directory under a key of
    what made it: the same target, prompts and length reuse the file; other prompts,
    another answer length or another target make their own, the old ones kept."""
    target = tiny_loaded()
    s = Settings(data_path=tmp_path / "dev.jsonl", out=tmp_path / "out", work=tmp_path, gen_batch=4,
                 feature_layers=LAYERS)
    items = [("t", [3, 4, 5, 6], 0.0), ("t", [7, 8, 9], 1.0)]
    first = generated(s, target, "train", items, 6, 0, "target-a")
    (path,) = tmp_path.glob("train-*.safetensors")
    made = path.stat().st_mtime_ns
    again = generated(s, target, "train", items, 6, 0, "target-a")
    assert path.stat().st_mtime_ns == made  # read, not generated again
    assert all(torch.equal(a.tokens, b.tokens) and torch.equal(a.states, b.states) for a, b in zip(first, again))
    assert len(generated(s, target, "train", items + [("t", [10, 11], 0.0)], 6, 0, "target-a")) == 3
    generated(s, target, "train", items, 8, 0, "target-a")
    generated(s, target, "train", items, 6, 0, "target-b")
    assert len(list(tmp_path.glob("train-*.safetensors"))) == 4 and path.stat().st_mtime_ns == made


def test_requests_the_target_writes_are_kept_where_its_turn_ends(tmp_path):
    """--self-prompts: the target continues its chat template's open user turn; a
    turn is kept as a request only if it ended (EOS) within its limit and has four
    words or more, each text once; the kept ones join the training prompts."""
    assert written_requests([("Write a poem about cats", True), ("a request cut off at its", False),
                             ("hi there", True), ("Write a poem about cats", True),
                             ("  Explain the tides to me ", True)]) == ["Write a poem about cats",
                                                                        "Explain the tides to me"]
    target = tiny_loaded()
    s = Settings(data_path=tmp_path / "dev.jsonl", out=tmp_path / "out", work=tmp_path, gen_batch=4,
                 feature_layers=LAYERS, self_prompts=12)
    kept, asked = self_prompt_set(s, target, "target-a")
    (path,) = tmp_path.glob("self-prompts-*.safetensors")
    turns = load_samples(path)
    assert asked == 12 and len(turns) == 12
    prefix = turns[0].tokens[: turns[0].prompt_len].tolist()
    assert all(x.tokens[: x.prompt_len].tolist() == prefix for x in turns)  # one open turn, sampled 12 ways
    assert all(x.states.shape == (x.tokens.shape[0] - 1, 0) for x in turns)  # read as text: no states kept
    request = encode(target.tokenizer, "the cat sat")  # a request's tokens begin with the open turn
    assert request[: len(prefix)] == prefix and len(request) > len(prefix)
    ended = [target.tokenizer.decode(x.tokens[x.prompt_len:-1].tolist(), skip_special_tokens=True) for x in turns
             if int(x.tokens[-1]) == 1]
    assert kept and kept == written_requests([(t, True) for t in ended])
    s.data_path.write_text("".join(json.dumps({"category": "qa", "turns": [f"question {i}?"]}) + "\n"
                                   for i in range(5)))
    train_prompts, _, info = prompt_set(s, target.tokenizer, kept)
    assert info["self_prompts"] == len(kept) and sum(1 for c, _, _ in train_prompts if c == "self") == len(kept)


def test_progress_of_an_empty_stage_reads_done_not_an_eta():
    """A stage with nothing to do (no passages to ask about) reports 0/0, 100%, no time left."""
    lines: list[str] = []
    p = Progress(0, "context data", "prompts", lines.append)
    p.update(0, force=True)
    assert "0/0 prompts 100.0%" in lines[0] and "eta   0.0 min" in lines[0]
    q = Progress(4, "train data", "prompts", lines.append)
    q.update(1, force=True)
    assert "1/4 prompts  25.0%" in lines[1]
