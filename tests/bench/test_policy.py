"""`specgate bench-policy`: decision latency in this process, or pooled over fresh
processes with an interval that resamples whole processes."""

import argparse
import random

from bench import policy
from tests.conftest import SPECBENCH
from tests.helpers import REPO


def test_the_interval_resamples_whole_processes_and_judges_the_target():
    rng = random.Random(0)
    # two quick processes and one whose tail is slow: the pooled p99 is the slow one's, and only an
    # interval over processes shows how much it depends on drawing that process
    procs = [{k: [rng.uniform(1e-4, 3e-4) for _ in range(1000)] for k in policy.PARTS} for _ in range(2)]
    procs.append({k: [rng.uniform(1e-4, 3e-4) for _ in range(950)] + [9e-4] * 50 for k in policy.PARTS})
    res = policy.across(procs)
    lo, hi = res["total"]["p99_interval_ms"]
    per = res["total"]["p99_per_process_ms"]
    assert per[2] == 0.9 and max(per[:2]) < 0.3
    assert lo < 0.3 and hi == 0.9 and lo <= res["total"]["p99_ms"] <= hi and res["n"] == 3000
    assert [policy.verdict([lo, hi], t) for t in (1.0, 0.5, 0.25)] == ["met", "undecided", "missed"]


def test_a_run_over_fresh_processes_prints_each_and_the_verdict(specbench_rows, capsys):
    parser = argparse.ArgumentParser()
    policy.add_arguments(parser)
    args = parser.parse_args(["--data", str(SPECBENCH), "--repeats", "1", "--processes", "2",
                              "--rules", str(REPO / "policy" / "default_rules.yaml")])
    assert policy.main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("machine: ") and "process 2/2: total p99" in out
    assert f"{2 * len(specbench_rows)} decisions in 2 processes" in out and "total p99 <= 0.5 ms: " in out
