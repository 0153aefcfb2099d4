"""Telemetry benchmarks: retraining time on synthetic outcomes, publish-to-live
latency across several model watchers, and the cost of writing an outcome on the
request path. Runs against a private redis-server."""

from __future__ import annotations

import random
import statistics
import time

from engines.arms import Arm, ArmMenu


def synthetic_rows(n: int, seed: int = 0) -> list:
    """Outcome rows of a world where the best arm depends on category, temperature and load."""
    from policy.classifier import CATEGORIES
    from policy.features import RequestFeatures
    from policy.model import expected_tokens_per_round
    from policy.train import TrainingRow

    rng = random.Random(seed)
    arms = ArmMenu(("ngram", "selfspec"), 1, 8).all_arms()
    base = {c: (rng.uniform(0.1, 0.9), rng.uniform(0.3, 0.8)) for c in CATEGORIES}
    rows = []
    for i in range(n):
        cat, t, load = rng.choice(CATEGORIES), rng.choice([0.0, 0.7, 1.0]), rng.randint(0, 16)
        arm = rng.choice(arms)
        f = RequestFeatures(category=cat, temperature=t, top_p=1.0, prompt_tokens=rng.randint(20, 2000),
                            expected_output_tokens=128, copy_signal=base[cat][0], running=1, waiting=load,
                            tokens_per_step=1.0)
        step = 0.05 * (1 + 0.03 * load)
        if arm.is_plain:
            rounds, secs = 127, 127 * step
        else:
            a = base[cat][0 if arm.draft == "ngram" else 1] * (1 - 0.6 * t)
            rounds = max(1, round(127 / expected_tokens_per_round(a, arm.gamma)))
            secs = rounds * step * (1 + (0.03 if arm.draft == "ngram" else 0.3) * arm.gamma + 0.02 * arm.gamma * load)
        rows.append(TrainingRow(f, arm, 1 / len(arms), 128, rounds, secs, request_id=f"b{i}"))
    return rows


def main(args) -> int:
    import redis

    from bench import cpu_model
    from engines.api import GenerationStats
    from policy.decide import Decision
    from policy.model import prior_model
    from policy.train import judge
    from telemetry.artifacts import ModelWatcher, publish
    from telemetry.outcomes import RedisOutcomeSink
    from telemetry.record import OutcomeRecord
    from telemetry.redis_server import PrivateRedis

    print(f"machine: {cpu_model()}")

    rows = synthetic_rows(args.rows)
    arms = ArmMenu(("ngram", "selfspec"), 1, 8).all_arms()
    t0 = time.perf_counter()  # what the retrainer runs: fit on the older 70%, judge on the rest, refit on all
    model, decision = judge(rows, prior_model(), arms)
    print(f"retrain on {len(rows)} outcomes (a candidate judged against the prior and refit): "
          f"{time.perf_counter() - t0:.2f} s (value {decision['candidate_value']} vs {decision['live_value']} on "
          f"{decision['evaluated_rows']} newer rows, promoted: {decision['promoted']})")

    server = PrivateRedis()
    try:
        client = redis.Redis.from_url(server.url)
        key = b"bench-key"
        lat = []
        got: dict[int, float] = {}
        def arrived(i: int):
            return lambda m: got.__setitem__(i, time.perf_counter())

        watchers = [ModelWatcher(client, key, arrived(i), poll_s=1.0) for i in range(args.gateways)]
        time.sleep(0.5)
        for k in range(5):
            got.clear()
            model.version = f"bench-{k}"
            t = time.perf_counter()
            publish(client, model, key)
            while len(got) < args.gateways and time.perf_counter() - t < 5:
                time.sleep(0.001)
            lat.append(max(got.values()) - t if len(got) == args.gateways else float("inf"))
        for w in watchers:
            w.close()
        print(f"publish -> live in all {args.gateways} watchers: median {statistics.median(lat) * 1e3:.1f} ms, "
              f"max {max(lat) * 1e3:.1f} ms (5 publishes)")

        sink = RedisOutcomeSink(client, max_queue=100_000)
        decision = Decision(Arm("ngram", 4), "policy", None, "v", "r", {"ngram:4": 1.2}, 0.9)
        stats = GenerationStats(arm="ngram:4", output_tokens=128, rounds=40, drafted_per_round=[3] * 40,
                                accepted_per_round=[2] * 40, total_s=1.2, prefill_s=0.2)
        n = 20_000
        t = time.perf_counter()
        for i in range(n):  # what the service does per request: build the record, queue it
            sink.emit(OutcomeRecord.of(f"x{i}", "", "local", rows[0].features, decision, stats, 0.2))
        per = (time.perf_counter() - t) / n
        sink.flush(60)
        sink.close()
        print(f"outcome write on the request path: {per * 1e6:.1f} µs per request (emit into the queue; "
              f"{n} records shipped in the background, {sink.dropped} dropped)")
    finally:
        server.stop()
    return 0


def add_arguments(p) -> None:
    p.add_argument("--rows", type=int, default=50_000, help="synthetic outcomes to retrain on")
    p.add_argument("--gateways", type=int, default=3, help="model watchers (gateways) to time the swap in")
