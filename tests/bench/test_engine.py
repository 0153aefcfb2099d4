"""bench-engine's arguments (a category with no dev prompts is refused before
any model is loaded, naming the categories there are) and its cells' speeds."""

import argparse
import json

import pytest

from bench.engine import Cell, add_arguments, main, summarize
from engines.api import GenerationStats


def test_an_unknown_category_is_refused_with_the_known_ones(tmp_path, capsys):
    data = tmp_path / "dev.jsonl"
    data.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": ["hi"]}) + "\n"
                            for i, c in enumerate(("coding", "extraction"))))
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--data", str(data), "--categories", "extraction", "information_extraction"])
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "information_extraction" in err and "coding, extraction" in err


def test_the_decode_phase_is_refused_beside_hf_generate_which_does_not_time_it(tmp_path, capsys):
    data = tmp_path / "dev.jsonl"
    data.write_text(json.dumps({"question_id": 1, "category": "coding", "turns": ["hi"]}) + "\n")
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert main(p.parse_args(["--data", str(data), "--speed", "decode"])) == 2
    assert "add --no-hf" in capsys.readouterr().err


def test_a_cell_counts_the_decode_phase_and_tables_rate_either_speed():
    def stats(tokens, total, prefill):
        return GenerationStats(output_tokens=tokens, total_s=total, prefill_s=prefill)
    cells = {(0.7, "qa", "plain"): Cell(), (0.7, "qa", "ngram:8"): Cell()}
    cells[(0.7, "qa", "plain")].add(stats(11, 3.0, 1.0), prompt="1", sample=0)  # 10 after the first in 2 s
    cells[(0.7, "qa", "ngram:8")].add(stats(3, 1.2, 1.0), prompt="1", sample=0)  # 2 after the first in 0.2 s
    [run] = cells[(0.7, "qa", "ngram:8")].runs
    assert run["decode_tokens"] == 2 and run["decode_s"] == pytest.approx(0.2) and run["prompt"] == "1"
    modes = ["plain", "ngram:8"]
    by_request = summarize(cells, [], modes, [0.7], None)["tables"]["0.7"]["qa"]["ngram:8"]
    by_decode = summarize(cells, [], modes, [0.7], None, "decode")["tables"]["0.7"]["qa"]["ngram:8"]
    assert by_request["vs_plain"] == pytest.approx((3 / 1.2) / (11 / 3.0))
    assert by_decode["vs_plain"] == pytest.approx(2.0) and by_decode["tok_s"] == pytest.approx(10.0)
