"""bench: the benchmarks behind the README's figures (the top layer: it imports everything).

    engine.py      every arm against plain decoding and HF generate, per Spec-Bench category
    load.py        throughput and latency of every arm at concurrency 1..32 (continuous batching)
    rounds.py      where a draft's rounds go (none, declined, k verified): adaptive γ beside fixed
    steps.py       engine tokens/s of one arm at a fixed batch, step by step: A/B of two checkouts
    stepcost.py    the step-cost model's prices against forwards it was not fitted on
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
    """lscpu's model name with its family/model numbers and widest vector ISA, and
    the core count, for every benchmark's output: machines that lscpu names alike
    ("AMD EPYC") have differed 3x in step time."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        return describe_cpu(dict(line.split(":", 1) for line in out.splitlines() if ":" in line))
    except (OSError, subprocess.SubprocessError, ValueError):
        return platform.processor() or "unknown CPU"


def describe_cpu(fields: dict[str, str]) -> str:
    """`AMD EPYC (family 26 model 2, AVX-512), 2 CPUs` from lscpu's fields."""
    f = {k.strip(): v.strip() for k, v in fields.items()}
    name = f.get("Model name") or platform.processor() or "unknown CPU"
    flags = set(f.get("Flags", "").split())
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else None
    detail = []
    if f.get("CPU family") and f.get("Model"):
        detail.append(f"family {f['CPU family']} model {f['Model']}")
    if isa:
        detail.append(isa)
    if detail:
        name += " (" + ", ".join(detail) + ")"
    return f"{name}, {f.get('CPU(s)', '?')} CPUs"
