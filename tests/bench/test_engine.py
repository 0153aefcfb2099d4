"""bench-engine's arguments: a category with no dev prompts is refused before
any model is loaded, naming the categories there are."""

import argparse
import json

from bench.engine import add_arguments, main


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
