"""The fault and load drill, scaled down: every phase runs against real
processes and nothing fails with a wrong code."""

import argparse

from bench import chaos


def test_a_small_drill_passes(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    chaos.add_arguments(parser)
    args = parser.parse_args(["--limit", "6", "--extra", "3", "--malformed", "1", "--out", str(tmp_path / "c.json")])
    assert chaos.main(args) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert "| saturation | 9 | 6 | 3 | 0 |" in out and "failed wrongly" in out
