"""The `specgate` command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys


def cmd_bench_engine(args) -> int:
    from engines import bench

    return bench.main(args)


def cmd_engine_generate(args) -> int:
    from engines.api import Arm, ChatMessage, EngineError, GenerationRequest, SamplingParams
    from engines.builtin import BuiltinEngine, drive_from_side_thread
    from engines.config import EngineConfig

    config = EngineConfig()
    if args.config:
        import yaml
        from pathlib import Path

        config = EngineConfig.model_validate(yaml.safe_load(Path(args.config).read_text()) or {})
    engine = BuiltinEngine.from_config(config, start_worker=False)
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
        return handle.result()

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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specgate", description="Adaptive speculative decoding for LLM serving.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    from engines import bench

    b = sub.add_parser("bench-engine", help="benchmark every arm against plain and HF generate on Spec-Bench",
                       description=bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_arguments(b)
    b.set_defaults(func=cmd_bench_engine)

    from engines import bench_load

    bl = sub.add_parser("bench-load", help="throughput and latency of every arm at concurrency 1..32",
                        description=bench_load.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_load.add_arguments(bl)
    bl.set_defaults(func=lambda args: bench_load.main(args))

    g = sub.add_parser("engine-generate", help="generate with the built-in engine in this process")
    g.add_argument("prompt", help="user message (chat template applied) or, with --raw, raw text")
    g.add_argument("--arm", default="plain", help="plain or DRAFT:GAMMA, e.g. ngram:4 (default: %(default)s)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--raw", action="store_true", help="no chat template")
    g.add_argument("--config", help="engine config YAML")
    g.add_argument("--json", action="store_true", help="print one JSON object with text and stats")
    g.set_defaults(func=cmd_engine_generate)

    from gateway import commands
    from policy import cli as policy_cli

    commands.add_commands(sub)
    policy_cli.add_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from gateway.interceptors import RequestIdFilter

    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())  # every line says which request it belongs to
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"))
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, handlers=[handler])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
