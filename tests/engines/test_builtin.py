"""The built-in engine end to end on a tiny model: validation, streaming, seeds, cancel."""

import dataclasses
import threading
import time

import pytest
import torch

from engines.api import ChatMessage, GenerationRequest, SamplingParams
from engines.arms import Arm, DraftKind
from engines.builtin import BuiltinEngine
from engines.config import EngineConfig, LayerDraftConfig, NgramDraftConfig
from engines.errors import Cancelled, EngineError, InvalidRequest, Overloaded, TokenizerMismatch
from engines.llama import LlamaModel
from engines.loading import check_tokenizers_match
from engines.proposers import ModelDraftProposer, NgramProposer
from engines.proposers.base import Proposal, ProposerBase
from tests.helpers import WORDS, RaisingDraft, run_together, tiny_loaded, tiny_tokenizer

CONFIG = EngineConfig(drafts=[NgramDraftConfig(), LayerDraftConfig(name="half", first_k=2)],
                      gamma_max=6, max_queue=4)


@pytest.fixture(scope="module")
def engine():
    target = tiny_loaded(scale=4.0)
    sub = LlamaModel(target.model.cfg, target.model.weights, [0, 1])
    drafts = {"ngram": lambda cap: NgramProposer(1, 3), "half": lambda cap: ModelDraftProposer(sub, cap)}
    config = CONFIG.model_copy(update={"target": CONFIG.target.model_copy(update={"max_context": 64})})
    eng = BuiltinEngine(target, drafts, config)
    yield eng
    eng.close()


def req(arm="plain", prompt="hello world the cat", **sampling):
    return GenerationRequest(request_id="r", prompt=prompt, arm=Arm.parse(arm),
                             sampling=SamplingParams(**{"max_tokens": 12, **sampling}))


def test_streamed_deltas_add_up_to_the_result(engine):
    h = engine.submit(req("ngram:4"))
    text = "".join(d.text for d in h)
    res = h.wait()
    assert text == res.text and res.stats.output_tokens == len(res.token_ids) > 0
    assert res.stats.arm == "ngram:4" and res.stats.finish_reason in ("length", "stop")
    assert res.stats.ttft_s > 0 and res.stats.total_s >= res.stats.ttft_s


@pytest.mark.parametrize("arm", ["ngram:1", "ngram:6", "half:2", "half:5"])
def test_every_arm_gives_plain_greedy_output(engine, arm):
    assert engine.generate(req(arm)).token_ids == engine.generate(req("plain")).token_ids


def test_the_menu_says_what_each_draft_is(engine):
    """As configured, not as the names suggest: the policy's prior for a draft it has not seen."""
    menu = engine.arms()
    assert (menu.kind_of("ngram"), menu.kind_of("half")) == (DraftKind("ngram"), DraftKind("layers"))


def test_chat_messages_go_through_a_template(engine):
    r = GenerationRequest(request_id="c", messages=(ChatMessage("user", "hello world"),),
                          sampling=SamplingParams(max_tokens=4))
    assert engine.generate(r).stats.prompt_tokens >= 2


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.1), dict(temperature=0.1, top_p=0.9)])
def test_a_seeded_sampled_request_writes_plains_text_under_prompt_lookup(engine, sampling):
    """The target's token at each position is drawn with that position's uniform, and a
    lookup's token is kept exactly when the target's own draw picks it: whatever γ the
    budget verifies, rejected or kept, the text is plain's."""
    want = engine.generate(req("plain", max_tokens=40, ignore_eos=True, seed=5, **sampling)).token_ids
    verified = accepted = 0
    for arm, fixed in (("ngram:1", False), ("ngram:6", False), ("ngram:6", True)):
        r = dataclasses.replace(req(arm, max_tokens=40, ignore_eos=True, seed=5, **sampling), fixed_gamma=fixed)
        got = engine.generate(r)
        assert got.token_ids == want, (arm, fixed)
        verified += sum(got.stats.verified_per_round)
        accepted += sum(got.stats.accepted_per_round)
    assert verified > 0 and (accepted > 0 or sampling["temperature"] == 1.0)  # drafts were judged, and kept


def test_seeded_sampling_is_reproducible(engine):
    """Plain decoding draws one sample per token: a seed reproduces its output. A
    model draft samples as many tokens as the step budget lets it draft, which
    depends on the load; with the budget off (fixed γ) a seed reproduces it too."""
    a = engine.generate(req("plain", temperature=1.0, seed=11))
    b = engine.generate(req("plain", temperature=1.0, seed=11))
    assert a.token_ids == b.token_ids and a.stats.seed == 11
    target = tiny_loaded(scale=4.0)
    sub = LlamaModel(target.model.cfg, target.model.weights, [0, 1])
    fixed = BuiltinEngine(target, {"half": lambda cap: ModelDraftProposer(sub, cap)},
                          CONFIG.model_copy(update={"adaptive": False}))
    try:
        runs = {fixed.generate(req("half:3", temperature=1.0, seed=11)).token_ids for _ in range(3)}
        assert len(runs) == 1
    finally:
        fixed.close()
    unseeded = [engine.generate(req("plain", temperature=1.0, max_tokens=20, ignore_eos=True)) for _ in range(3)]
    assert len({r.stats.seed for r in unseeded}) == 3  # a fresh seed is drawn each time
    for r in unseeded:  # and the reported seed reproduces the output
        again = engine.generate(req("plain", temperature=1.0, max_tokens=20, ignore_eos=True, seed=r.stats.seed))
        assert again.token_ids == r.token_ids


def test_stop_string_ends_generation(engine):
    full = engine.generate(req("plain", max_tokens=12))
    words = full.text.split()
    assert len(words) >= 3
    stop = words[2]
    res = engine.generate(req("ngram:3", max_tokens=12, stop=(stop,)))
    assert res.stats.finish_reason == "stop" and stop not in res.text
    assert full.text.startswith(res.text)


@pytest.mark.parametrize("field,request_", [
    ("prompt", GenerationRequest(request_id="x", prompt="")),
    ("prompt", GenerationRequest(request_id="x")),
    ("prompt", req(prompt="\r \n")),  # text that encodes to no tokens at all
    ("max_tokens", req(max_tokens=0)),
    ("max_tokens", req(max_tokens=500)),  # beyond the 64-token context
    ("temperature", req(temperature=-1)),
    ("top_p", req(top_p=0)),
    ("top_k", req(top_k=-2)),
    ("arm.gamma", req("ngram:7")),
    ("arm.gamma", GenerationRequest(request_id="x", prompt="hi", arm=Arm("ngram", 0),
                                    sampling=SamplingParams(max_tokens=4))),
    ("arm.draft", req("eagle:3")),
    ("messages[0].role", GenerationRequest(request_id="x", messages=(ChatMessage("wizard", "hi"),))),
    ("prompt", req(prompt=" ".join(["hello"] * 80))),  # no room left in the context
])
def test_bad_input_names_the_field(engine, field, request_):
    with pytest.raises(InvalidRequest) as e:
        engine.submit(request_)
    assert e.value.field == field
    assert engine.generate(req()).stats.output_tokens > 0  # the engine still serves


def test_cancel_while_queued_and_overload():
    target = tiny_loaded()
    gate = threading.Event()

    class Blocking(ProposerBase):  # holds the worker inside a request until released
        def propose(self, context, gamma, sampling, generator):
            gate.wait(10)
            return NgramProposer().propose(context, gamma, sampling, generator)

    eng = BuiltinEngine(target, {"block": lambda cap: Blocking()}, CONFIG)
    try:
        first = eng.submit(req("block:1", max_tokens=3))
        deadline = time.monotonic() + 10
        while eng.load().running == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # the worker has taken it off the queue
        queued = [eng.submit(req()) for _ in range(4)]  # max_queue = 4
        with pytest.raises(Overloaded):
            eng.submit(req())
        queued[0].cancel()
        assert eng.load().waiting == 4 and eng.load().running == 1
        gate.set()
        assert first.wait(10).stats.output_tokens == 3
        with pytest.raises(Cancelled):
            queued[0].wait(10)
        for h in queued[1:]:
            assert h.wait(10).stats.output_tokens > 0
    finally:
        gate.set()
        eng.close()


def test_cancel_while_running_stops_early():
    target = tiny_loaded()
    eng = BuiltinEngine(target, {}, CONFIG)
    try:
        h = eng.submit(req(max_tokens=40, ignore_eos=True))
        for _ in h:
            h.cancel()
        res = h.wait(10)
        assert res.stats.finish_reason == "cancelled" and res.stats.output_tokens < 40
    finally:
        eng.close()


class BrokenTogether(ProposerBase):
    """A draft whose rows draft in one batch, which raises."""

    batch_key = "together"

    @staticmethod
    def propose_batch(requests):
        raise RuntimeError("boom")


def test_a_draft_that_raises_leaves_its_requests_decoding_without_drafts(caplog):
    """Drafting that raises, alone or in a batch of rows drafting together, fails no
    request: each decodes on without drafts and gets the target's own output (a
    draft only proposes), the failure logged with the request ids and named in
    each such request's result."""
    target = tiny_loaded()
    eng = BuiltinEngine(target, {"broken": lambda cap: RaisingDraft(), "together": lambda cap: BrokenTogether()},
                        CONFIG, start_worker=False)
    requests = [dataclasses.replace(req(arm, prompt=p, ignore_eos=True), request_id=f"r{i}")
                for i, (arm, p) in enumerate([("broken:2", "hello world the cat"), ("together:3", "the cat the"),
                                              ("together:3", "world hello"), ("plain", "cat world")])]
    with caplog.at_level("ERROR", logger="engines.scheduler"):
        served = run_together(eng, requests, errors=True)
    assert "drafting with broken failed for r0" in caplog.text
    assert "drafting with together failed for r1, r2" in caplog.text
    plain = BuiltinEngine(tiny_loaded(), {}, CONFIG)
    try:
        expected = [plain.generate(dataclasses.replace(r, arm=Arm())).token_ids for r in requests]
    finally:
        plain.close()
    assert [r.token_ids for r in served] == expected
    assert [sum(r.stats.drafted_per_round) for r in served] == [0, 0, 0, 0]
    assert [r.stats.draft_error for r in served] == [f"drafting with {d} failed (RuntimeError): decoded on without "
                                                     "drafts" for d in ("broken", "together", "together")] + [""]
    from gateway.pbconv import result_from_pb, result_pb  # a worker's results cross the wire with it

    assert [result_from_pb(r.request_id, result_pb(r)).stats.draft_error for r in served] == [
        r.stats.draft_error for r in served]


def test_a_warm_up_times_each_model_draft_and_forgets_what_it_saw(caplog):
    """Before the loop starts, a short request under each draft: every model draft's
    seconds per drafted token measured (drafting is priced from a request's first round,
    and reported with the load beside a lone row's prices), prompt lookup's not (it
    drafts for nothing); the engine-wide calibration as before it, nothing left queued
    or running, a draft that fails there logged, and output still the target's."""
    target = tiny_loaded(scale=4.0)
    sub = LlamaModel(target.model.cfg, target.model.weights, [0, 1])
    drafts = {"ngram": lambda cap: NgramProposer(1, 3), "half": lambda cap: ModelDraftProposer(sub, cap),
              "broken": lambda cap: RaisingDraft()}
    eng = BuiltinEngine(target, drafts, CONFIG, start_worker=False)
    before = eng.load()
    assert before.drafting_s == () and len(before.lone_step_s) == CONFIG.gamma_max + 1
    assert all(0 < a <= b for a, b in zip(before.lone_step_s, before.lone_step_s[1:]))
    with caplog.at_level("ERROR", logger="engines.scheduler"):
        eng.warm_up()
    assert "drafting with broken failed for warm-up-broken" in caplog.text
    timed = dict(eng.load().drafting_s)
    assert list(timed) == ["half"] and 0 < timed["half"] < 1
    sched = eng._sched
    assert sched.calibration._tables == {} and not sched.running and not sched.waiting and sched.kv_used == 0
    eng.start()
    try:
        assert eng.generate(req("half:4")).token_ids == eng.generate(req("plain")).token_ids
        with pytest.raises(RuntimeError, match="before the decode loop"):
            eng.warm_up()  # the loop owns the scheduler now
    finally:
        eng.close()


def test_a_row_that_fails_in_a_shared_step_fails_alone():
    """A bug in one row's verification (here a proposal whose draft distribution has the
    wrong shape) fails that request, not the others decoding in the same steps."""
    target = tiny_loaded()

    class Malformed(ProposerBase):
        def propose(self, context, gamma, sampling, generator):
            return Proposal(torch.tensor([5, 6]), torch.zeros(1, 3), None)

    eng = BuiltinEngine(target, {"bad": lambda cap: Malformed()}, CONFIG, start_worker=False)
    bad = dataclasses.replace(req("bad:2", temperature=0.8, seed=1, ignore_eos=True), request_id="bad",
                              fixed_gamma=True)  # verified whole, whatever the budget
    served = run_together(eng, [req(ignore_eos=True), bad, req(temperature=0.8, seed=2, ignore_eos=True)], errors=True)
    assert isinstance(served[1], EngineError) and "internal error in request bad" in str(served[1])
    assert [r.stats.output_tokens for r in served[::2]] == [12, 12]


def test_a_shared_forward_that_fails_is_rerun_in_halves_and_fails_only_its_culprit(caplog):
    """A batch's forward that raises (as one too large for the memory left would) is rerun
    in halves, not row by row: every request still gets the output it gets unbatched, and
    where a row's own forward raises (here the row of request "bad", whatever it is batched
    with) that request alone fails, the engine serving on."""
    # the sampled row verifies its whole draft every round: its draws then do not hang on the budget
    requests = [dataclasses.replace(req(arm, prompt=p, temperature=t, seed=3, max_tokens=16, ignore_eos=True),
                                    request_id=f"r{i}", fixed_gamma=t > 0)
                for i, (arm, p, t) in enumerate([("plain", "hello world the cat", 0.0),
                                                 ("ngram:4", "the cat the cat the", 0.0),
                                                 ("half:3", "world hello cat", 0.8)])]

    def engine():
        target = tiny_loaded(scale=4.0)
        sub = LlamaModel(target.model.cfg, target.model.weights, [0, 1])
        return BuiltinEngine(target, {"ngram": lambda cap: NgramProposer(1, 3),
                                      "half": lambda cap: ModelDraftProposer(sub, cap)}, CONFIG, start_worker=False)
    alone = [run_together(engine(), [r])[0] for r in requests]

    ran = []  # rows of every forward: negative where it failed

    def engine_whose_forward(fails):
        eng = engine()
        model, forward = eng._sched.model, eng._sched.model.forward_many

        def flaky(items, **kw):
            out = forward(items, **kw)  # failing late: the caches already written and advanced
            if fails(items, eng._sched):
                ran.append(-len(items))
                raise RuntimeError("out of memory")
            ran.append(len(items))
            return out
        model.forward_many = flaky
        return eng

    with caplog.at_level("WARNING", logger="engines.forwards"):
        batched = run_together(engine_whose_forward(lambda items, _: len(items) > 2), requests)
    assert "rerunning them in halves" in caplog.text
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]
    # every failed forward of three rows ran again as a half of one and a half of two, not as three of one
    after = [ran[i + 1:i + 3] for i, n in enumerate(ran) if n < 0]
    assert after and all(a == [1, 2] for a in after), ran

    def bad_row(items, sched):
        bad = {id(r.cache) for r in sched.running if r.handle.request_id == "bad"}
        return any(id(cache) in bad for _, cache, *_ in items)
    culprit = dataclasses.replace(requests[0], request_id="bad")
    served = run_together(engine_whose_forward(bad_row), [requests[1], culprit, requests[2]], errors=True)
    assert isinstance(served[1], EngineError) and "internal error in request bad" in str(served[1])
    assert [r.token_ids for r in served[::2]] == [alone[1].token_ids, alone[2].token_ids]


def test_tokenizer_mismatch_names_the_first_differing_token():
    other = tiny_tokenizer(WORDS[:5] + ["dog"] + WORDS[6:])
    with pytest.raises(TokenizerMismatch, match=r"token id 5 is 'w3' for the target and 'dog'"):
        check_tokenizers_match(tiny_tokenizer(), other, "d")
    check_tokenizers_match(tiny_tokenizer(), tiny_tokenizer(), "same")  # no error


def test_async_consumers_see_the_same_stream(engine):
    import asyncio

    async def consume():
        h = engine.submit(req("ngram:3"))
        text = "".join([d.text async for d in h])
        return text, await h.result(10)

    text, res = asyncio.run(consume())
    assert text == res.text and res.token_ids == engine.generate(req("ngram:3")).token_ids


def test_async_result_honours_its_timeout():
    import asyncio

    from tests.helpers import slow_engine

    eng = slow_engine(step_s=0.05)
    try:
        h = eng.submit(req("slow:1", prompt="hello world", max_tokens=80, ignore_eos=True))
        with pytest.raises(TimeoutError):
            asyncio.run(h.result(timeout=0.2))
        assert h.cancelled  # a timed-out wait frees the slot
        assert h.wait(10).stats.finish_reason == "cancelled"
    finally:
        eng.close()
