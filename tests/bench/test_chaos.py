"""The fault and load drill, scaled down: every phase runs against real
processes and nothing fails with a wrong code."""

import argparse
import json

from bench import chaos


def test_a_small_drill_passes(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    chaos.add_arguments(parser)
    args = parser.parse_args(["--limit", "6", "--extra", "3", "--malformed", "1", "--out", str(tmp_path / "c.json")])
    rc = chaos.main(args)
    out = capsys.readouterr()
    tail = (out.out + out.err)[-4000:]  # the drill's table and, on failure, the processes' logs
    res = json.loads((tmp_path / "c.json").read_text())
    # one assertion per target, so that a failure names the one missed
    assert res["wrong"] == [], tail
    assert res["health_p99_s"] < 0.1, tail
    assert res["rss_mb"][2] - res["rss_mb"][1] < 50, tail
    assert res["exit_code"] == 0, tail
    assert res["written"] >= res["served"], tail
    assert rc == 0, tail
    assert "| saturation | 9 | 6 | 3 | 0 |" in out.out and "failed wrongly" in out.out
