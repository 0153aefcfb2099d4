"""Engine tokens/s of one arm at a fixed batch, timed over scheduler steps after
prefill: no gateway, no clients, so two checkouts (or two configs, --config)
can be compared step for step (an A/B of an engine change). Run this file
against each checkout in turn, alternating (PYTHONPATH names the checkout whose
engine is timed):

    PYTHONPATH=. .venv/bin/python bench/steps.py --arm plain --concurrency 16 --temperature 0.7
    PYTHONPATH=../other .venv/bin/python bench/steps.py --arm plain --concurrency 16 --temperature 0.7
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def spread(rows: list[dict], concurrency: int, offset: int = 0) -> list[str]:
    """`concurrency` dev prompts spread over the split from `offset` (their first 400 characters)."""
    return [r["turns"][0][:400] for r in rows[offset:: max(len(rows) // concurrency, 1)]][:concurrency]


def timed_pass(engine, prompts: list[str], arm: str, temperature: float, steps: int, tag: str, spare: int = 24,
               timing=None) -> float:
    """The prompts submitted together under `arm` to an engine whose scheduler is driven
    by hand, prefilled, then `steps` scheduler steps timed (tokens/s over them), then
    drained. `timing(True)` and `timing(False)` bracket the timed steps; each request
    may write `steps + spare` tokens."""
    from engines.api import ChatMessage, GenerationRequest, SamplingParams
    from engines.arms import Arm

    sched = engine._sched
    for i, p in enumerate(prompts):
        engine.submit(GenerationRequest(
            request_id=f"{tag}-{i}", messages=(ChatMessage("user", p),), arm=Arm.parse(arm),
            sampling=SamplingParams(max_tokens=steps + spare, temperature=temperature, seed=i, ignore_eos=True)))
        sched.waiting.append(engine._queue.get_nowait())
    sched.admit()
    while any(r.prefilled < r.prompt_len for r in sched.running):
        sched.step()
    if timing:
        timing(True)
    before, t0 = sum(r.produced for r in sched.running), time.perf_counter()
    for _ in range(steps):
        sched.step()
    rate = (sum(r.produced for r in sched.running) - before) / (time.perf_counter() - t0)
    if timing:
        timing(False)
    while sched.running:
        sched.step()
    return rate


def run(arm: str, concurrency: int, temperature: float, steps: int, passes: int, data: Path,
        config: str | None = None) -> tuple[list[float], str]:
    """tok/s per pass, and the start-up profile the engine chose."""
    from engines.builtin import BuiltinEngine
    from engines.config import load_engine_config

    engine = BuiltinEngine.from_config(load_engine_config(config), start_worker=False)
    rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    prompts = spread(rows, concurrency)
    out = [timed_pass(engine, prompts, arm, temperature, steps, str(n)) for n in range(passes)]
    engine.close()
    return out, engine.profile.describe()


def main() -> int:
    from bench import cpu_model, default_data_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", default="plain", help="plain or DRAFT:G (default: %(default)s)")
    ap.add_argument("--concurrency", type=int, default=16, help="rows decoding together (default: %(default)s)")
    ap.add_argument("--temperature", type=float, default=0.7, help="(default: %(default)s)")
    ap.add_argument("--steps", type=int, default=40, help="steps timed per pass (default: %(default)s)")
    ap.add_argument("--passes", type=int, default=3, help="(default: %(default)s)")
    ap.add_argument("--data", default=str(default_data_path()), help="Spec-Bench JSONL (default: %(default)s)")
    ap.add_argument("--config", help="engine config YAML (default: the built-in SmolLM2 config)")
    a = ap.parse_args()
    tps, profile = run(a.arm, a.concurrency, a.temperature, a.steps, a.passes, Path(a.data), a.config)
    print(f"machine: {cpu_model()}; start-up profile: {profile}")
    print(f"{a.arm} at concurrency {a.concurrency}, T={a.temperature:g}: "
          f"{' '.join(f'{x:.1f}' for x in tps)} tok/s per pass")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
