"""Generate with the built-in engine in this process (no gateway): the quickest
way to try an arm. Prints the text as it comes, then the request's stats."""

from __future__ import annotations

import json
import sys


def add_arguments(g) -> None:
    g.add_argument("prompt", help="user message (chat template applied) or, with --raw, raw text")
    g.add_argument("--arm", default="plain", help="plain or DRAFT:GAMMA, e.g. ngram:4 (default: %(default)s)")
    g.add_argument("--max-tokens", type=int, default=128, help="(default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0, help="(default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0, help="(default: %(default)s)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off (default: %(default)s)")
    g.add_argument("--seed", type=int, help="(default: random, reported)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--raw", action="store_true", help="no chat template")
    g.add_argument("--config", help="engine config YAML (EngineConfig; default: SmolLM2 with its drafts)")
    g.add_argument("--json", action="store_true", help="print one JSON object with text and stats")


def main(args) -> int:
    from engines.api import ChatMessage, GenerationRequest, SamplingParams
    from engines.arms import Arm
    from engines.builtin import BuiltinEngine, drive_from_side_thread
    from engines.config import load_engine_config
    from engines.errors import EngineError

    try:
        engine = BuiltinEngine.from_config(load_engine_config(args.config), start_worker=False)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        request = GenerationRequest(
            request_id="cli",
            messages=(ChatMessage("user", args.prompt),) if not args.raw else (),
            prompt=args.prompt if args.raw else None,
            arm=Arm.parse(args.arm),
            sampling=SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                    top_k=args.top_k, seed=args.seed, stop=tuple(args.stop)),
        )
        handle = engine.submit(request)
    except EngineError as e:
        engine.close()
        print(f"error: {e}", file=sys.stderr)
        return 2

    def stream():
        for delta in handle:
            if not args.json:
                print(delta.text, end="", flush=True)
        return handle.wait()

    try:
        result = drive_from_side_thread(engine, stream)
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    stats = result.stats.to_dict()
    if args.json:
        print(json.dumps(dict(text=result.text, stats=stats)))
    else:
        print(f"\n--- arm {stats['arm']}: {stats['output_tokens']} tokens, {stats['tokens_per_s']:.1f} tok/s, "
              f"acceptance {stats['acceptance_rate']:.2f}, mean accepted length {stats['mean_accepted_length']:.2f}, "
              f"finish {stats['finish_reason']}", file=sys.stderr)
    return 0
