"""The EAGLE draft's context bound, A/B in one process: the draft reads at most
the last `context` positions of a prompt (its card's training seq_len:
engines/proposers/eagle.py) or all of it, alternating round by round.

Only prompts longer than the bound draft differently, so the bench serves those:
the dev split's prompts (first turns) that render to more tokens than the
bound, taken category by category in turn up to --prompts, each alone,
greedy, under each arm (default: the EAGLE head at fixed γ 1, where acceptance
is the draft's alone, and the hybrid with the engine's adaptive γ, as served).
Per round and arm: accepted per drafted token, drafting seconds per drafted
token (the first round's reading of the prompt included) and tokens per second
after each request's first (prefill left out); each as a bounded/unbounded
ratio, the median over rounds with a 95% bootstrap interval (bench/routes.py).

    .venv/bin/python bench/draft_context.py --rounds 3 --prompts 12
"""

from __future__ import annotations

import argparse


def long_prompts(engine, rows: list[dict], longer_than: int, n: int) -> list[dict]:
    """Up to n rows whose first turn renders to more than `longer_than` tokens, one
    category after another in turn (rag's long passages would otherwise fill it)."""
    from engines.api import ChatMessage
    from engines.text import render_chat

    by_cat: dict[str, list[dict]] = {}
    for r in rows:
        text = render_chat(engine.tokenizer, (ChatMessage("user", r["turns"][0]),))
        if len(engine.tokenizer(text, add_special_tokens=False)["input_ids"]) > longer_than:
            by_cat.setdefault(r["category"], []).append(r)
    out, queues = [], [list(v) for _, v in sorted(by_cat.items())]
    while len(out) < n and any(queues):
        for q in queues:
            if q and len(out) < n:
                out.append(q.pop(0))
    return out


def run(rounds: int, config: str | None, prompts: int, max_tokens: int, arms: list[str]) -> tuple[dict, str]:
    """Per (arm, figure): (unbounded median, bounded median, bounded/unbounded ratio per round)."""
    import json

    import numpy as np

    from bench import default_data_path
    from engines.api import ChatMessage, GenerationRequest, SamplingParams
    from engines.arms import Arm
    from engines.builtin import BuiltinEngine, drive_from_side_thread
    from engines.config import load_engine_config
    from engines.proposers.eagle import EagleProposer

    # the decode loop on this (main) thread, as `specgate serve` runs it; requests from a second
    engine = BuiltinEngine.from_config(load_engine_config(config), start_worker=False)
    eagles = [p.draft for f in engine.drafts.values() if isinstance(p := f(1), EagleProposer)]
    if not eagles or eagles[0].context is None:
        raise SystemExit("no EAGLE draft with a context bound (its card's training seq_len) in this config")
    bound = eagles[0].context
    rows = long_prompts(engine, [json.loads(x) for x in default_data_path().read_text().splitlines() if x.strip()],
                        bound, prompts)
    runs: dict[tuple, dict[bool, list[float]]] = {}

    def serve_rounds() -> None:
        for r in range(rounds):
            for bounded in ((False, True) if r % 2 == 0 else (True, False)):
                for e in eagles:  # the loop is idle: every request has ended
                    e.context = bound if bounded else None
                for arm in arms:
                    parsed, fixed = Arm.parse(arm.removesuffix("/fixed")), arm.endswith("/fixed")
                    stats = [engine.submit(GenerationRequest(
                        f"{arm}-{bounded}-{i}", SamplingParams(max_tokens=max_tokens, temperature=0.0),
                        messages=(ChatMessage("user", row["turns"][0]),), arm=parsed,
                        fixed_gamma=fixed)).wait(600).stats for i, row in enumerate(rows)]
                    drafted = max(sum(x.drafted for x in stats), 1)
                    decoding = sum(x.total_s - x.ttft_s for x in stats)  # after the first token
                    figures = {"accepted/drafted": sum(x.accepted for x in stats) / drafted,
                               "drafting ms/token": sum(x.draft_s for x in stats) / drafted * 1e3,
                               "decode tok/s": sum(x.output_tokens - 1 for x in stats) / decoding}
                    for fig, v in figures.items():
                        runs.setdefault((arm, fig), {False: [], True: []})[bounded].append(v)
    try:
        drive_from_side_thread(engine, serve_rounds)
    finally:
        for e in eagles:
            e.context = bound
        engine.close()
    out = {k: (float(np.median(v[False])), float(np.median(v[True])),
               list(np.array(v[True]) / np.array(v[False]))) for k, v in runs.items()}
    cats = sorted({r["category"] for r in rows})
    return out, (f"{len(rows)} prompts longer than the bound of {bound} positions (from {', '.join(cats)}), "
                 f"{max_tokens} tokens each; " + engine.profile.describe())


def main() -> int:
    from bench import cpu_model
    from bench.routes import interval

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each setting, alternating (default: %(default)s)")
    ap.add_argument("--prompts", type=int, default=12, help="long prompts served per arm and round "
                                                            "(default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per answer (default: %(default)s)")
    ap.add_argument("--arms", nargs="+", default=["eagle:1/fixed", "ngram-eagle:8"],
                    help="arms, /fixed for a fixed γ (default: %(default)s)")
    ap.add_argument("--config", help="engine config YAML (default: the built-in SmolLM2 config)")
    a = ap.parse_args()
    if a.rounds < 2 or a.prompts < 1:
        ap.error("--rounds must be at least 2 and --prompts at least 1")
    res, setup = run(a.rounds, a.config, a.prompts, a.max_tokens, a.arms)
    print(f"machine: {cpu_model()}; {setup}")
    for (arm, fig), (whole, bounded, ratios) in res.items():
        med, lo, hi = interval(ratios)
        print(f"{arm:16s} {fig:18s} whole prompt {whole:6.3f}  bounded {bounded:6.3f}  "
              f"ratio {med:.3f} [{lo:.3f}, {hi:.3f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
