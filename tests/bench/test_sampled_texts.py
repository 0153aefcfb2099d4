"""bench/sampled_texts.py: what it counts, over a tiny engine, and the arguments it refuses."""

import threading

import pytest

from bench import sampled_texts
from engines.proposers import NgramProposer
from tests.helpers import engine_over, lean_from_hf, tiny_hf_model


def test_texts_served_together_are_counted_against_plains_prompt_by_prompt():
    engine = engine_over(lean_from_hf(tiny_hf_model()), ngram=lambda cap: NgramProposer(1, 3))
    rows = [{"turns": [f"hello world the cat {i}"]} for i in range(4)]
    t = threading.Thread(target=engine.serve_forever, daemon=True)
    t.start()
    try:
        plain = sampled_texts.together(engine, sampled_texts.requests(rows, "plain", 1.0, 12))
        lookup = sampled_texts.together(engine, sampled_texts.requests(rows, "ngram:4", 1.0, 12))
    finally:
        engine.close()
        t.join(10)
    assert len(plain) == 4 and len(set(plain)) > 1  # one seed per prompt: their own texts
    assert lookup == plain


@pytest.mark.parametrize("argv", [["--concurrency", "1"], ["--temperature", "0"]])
def test_a_single_prompt_or_greedy_decoding_is_refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        sampled_texts.main(argv)
    assert e.value.code == 2 and "--concurrency must be at least 2" in capsys.readouterr().err
