"""Replay the retrainer's promotion gate on `specgate bench` runs, offline.

Each stream is a learning curve as the bench serves one: the runs' requests one
after another at concurrency 1 (every pass over them in an order of the
stream's own), decided by the live model, each outcome a recorded
concurrency-1 measurement of the draft it chose, drawn from one of the runs at
random (runs of one workload measured each request under each arm once apiece:
several runs give the noise a live stream meets). From `--min-rows` rows on,
every `--every` rows policy.train.judge judges a candidate against the live
model as the retrainer does, and a promotion makes the candidate live. Every
model a stream promotes, and the one it ends with, is priced by replaying it on
the runs' mean measurements (bench/specbench/replay.py): did the gate make the
policy faster or slower than the model it replaced?

Each outcome says what its rounds would have taken undrafted, from the same
run's plain measurement of the request (the built-in engine reports its
speculation's cost for this). Its limits: a measurement keeps its totals, not
its rounds, so the tokens a round tried are taken as those it accepted plus one
rejection per round that drafted more than it kept; outcomes carry no load; and
the streams reuse the runs' few requests, so a model is judged on requests it
has seen.
"""

from __future__ import annotations

import json
import random
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from bench.specbench.replay import features_of, first_passes, fixed_menu, replay, workload_of
from bench.specbench.workload import WorkloadError


def mean_run(benches: list[dict]) -> dict:
    """One run whose concurrency-1 measurements are the runs' means per request and arm."""
    ms = [first_passes(b) for b in benches]
    keys = set.intersection(*(set(m) for m in ms))
    mean = [dict(idx=i, mode=a, concurrency=1, repeat=0,
                 output_tokens=float(np.mean([m[(i, a)]["output_tokens"] for m in ms])),
                 latency_s=float(np.mean([m[(i, a)]["latency_s"] for m in ms]))) for i, a in sorted(keys)]
    return dict(benches[0], measurements=mean)


def training_row(features, decision, m: dict, request_id: str, plain: dict | None = None):
    """What the retrainer would learn from a request served as measurement `m`; `plain`,
    the same run's plain measurement of the request, says what its rounds would have
    taken undrafted (what the built-in engine reports as its speculation's cost)."""
    from policy.train import TrainingRow

    rounds, accepted, drafted = max(int(m["rounds"]), 1), int(m["accepted"]), int(m["drafted"])
    plain_s = None
    if plain is not None and plain["output_tokens"] > 1:
        plain_s = rounds * (plain["latency_s"] - plain.get("ttft_s", 0.0)) / (plain["output_tokens"] - 1)
    return TrainingRow(features=features, arm=decision.arm, propensity=decision.propensity,
                       output_tokens=int(m["output_tokens"]), rounds=rounds,
                       decode_s=max(m["latency_s"] - m.get("ttft_s", 0.0), 1e-3), request_id=request_id,
                       trials=accepted + min(rounds, max(drafted - accepted, 0)), accepted=accepted,
                       verified=drafted, plain_s=plain_s)


class GateReplay:
    """The runs, their requests and the menu: streams to serve and models to price."""

    def __init__(self, benches: list[dict], requests, rules, classifier, draws: int = 40):
        modes = [tuple(b["settings"]["modes"]) for b in benches]
        if len(set(modes)) > 1 or any(b["requests"] != benches[0]["requests"] for b in benches):
            raise ValueError("the runs do not share one workload and one set of arms")
        fixed, self.by_draft, self.arms = fixed_menu(modes[0])
        self.measured = [first_passes(b) for b in benches]
        self.requests = [r for r in requests if all((r.idx, a) in m for a in fixed for m in self.measured)]
        if not self.requests:
            raise ValueError("no request was measured under every fixed arm at concurrency 1 in every run")
        self.mean = mean_run(benches)
        self.settings, self.rules, self.classifier, self.draws = benches[0]["settings"], rules, classifier, draws

    def price(self, model) -> float:
        """The model's replayed speed over plain on the runs' mean measurements."""
        return replay(self.mean, self.requests, model, self.rules, self.classifier, self.draws)["vs_plain"]

    def stream(self, start, seed: int, requests: int, every: int, min_rows: int) -> dict:
        """One learning stream from model `start`: its promotions and the model it ends with."""
        from policy.decide import decide
        from policy.train import judge

        rng = random.Random(seed)
        order: list = []
        while len(order) < requests:
            order += rng.sample(self.requests, len(self.requests))
        live, rows, attempts, promotions = start, [], defaultdict(int), []
        for k, r in enumerate(order[:requests]):
            f = features_of(r, self.settings, self.classifier, live)
            d = decide(f, self.rules, live, rng, self.arms)
            run = rng.choice(self.measured)
            rows.append(training_row(f, d, run[(r.idx, self.by_draft[d.arm.draft])], f"{seed}-{k}",
                                     run[(r.idx, self.by_draft[None])]))
            if len(rows) >= min_rows and (len(rows) - min_rows) % every == 0:
                attempts[live.version] += 1
                candidate, decision = judge(rows, live, self.arms.by_preference(), kind_of=self.arms.kind_of,
                                            attempt=attempts[live.version], version=f"s{seed}-r{len(rows)}")
                if not decision["tested"]:  # as the retrainer: a judgement that risked nothing gives its number back
                    attempts[live.version] -= 1
                if decision["promoted"]:
                    promotions.append(dict(at=len(rows), evaluated_rows=decision["evaluated_rows"],
                                           lower_bound=decision["lower_bound"], replaced=self.price(live),
                                           replayed=self.price(candidate)))
                    live = candidate
        return dict(seed=seed, promotions=promotions, final=self.price(live) if promotions else None)


def summarise(streams: list[dict], start: float) -> dict:
    promos = [p for s in streams for p in s["promotions"]]
    finals = [s["final"] if s["final"] is not None else start for s in streams]
    return dict(streams=len(streams), start=start, streams_promoting=sum(bool(s["promotions"]) for s in streams),
                promotions=len(promos), promotions_slower=sum(p["replayed"] < p["replaced"] for p in promos),
                streams_ending_slower=sum(f < start for f in finals), final_mean=float(np.mean(finals)),
                final_min=min(finals), final_max=max(finals))


def add_arguments(p) -> None:
    p.add_argument("bench_json", nargs="+", help="`specgate bench` runs of one workload (each needs concurrency 1)")
    p.add_argument("--streams", type=int, default=100, help="learning streams (default: %(default)s)")
    p.add_argument("--requests", type=int, default=200, help="requests per stream (default: %(default)s, as the "
                                                               "bench's learning curve)")
    p.add_argument("--every", type=int, default=25, help="rows between judgements (default: %(default)s, as the "
                                                           "bench's retrainer)")
    p.add_argument("--min-rows", type=int, default=50, help="rows before the first judgement (default: "
                                                             "%(default)s, as the bench's retrainer)")
    p.add_argument("--policy", help="the model streams start from (default: the prior, as a cold gateway)")
    p.add_argument("--rules", help="operator rules YAML (default: the shipped default rules)")
    p.add_argument("--data", help="the runs' workload JSONL, if not where they read it")
    p.add_argument("--seed", type=int, default=0, help="the first stream's seed (default: %(default)s)")
    p.add_argument("--out", help="also write every stream's promotions as JSON here")


def main(args) -> int:
    from policy.classifier import CategoryClassifier
    from policy.model import PolicyModel, prior_model
    from policy.rules import SHIPPED_RULES, load_rules

    if min(args.streams, args.requests, args.every, args.min_rows) < 1:
        print("error: --streams, --requests, --every and --min-rows must be at least 1", file=sys.stderr)
        return 2
    try:
        benches = [json.loads(Path(p).read_text()) for p in args.bench_json]
        requests = workload_of(benches[0], args.data)
        start = PolicyModel.from_json(Path(args.policy).read_text()) if args.policy else prior_model()
        gate = GateReplay(benches, requests, load_rules(args.rules or SHIPPED_RULES), CategoryClassifier.load())
    except (OSError, ValueError, KeyError, WorkloadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    start_v = gate.price(start)
    streams = []
    for s in range(args.seed, args.seed + args.streams):
        streams.append(gate.stream(start, s, args.requests, args.every, args.min_rows))
        if len(streams) % 10 == 0 or len(streams) == args.streams:
            print(f"{len(streams)}/{args.streams} streams", file=sys.stderr)
    out = summarise(streams, start_v)
    print(f"{args.streams} streams of {args.requests} requests over {len(gate.requests)} requests of "
          f"{len(benches)} run(s), from {start.version} ({start_v:.4f}x plain replayed)")
    print(f"  {out['streams_promoting']} streams promoted ({out['promotions']} promotions, "
          f"{out['promotions_slower']} replaying slower than the model they replaced); "
          f"{out['streams_ending_slower']} ended slower than they started")
    print(f"  final model replayed: mean {out['final_mean']:.4f}x plain, min {out['final_min']:.4f}x, "
          f"max {out['final_max']:.4f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(summary=out, streams=streams), indent=1))
    return 0
