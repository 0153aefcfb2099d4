"""`specgate bench`: arguments and the order of the phases.

1. learning curve (own gateway, cold start): the workload streamed through
   the adaptive policy while the retrainer learns from its outcomes;
2. concurrency 1: every request under every fixed arm and adaptive,
   interleaved, in two passes; the per-request oracle comes from these (and
   the held-out oracle, each pass's arms chosen on the other);
3. each higher concurrency: every mode over the whole workload.
Then the temperature-0 identity check, JSON, Markdown and plots. Exit status 3
when a temperature-0 request came out differently under two modes.

With the defaults (39 Spec-Bench dev prompts, plain and each draft with the
engine's adaptive γ as fixed configurations, adaptive, 200 learning requests,
concurrency 1 and 16, two passes at 1 and three rotated passes at 16) it takes
25-80 minutes on 2 CPU cores, by machine; every ratio comes with a 95%
interval (more --repeats narrow them);
`--learning-curve 0 --per-category 1 --max-tokens 64` is a quick look.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import grpc

from bench import cpu_model, default_data_path
from bench.specbench import analysis, report
from bench.specbench.runner import (
    ADAPTIVE,
    Progress,
    call,
    engine_prices,
    rotated,
    run_concurrent,
    run_interleaved,
    run_stream,
)
from bench.specbench.workload import WorkloadError, build_workload, read_rows
from engines.arms import Arm, DraftKind
from engines.errors import InvalidRequest
from gateway.pb import specgate_pb2_grpc as pb_grpc

# Fixed configurations: plain, and each draft with the engine adapting γ per round up to its bound
DEFAULT_ARMS = ("plain", "ngram:8", "eagle:6", "ngram-eagle:8")
EXIT_MISMATCH = 3


def add_arguments(p) -> None:
    p.add_argument("--address", help="bench a running gateway at HOST:PORT (default: start gateway, Redis and "
                                     "retrainer here, with the built-in engine on SmolLM2)")
    p.add_argument("--api-key", default=os.environ.get("SPECGATE_API_KEY"), help="for --address (default: "
                                                                                   "$SPECGATE_API_KEY)")
    p.add_argument("--data", default=str(default_data_path()), help="workload JSONL (default: %(default)s)")
    p.add_argument("--per-category", type=int, default=3, help="rows per category; 0 = all (default: %(default)s)")
    p.add_argument("--skip", type=int, default=0,
                   help="skip each category's first N rows (default: %(default)s; --skip 3 --no-adaptive "
                        "measures the prompts the default workload does not use, which the shipped prior was fit "
                        "on)")
    p.add_argument("--categories", nargs="*", help="only these categories")
    p.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS),
                   help="fixed arms to compare, plain first (default: %(default)s)")
    p.add_argument("--no-adaptive", action="store_true", help="fixed arms only")
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 0.7, 1.0],
                   help="dealt round-robin within each category (default: %(default)s)")
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 16],
                   help="levels; 1 interleaves modes per request (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128, help="(default: %(default)s)")
    p.add_argument("--repeats", type=int,
                   help="passes over the workload per level (default: 2 at concurrency 1, where every request is "
                        "interleaved across modes, the intervals come from resampling requests and the held-out "
                        "oracle chooses each pass's arms on the other; 3 above it, where each rotated pass gives "
                        "one ratio per mode and the interval is over passes)")
    p.add_argument("--seed", type=int, default=0, help="request seeds derive from it (default: %(default)s)")
    p.add_argument("--category-hints", action="store_true",
                   help="send the dataset's category as the request's hint (default: the gateway classifies)")
    p.add_argument("--learning-curve", type=int, metavar="N",
                   help="first stream N adaptive requests from a cold start with retraining live; 0 = skip "
                        "(own gateway only; default: 200 with its own cold gateway, else 0)")
    p.add_argument("--window", type=int, default=50, help="learning-curve rolling window (default: %(default)s)")
    p.add_argument("--retrain-every", type=int, default=25,
                   help="own gateway: outcomes between retrainings (default: %(default)s)")
    p.add_argument("--retrain-min-rows", type=int, default=50,
                   help="own gateway: outcomes before the first retraining (default: %(default)s)")
    p.add_argument("--policy", help="own gateway: start from this policy model JSON instead of cold")
    p.add_argument("--rules", help="own gateway: operator rules YAML (default: the shipped default rules)")
    p.add_argument("--engine-config",
                   help="own gateway: EngineConfig YAML (default: SmolLM2 with the ngram, eagle and selfspec drafts)")
    p.add_argument("--timeout", type=float, default=600, help="per-request deadline, s (default: %(default)s)")
    p.add_argument("--out-dir", default="bench-out/e2e", help="JSON, report.md and plots (default: %(default)s)")


def _check_args(args) -> str | None:
    if not args.arms or args.arms[0] != "plain":
        return "--arms must start with plain (every ratio is against it)"
    for a in args.arms:
        try:
            Arm.parse(a)
        except InvalidRequest as e:
            return f"--arms: {e}"
    if len(set(args.arms)) != len(args.arms):
        return "--arms: duplicates"
    if any(c < 1 for c in args.concurrency) or (args.repeats is not None and args.repeats < 1) or args.max_tokens < 1:
        return "--concurrency, --repeats and --max-tokens must be positive"
    if args.skip < 0 or args.per_category < 0:
        return "--skip and --per-category cannot be negative"
    if args.address and args.learning_curve:
        return "the learning curve needs a cold gateway this command starts: drop --address or pass " \
               "--learning-curve 0"
    if args.policy and args.learning_curve:
        return "--policy starts from a trained model; the learning curve starts cold: pass --learning-curve 0"
    if args.learning_curve and args.no_adaptive:
        return "--no-adaptive and --learning-curve exclude each other"
    return None


def main(args) -> int:
    if args.learning_curve is None:
        args.learning_curve = 0 if (args.address or args.policy or args.no_adaptive) else 200
    err = _check_args(args)
    if err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        requests = build_workload(read_rows(args.data), args.per_category or None, args.temperatures, args.seed,
                                  args.categories, args.skip)
    except (WorkloadError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    modes = list(args.arms) + ([] if args.no_adaptive else [ADAPTIVE])
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    stack = None
    if not args.address:
        from bench.specbench.stack import Stack, StackError

        say(f"starting redis-server, gateway and retrainer (logs in {out_dir}/) ...")
        try:
            stack = Stack(policy=args.policy, rules=args.rules, engine_config=args.engine_config,
                          retrain_every=args.retrain_every, retrain_min_rows=args.retrain_min_rows, log_dir=out_dir)
        except (StackError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    address = args.address or stack.address
    try:
        return _run(args, requests, modes, address, stack, out_dir, say)
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    finally:
        if stack is not None:
            stack.close()


def _run(args, requests, modes, address, stack, out_dir: Path, say) -> int:
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.GatewayStub(channel)
    metadata = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else None

    def send(r, mode, seed_offset):
        return call(stub, r, mode, args.max_tokens, category_hint=args.category_hints, timeout_s=args.timeout,
                    seed_offset=seed_offset, metadata=metadata)

    say(f"{len(requests)} requests x modes {modes}; gateway {address}")
    for mode in modes:  # warm-up: first calls pay for lazy initialisation
        m = call(stub, requests[0], mode, 8, timeout_s=args.timeout, metadata=metadata)
        if "error" in m:
            print(f"error: warm-up request under {mode} failed: {m['error']}", file=sys.stderr)
            return 1

    t_start = time.time()
    stream: list[dict] = []
    if args.learning_curve and ADAPTIVE in modes:
        items = [(k, requests[k % len(requests)]) for k in range(args.learning_curve)]
        stream = run_stream(send, items, Progress(len(items), "learning"))

    c1: list[dict] = []
    if 1 in args.concurrency:
        c1 = run_interleaved(send, requests, modes, repeats_at(args, 1),
                             Progress(len(requests) * len(modes) * repeats_at(args, 1), "c=1"))
    runs: list[dict] = []
    for c in sorted(set(args.concurrency) - {1}):
        prog = Progress(len(requests) * len(modes) * repeats_at(args, c), f"c={c}")
        for rep in range(repeats_at(args, c)):
            for mode in rotated(modes, rep):
                wall, ms = run_concurrent(send, requests, mode, c, rep, prog)
                runs.append(dict(concurrency=c, mode=mode, repeat=rep, wall_s=wall, measurements=ms))
    prices = engine_prices(stub, metadata)
    channel.close()

    fixed = list(args.arms)
    summary = summarize(args, requests, modes, fixed, c1, runs, stream, address, prices)
    summary["elapsed_s"] = round(time.time() - t_start, 1)
    if stack is not None:
        policy = stack.live_policy_json()
        if policy:
            (out_dir / "policy.json").write_text(policy)
            summary["learned_policy"] = str(out_dir / "policy.json")
    summary["plots"] = report.plots(summary, out_dir)
    (out_dir / "bench.json").write_text(json.dumps(summary, indent=1))
    (out_dir / "report.md").write_text(report.markdown(summary))
    print(report.markdown(summary))
    print(f"wrote {out_dir}/bench.json, {out_dir}/report.md and {len(summary['plots'])} plots")
    errors = sum(1 for m in summary["measurements"] if "error" in m)
    if errors:
        print(f"warning: {errors} requests failed (see bench.json)", file=sys.stderr)
    if summary["greedy_mismatches"]:
        print(f"FAIL: {len(summary['greedy_mismatches'])} temperature-0 requests gave different outputs under "
              f"different modes: {summary['greedy_mismatches'][:5]}", file=sys.stderr)
        return EXIT_MISMATCH
    return 0


def coupled(args) -> bool:
    """Whether the bench's own gateway samples coupled (--engine-config with coupled_sampling):
    then every draft, not only prompt lookup, writes plain's sampled text."""
    if args.address or not args.engine_config:
        return False
    import yaml

    return bool((yaml.safe_load(Path(args.engine_config).read_text()) or {}).get("coupled_sampling"))


def is_lookup(arm: str) -> bool:
    """Whether an arm's draft is prompt lookup, by the default config's names."""
    return arm != "plain" and DraftKind.guess(arm.split(":")[0]).kind == "ngram"


def repeats_at(args, concurrency: int) -> int:
    """Passes over the workload at a level: --repeats, else 2 at concurrency 1 (the held-out
    oracle chooses on one, measures on the other) and 3 above."""
    return args.repeats or (2 if concurrency == 1 else 3)


def summarize(args, requests, modes, fixed, c1, runs, stream, address, engines: list[dict] = ()) -> dict:
    all_ms = c1 + [m for r in runs for m in r["measurements"]]
    c1_table = analysis.compare(c1, modes) if c1 else None
    conc = analysis.concurrency_table(runs)
    if c1:  # concurrency 1 in the same table, summed over the interleaved requests
        conc = {"1": {m: t for m, t in c1_table["modes"].items() if m not in ("oracle", analysis.HELD_OUT)}, **conc}
    curve = None
    if stream and c1:
        oracle_spt, plain_spt = analysis.per_request_rates(c1, fixed)
        curve = analysis.learning_curve(stream, oracle_spt, plain_spt, args.window)
    high = max(args.concurrency)
    from bench.specbench import intervals

    iv_c1 = intervals.bootstrap_c1(c1, fixed, seed=args.seed) if c1 else {}
    iv_high = {k: intervals.repeats_interval(v) for k, v in intervals.per_repeat_ratios(runs, high).items()} \
        if high > 1 else {}
    raw = {}
    for c, ms in [(1, c1)] + [(r["concurrency"], r["measurements"]) for r in runs]:
        for m in ms:
            cell = raw.setdefault(f"c{c}", {}).setdefault(m["mode"], dict(total_output_tokens=0, latencies_s=[],
                                                                           arms=[]))
            cell["total_output_tokens"] += m.get("output_tokens", 0)
            cell["latencies_s"].append(round(m["latency_s"], 4))
            if m["mode"] == ADAPTIVE:
                cell["arms"].append(m.get("arm"))
    for cell in raw.get("c1", {}).values():  # interleaved: a mode's time is the sum of its requests'
        cell["total_wall_s"] = round(sum(cell["latencies_s"]), 4)
    for r in runs:
        cell = raw[f"c{r['concurrency']}"][r["mode"]]
        cell["total_wall_s"] = round(cell.get("total_wall_s", 0) + r["wall_s"], 4)
    return dict(
        settings=dict(data=args.data, per_category=args.per_category, skip=args.skip, requests=len(requests),
                      modes=modes, temperatures=args.temperatures, concurrency=args.concurrency,
                      max_tokens=args.max_tokens,
                      repeats={str(c): repeats_at(args, c) for c in args.concurrency}, seed=args.seed,
                      category_hints=args.category_hints,
                      learning_curve=args.learning_curve, gateway=args.address or "started by the bench",
                      cpu=cpu_model(), engines=list(engines)),
        targets=analysis.targets(iv_c1, iv_high, curve, high),
        # the decode phase's ratios beside them (analysis.decoding), not judged: the targets are stated
        # in request speed
        intervals={"c1": iv_c1, "c1 decode": intervals.bootstrap_c1(analysis.decoding(c1), fixed, seed=args.seed)
                   if c1 else {}, f"c{high}": iv_high},
        greedy_mismatches=analysis.greedy_mismatches(all_ms),
        sampled_lookup=dict(zip(("compared", "mismatches"), analysis.sampled_lookup_mismatches(
            all_ms, (lambda arm: True) if coupled(args) else is_lookup)),
            drafts="every draft" if coupled(args) else "prompt lookup"),
        concurrency_1=c1_table, by_category=analysis.by_category(c1, modes) if c1 else {},
        by_temperature=analysis.by_temperature(c1, modes) if c1 else {},
        concurrency=conc, acceptance=analysis.acceptance(all_ms), learning_curve=curve, raw=raw,
        requests=[r.to_dict() for r in requests], measurements=all_ms, learning_stream=stream)
