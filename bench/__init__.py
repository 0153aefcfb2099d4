"""bench: the benchmarks behind the README's figures (the top layer: it imports everything).

    engine.py      every arm against plain decoding and HF generate, per Spec-Bench category
    load.py        throughput and latency of every arm at concurrency 1..32 (continuous batching)
    gateway.py     the gateway's added latency and echo-engine throughput
    policy.py      decision latency
    telemetry.py   retraining time, publish-to-live latency, outcome write cost
    specbench/     `specgate bench`: end to end against fixed arms and the per-request oracle

Every benchmark prints the machine's CPU model (`lscpu`): figures from different
machines are not comparable.
"""

from __future__ import annotations

import functools
import platform
import subprocess
from pathlib import Path


def default_data_path() -> Path:
    """The dev split in shared/data beside the checkout (where CI and the dev machines put it)."""
    return Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "specbench-dev.jsonl"


@functools.cache
def cpu_model() -> str:
    """lscpu's model name (with the core count), for every benchmark's output."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        name = fields.get("Model name", "").strip() or platform.processor() or "unknown CPU"
        return f"{name}, {fields.get('CPU(s)', '?').strip()} CPUs"
    except (OSError, subprocess.SubprocessError, ValueError):
        return platform.processor() or "unknown CPU"
