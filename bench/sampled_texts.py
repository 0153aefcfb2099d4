"""Whether seeded sampled requests write one text whatever they are served
beside: `--concurrency` dev prompts (their first 400 characters), each with its
own seed, served together under plain decoding twice and under each `--arms`
arm once, then the first half of them alone under plain and the same arms.
Each line counts the texts equal to plain's first batch (and, alone, to
plain's alone).

The target's draws are fixed by seed and output position (engines/sampling.py:
Draws), so prompt lookup keeps plain's text given the same logits; what moves a
text is a step that rounds a row's logits differently (a forward whose token
count runs the matmuls by another kernel), which moves plain's own texts too:
the "plain again" line is the yardstick for the others.

    .venv/bin/python bench/sampled_texts.py
    .venv/bin/python bench/sampled_texts.py --arms ngram:8 ngram-eagle:8 --temperature 0.7
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench import cpu_model, default_data_path


def requests(rows: list[dict], arm: str, temperature: float, max_tokens: int) -> list:
    from engines.api import ChatMessage, GenerationRequest, SamplingParams
    from engines.arms import Arm

    return [GenerationRequest(request_id=str(i), messages=(ChatMessage("user", r["turns"][0][:400]),),
                              arm=Arm.parse(arm), sampling=SamplingParams(max_tokens=max_tokens,
                                                                          temperature=temperature, seed=1000 + i))
            for i, r in enumerate(rows)]


def together(engine, reqs: list) -> list[tuple[int, ...]]:
    """Submitted back to back, so that they share steps; their token ids."""
    handles = [engine.submit(r) for r in reqs]
    return [h.wait(600).token_ids for h in handles]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--arms", nargs="+", default=["ngram:8"], help="arms served after plain (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=16, help="prompts served together (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=1.0, help="default: %(default)s")
    p.add_argument("--max-tokens", type=int, default=96, help="default: %(default)s")
    p.add_argument("--data", type=Path, default=default_data_path(), help="the dev split (default: %(default)s)")
    p.add_argument("--config", default=None, help="engine config YAML (default: the embedded defaults)")
    args = p.parse_args(argv)
    if args.concurrency < 2 or args.temperature <= 0:
        p.error("--concurrency must be at least 2 and --temperature above 0")
    from engines.builtin import BuiltinEngine
    from engines.config import load_engine_config

    lines = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]
    rows = lines[:: max(len(lines) // args.concurrency, 1)][: args.concurrency]
    engine = BuiltinEngine.from_config(load_engine_config(args.config))
    try:
        print(f"machine: {cpu_model()}; {len(rows)} dev prompts, T={args.temperature:g}, {args.max_tokens} tokens")
        want = together(engine, requests(rows, "plain", args.temperature, args.max_tokens))

        def same(texts: list, label: str, alone: list | None = None) -> None:  # prompt by prompt
            line = f"{label:<24} {sum(a == b for a, b in zip(want, texts))} / {len(texts)} texts as plain's together"
            if alone is not None:
                line += f", {sum(a == b for a, b in zip(alone, texts))} / {len(texts)} as plain's alone"
            print(line)

        same(together(engine, requests(rows, "plain", args.temperature, args.max_tokens)), "plain again, together")
        for arm in args.arms:
            same(together(engine, requests(rows, arm, args.temperature, args.max_tokens)), f"{arm}, together")
        half, plain_alone = len(rows) // 2, None
        for arm in ["plain", *args.arms]:
            reqs = requests(rows, arm, args.temperature, args.max_tokens)[:half]
            texts = [engine.generate(r).token_ids for r in reqs]
            same(texts, f"{arm}, alone", plain_alone)
            plain_alone = plain_alone or texts
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
