"""The `specgate` command line.

Each command lives in a module of its package with `add_arguments(parser)` and
`main(args)`; only the chosen command's module is imported, so a light command
(`specgate health`, the container probe run every few seconds) never pays for
torch, transformers or scikit-learn.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). The module's docstring is the command's --help description.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("gateway.cmd_serve", "run the gateway (default: built-in engine on SmolLM2, loopback, no keys)"),
    "engine": ("gateway.cmd_engine", "serve a built-in engine to gateways over the internal gRPC API"),
    "generate": ("gateway.cmd_generate", "call a gateway and print the text, decision and stats"),
    "decide": ("gateway.cmd_decide", "ask a gateway which arm it would choose, and why"),
    "status": ("gateway.cmd_status", "engines, arms, load and versions of a gateway"),
    "health": ("gateway.cmd_health", "exit 0 if a gateway or engine worker answers the gRPC health check as "
                                     "SERVING (container probe; needs no API key)"),
    "retrain": ("telemetry.cmd_retrain", "learn policy models from the outcome stream; promote the better ones"),
    "rollback": ("telemetry.cmd_rollback", "make an earlier policy model version live again"),
    "report": ("telemetry.cmd_report", "does it pay? outcomes per category and arm, predicted against realised"),
    "rules": ("policy.cmd_rules", "validate operator rules, or explain which rule a request hits"),
    "policy": ("policy.cmd_policy", "train the prompt category classifier"),
    "engine-generate": ("engines.cmd_generate", "generate with the built-in engine in this process"),
    "distill": ("engines.cmd_distill", "train a draft for the target (EAGLE-style head) and write it with its card"),
    "bench": ("bench.specbench.cli", "end to end on Spec-Bench: fixed arms, adaptive, the oracle, the learning "
                                     "curve; JSON, Markdown and plots"),
    "bench-replay": ("bench.specbench.replay", "what a policy would have realised on a bench run's concurrency-1 "
                                               "requests, offline"),
    "bench-gate": ("bench.specbench.gate", "the retrainer's promotion gate replayed on learning streams priced by "
                                           "bench runs' measurements, offline"),
    "bench-engine": ("bench.engine", "every arm against plain and HF generate on Spec-Bench prompts"),
    "bench-load": ("bench.load", "throughput and latency of every arm at concurrency 1..32"),
    "bench-gateway": ("bench.gateway", "gateway added latency and echo-engine throughput"),
    "bench-policy": ("bench.policy", "decision latency (features with classifier, plus decide)"),
    "bench-telemetry": ("bench.telemetry", "retraining time, publish-to-live latency, outcome write cost"),
    "bench-chaos": ("bench.chaos", "fault and load drill: saturation, bad input, Redis and worker kills, SIGTERM"),
}


def _chosen(argv: list[str]) -> str | None:
    """The command named on the command line (the first word that is one)."""
    return next((a for a in argv if a in COMMANDS), None)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specgate", description="Adaptive speculative decoding for LLM serving: "
                                "a gateway that chooses, per request, how to decode it.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = _chosen(argv)
    for name, (module, helptext) in COMMANDS.items():
        if name != chosen:
            sub.add_parser(name, help=helptext)
            continue
        mod = importlib.import_module(module)
        sp = sub.add_parser(name, help=helptext, description=mod.__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(sp)
        sp.set_defaults(func=mod.main)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    from gateway.logs import configure_logging

    configure_logging(args.verbose)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
