"""Telemetry benchmarks: retraining time, publish-to-live latency, and the cost of
writing an outcome on the request path. Runs against a private redis-server."""

from __future__ import annotations

import random
import statistics
import time

from engines.api import ArmInfo


def synthetic_rows(n: int, seed: int = 0) -> list[dict]:
    """Outcome rows of a world where the best arm depends on category, temperature and load."""
    from policy.classifier import CATEGORIES
    from policy.model import expected_tokens_per_round

    rng = random.Random(seed)
    arms = ArmInfo(("ngram", "selfspec"), 1, 8).all_arms()
    base = {c: (rng.uniform(0.1, 0.9), rng.uniform(0.3, 0.8)) for c in CATEGORIES}
    rows = []
    for i in range(n):
        cat, t, load = rng.choice(CATEGORIES), rng.choice([0.0, 0.7, 1.0]), rng.randint(0, 16)
        arm = rng.choice(arms)
        f = dict(category=cat, temperature=t, top_p=1.0, prompt_tokens=rng.randint(20, 2000),
                 expected_output_tokens=128, copy_signal=base[cat][0], running=1, waiting=load, tokens_per_step=1.0,
                 tenant="", requested_arm=None, rolling_acceptance={})
        step = 0.05 * (1 + 0.03 * load)
        if arm.is_plain:
            rounds, secs = 127, 127 * step
        else:
            a = base[cat][0 if arm.draft == "ngram" else 1] * (1 - 0.6 * t)
            rounds = max(1, round(127 / expected_tokens_per_round(a, arm.gamma)))
            secs = rounds * step * (1 + (0.03 if arm.draft == "ngram" else 0.3) * arm.gamma + 0.02 * arm.gamma * load)
        rows.append(dict(features=f, arm=arm.name, propensity=1 / len(arms), output_tokens=128, rounds=rounds,
                         decode_s=secs, request_id=f"b{i}"))
    return rows


def main(args) -> int:
    import redis

    from gateway.service import Outcome
    from policy.model import prior_model
    from policy.train import fit, offline_value
    from telemetry.artifacts import ModelWatcher, publish
    from telemetry.outcomes import RedisOutcomeSink
    from telemetry.redis_server import PrivateRedis

    rows = synthetic_rows(args.rows)
    arms = ArmInfo(("ngram", "selfspec"), 1, 8).all_arms()
    t0 = time.perf_counter()
    model = fit(rows)
    t1 = time.perf_counter()
    cand, live = offline_value(model, rows, arms), offline_value(prior_model(), rows, arms)
    t2 = time.perf_counter()
    print(f"retrain on {len(rows)} outcomes: fit {t1 - t0:.2f} s + offline evaluation {t2 - t1:.2f} s "
          f"= {t2 - t0:.2f} s (offline value {cand:.3f} vs prior {live:.3f})")

    server = PrivateRedis()
    try:
        client = redis.Redis.from_url(server.url)
        key = b"bench-key"
        lat = []
        got: dict[int, float] = {}
        watchers = [ModelWatcher(client, key, (lambda i: lambda m: got.__setitem__(i, time.perf_counter()))(i),
                                 poll_s=1.0) for i in range(args.gateways)]
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
        rec = Outcome(request_id="x", tenant="", features=rows[0]["features"],
                      decision={"arm": "ngram:4", "draft": "ngram", "propensity": 0.9}, engine="local",
                      result={"output_tokens": 128, "rounds": 40, "drafted": 100, "accepted": 60, "decode_s": 1.0})
        n = 20_000
        t = time.perf_counter()
        for i in range(n):
            rec.request_id = f"x{i}"
            sink.emit(rec)
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
