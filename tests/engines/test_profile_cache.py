"""The start-up profile kept per machine: measured once, taken by a later start
with the same key (its layout put in place), measured over where the file does
not parse, check or match, its packed copies disagree, its forwards no longer
run at its figures or its runner-up now beats its choice. Where a test is not
about those last two checks their tolerances are wide (LOOSE): a tiny model's
sub-millisecond forwards are too noisy for them."""

import json

import pytest
import torch

from engines import profile_cache
from engines.layouts import Columns, RowPacked, routed, unrouted
from engines.profile import Profile
from engines.profile_cache import cpu_profile, keep, profile_key, recall
from engines.stepcost import StepCost
from tests.helpers import lean_from_hf, tiny_hf_model

LOOSE = dict(drift=1e6, rival=1e6)


@pytest.fixture
def models():
    """Two copies of one tiny float32 model (a first start and a restart), torch's threads restored after."""
    hf = tiny_hf_model(vocab=64, hidden=32)
    threads = torch.get_num_threads()
    yield lean_from_hf(hf, torch.float32), lean_from_hf(hf, torch.float32)
    torch.set_num_threads(threads)


def measured(monkeypatch) -> list:
    """The profiles measured from here on (the real choose_layout, counted)."""
    calls = []
    real = profile_cache.choose_layout

    def counting(*a, **kw):
        calls.append(real(*a, **kw))
        return calls[-1]

    monkeypatch.setattr(profile_cache, "choose_layout", counting)
    return calls


def test_a_restart_takes_the_kept_profile_with_its_layout_and_a_new_key_measures(models, tmp_path, monkeypatch):
    first, restart = models
    calls = measured(monkeypatch)
    prof = cpu_profile(first, [first.weights], True, 1, False, tmp_path)
    assert len(calls) == 1 and prof.layout == "packed" and unrouted(first.weights.layers[0].gate_up).is_mkldnn
    files = list((tmp_path / "profiles").glob("*.json"))
    assert [f.stem for f in files] == [profile_key(first, [first.weights], True, 1, False)[0]]
    assert profile_key(first, [first.weights], True, 1, False, routes=False)[0] != files[0].stem

    again = cpu_profile(restart, [restart.weights], True, 1, False, tmp_path, **LOOSE)
    assert len(calls) == 1  # nothing measured
    assert again.to_dict() == prof.to_dict() and again.cost.step(9, 1, 1) == prof.cost.step(9, 1, 1)
    head, gate_up = restart.weights.lm_head, restart.weights.layers[0].gate_up  # routed as kept, in the kept layout
    assert (head.upto if isinstance(head, Columns) else 0) == prof.head_upto
    assert [c.upto for c in routed(restart.weights)] == [prof.layers_upto] * len(routed(first.weights))
    assert all(unrouted(w).is_mkldnn for w in (head, gate_up))
    ids = torch.arange(7)
    torch.testing.assert_close(restart.forward(ids, restart.new_cache(8)), first.forward(ids, first.new_cache(8)))

    other = cpu_profile(restart, [restart.weights], False, 1, False, tmp_path)  # packing not allowed: another key
    assert len(calls) == 2 and other.layout == "dense" and not unrouted(restart.weights.layers[0].gate_up).is_mkldnn
    assert len(list((tmp_path / "profiles").glob("*.json"))) == 2
    cpu_profile(restart, [restart.weights], False, 1, False, None)  # not kept: measured, nothing written
    assert len(calls) == 3 and len(list((tmp_path / "profiles").glob("*.json"))) == 2


@pytest.mark.parametrize("spoil", ["not json {", "wrong key", "unknown layout", "non-finite price", "truncated",
                                   "MKL copies beside oneDNN packing"])
def test_a_file_that_does_not_parse_check_or_match_is_measured_over(models, tmp_path, monkeypatch, caplog, spoil):
    model = models[0]
    key = profile_key(model, [model.weights], True, 1, False)[0]
    cpu_profile(model, [model.weights], True, 1, False, tmp_path)
    path = tmp_path / "profiles" / f"{key}.json"
    d = json.loads(path.read_text())
    text = {"not json {": "not json {", "truncated": path.read_text()[:200]}.get(spoil)
    if text is None:
        if spoil == "wrong key":
            d["key"] = "0" * 20
        elif spoil == "unknown layout":
            d["profile"]["layout"] = "evil"
        elif spoil == "MKL copies beside oneDNN packing":  # only dense weights get them
            d["profile"]["packed_from"] = d["profile"]["cost"]["packed_from"] = 4
            d["profile"]["pack_s"] = {"4": [0.02, 0.01], "9": [0.03, 0.02]}
        else:
            d["profile"]["cost"]["b"] = float("nan")
        text = json.dumps(d)
    path.write_text(text)
    calls = measured(monkeypatch)
    with caplog.at_level("WARNING", logger="engines.profile_cache"):
        prof = cpu_profile(models[1], [models[1].weights], True, 1, False, tmp_path, **LOOSE)
    assert len(calls) == 1 and "not used" in caplog.text and prof.layout == "packed"
    assert Profile.from_dict(json.loads(path.read_text())["profile"]).to_dict() == prof.to_dict()  # rewritten


def test_packed_copies_that_disagree_with_dense_weights_are_not_taken(models, tmp_path, monkeypatch, caplog):
    model = models[0]
    key, parts = profile_key(model, [model.weights], "auto", 1, False)
    lone = {n: 0.01 * n for n in range(1, 10)}
    prof = Profile(1, "dense", {"1t/dense": 0.1}, StepCost(0.01, 0.001, lone=lone, packed_from=4), 4,
                   {4: (0.02, 0.01), 9: (0.03, 0.02)})
    path = tmp_path / f"{key}.json"
    keep(path, key, parts, prof)
    assert recall(path, key, model, [model.weights], "auto", False, **LOOSE).to_dict() == prof.to_dict()
    assert isinstance(model.weights.layers[0].gate_up, RowPacked) and model.weights.layers[0].gate_up.least == 4
    monkeypatch.setattr(profile_cache, "packs_agree", lambda w: False)
    with caplog.at_level("WARNING", logger="engines.profile_cache"):
        assert recall(path, key, models[1], [models[1].weights], "auto", False, **LOOSE) is None
    assert "disagree" in caplog.text and isinstance(models[1].weights.layers[0].gate_up, torch.Tensor)
    assert not models[1].weights.layers[0].gate_up.is_mkldnn


def test_a_profile_routed_by_panels_that_no_longer_build_here_is_measured_over(models, tmp_path, monkeypatch,
                                                                                caplog):
    model = models[0]
    key, parts = profile_key(model, [model.weights], False, 1, False)
    lone = {n: 0.01 * n for n in range(1, 10)}
    prof = Profile(1, "dense", {"1t/dense": 0.1}, StepCost(0.01, 0.001, lone=lone, columns_upto=3), None, {}, 3,
                   {3: (0.02, 0.01)}, 2, {2: (0.01, 0.005)}, True, {3: (0.015, 0.01)})
    path = tmp_path / f"{key}.json"
    keep(path, key, parts, prof)
    assert recall(path, key, model, [model.weights], False, False, **LOOSE).to_dict() == prof.to_dict()
    assert all(c.on_panels for c in routed(model.weights)) and model.weights.lm_head.on_panels  # as kept
    monkeypatch.setattr(profile_cache, "kernel", lambda: None)  # no compiler on this start
    with caplog.at_level("WARNING", logger="engines.profile_cache"):
        assert recall(path, key, models[1], [models[1].weights], False, False, **LOOSE) is None
    assert "did not build" in caplog.text and not routed(models[1].weights)


def test_a_profile_whose_forwards_no_longer_run_at_its_figures_is_measured_over(models, tmp_path, monkeypatch,
                                                                                caplog):
    """Kept while something else ran on the cores: every figure ~10x too high."""
    first, restart = models
    prof = cpu_profile(first, [first.weights], False, 1, False, tmp_path)
    key = profile_key(first, [first.weights], False, 1, False)[0]
    path = tmp_path / "profiles" / f"{key}.json"
    d = json.loads(path.read_text())
    d["profile"]["step_s"] = {k: 10 * s for k, s in d["profile"]["step_s"].items()}
    path.write_text(json.dumps(d))
    calls = measured(monkeypatch)
    with caplog.at_level("WARNING", logger="engines.profile_cache"):
        again = cpu_profile(restart, [restart.weights], False, 1, False, tmp_path)
    assert len(calls) == 1 and "measuring again" in caplog.text
    assert again.step_s[again.choice] < 0.5 * 10 * prof.step_s[prof.choice]  # new figures, kept for the spoilt
    assert json.loads(path.read_text())["profile"]["step_s"] == again.step_s


@pytest.mark.parametrize("dense_now, kept", [(0.5, False), (0.95, True)])
def test_a_choice_its_runner_up_now_beats_is_measured_over(models, tmp_path, monkeypatch, dense_now, kept):
    """A profile that chose oneDNN packing (its probe 1.0 s, dense weights 1.2 s): taken
    while dense weights still lose or win by less than RIVAL, measured over once they
    win by more (a slow spell during the first profile's dense timings, say). The
    forwards' seconds are faked by layout: this is about the comparison."""
    model = models[0]
    monkeypatch.setattr(profile_cache, "probe_s",
                        lambda m: 1.0 if m.weights.layers[0].gate_up.is_mkldnn else dense_now)
    key, parts = profile_key(model, [model.weights], "auto", None, False)
    lone = {n: 0.01 * n for n in range(1, 10)}
    prof = Profile(1, "packed", {"1t/packed": 1.0, "1t/dense": 1.2}, StepCost(0.01, 0.001, lone=lone))
    path = tmp_path / f"{key}.json"
    keep(path, key, parts, prof)
    got = recall(path, key, model, [model.weights], "auto", False)
    assert (got is not None) == kept
    assert unrouted(model.weights.layers[0].gate_up).is_mkldnn == kept  # kept in place, or dense to measure over
