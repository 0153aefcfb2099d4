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

    from bench import default_data_path
    from bench.routes import alternated
    from engines.builtin import BuiltinEngine
    from engines.config import load_engine_config
    from engines.proposers.eagle import EagleProposer

    engine = BuiltinEngine.from_config(load_engine_config(config), start_worker=False)
    eagles = [p.draft for f in engine.drafts.values() if isinstance(p := f(1), EagleProposer)]
    if not eagles or eagles[0].context is None:
        raise SystemExit("no EAGLE draft with a context bound (its card's training seq_len) in this config")
    bound = eagles[0].context
    rows = long_prompts(engine, [json.loads(x) for x in default_data_path().read_text().splitlines() if x.strip()],
                        bound, prompts)

    def switch(bounded: bool) -> None:
        for e in eagles:
            e.context = bound if bounded else None
    try:
        out = alternated(engine, rows, rounds, switch, arms, max_tokens)
    finally:
        switch(True)
        engine.close()
    cats = sorted({r["category"] for r in rows})
    return out, (f"{len(rows)} prompts longer than the bound of {bound} positions (from {', '.join(cats)}), "
                 f"{max_tokens} tokens each; " + engine.profile.describe())


def main() -> int:
    from bench import cpu_model
    from bench.routes import print_alternated

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
    print_alternated(res, "whole prompt", "bounded")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
