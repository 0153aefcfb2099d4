"""bench/fused.py: both sides of every request are served, the switch reaches every
decoder the engine runs, and the ratios are taken side against side."""

import numpy as np
import torch

from bench.fused import main, requests, switch
from bench.rounds import over
from engines.builtin import drive_from_side_thread
from engines.fused import fused_ops
from engines.proposers import NgramProposer
from tests.helpers import engine_over, lean_from_hf, tiny_hf_model


def test_requests_serve_both_sides_and_switch_every_decoder():
    ops = fused_ops()
    assert ops is not None, "every machine the tests run on has a C compiler"
    target = lean_from_hf(tiny_hf_model(seed=0, scale=4.0, dtype=torch.float32), torch.float32)
    engine = engine_over(target, ngram=lambda cap: NgramProposer(1, 3))
    rows = [{"question_id": i, "category": c, "turns": [t]}
            for i, (c, t) in enumerate([("coding", "w1 w2 w3 w1 w2 w3 w1 w2"), ("qa", "hello world the cat sat")])]
    out = drive_from_side_thread(engine, lambda: requests(engine, ops, rows, ["plain", "ngram:4"], 0.0, 12, 2,
                                                          lambda msg: None))
    assert engine.decoders == (target,) and target.fused is ops  # left on, as the engine runs
    for on in (False, True):
        # greedy and lossless on each side: lookup writes plain's tokens, prompt by prompt
        assert (out["ngram:4", on]["tokens"] == out["plain", on]["tokens"]).all()
        assert out["plain", on]["tokens"].min() > 0 and (out["plain", on]["seconds"] > 0).all()
    switch(engine, False, ops)
    assert target.fused is None
    assert over(out["plain", True], out["plain", True]) == [1.0, 1.0, 1.0]
    x, lo, hi = over(out["plain", True], out["plain", False])
    assert lo <= x <= hi and np.isfinite([x, lo, hi]).all()


def test_a_mode_it_cannot_parse_is_refused_before_any_model_is_loaded(capsys):
    assert main(["--modes", "eagle:6/sometimes"]) == 2
    assert "eagle:6/sometimes" in capsys.readouterr().err
