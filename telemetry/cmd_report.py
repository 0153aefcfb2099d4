"""Does it pay? Reads the outcome stream and prints, per category and arm:
requests, acceptance, predicted against realised speedup over plain, and
acceptance-guard trips; then the policy versions over time and the retrainer's
promotion judgements (optionally a PNG of predicted against realised)."""

from __future__ import annotations

import json
import os
import sys


def add_arguments(r) -> None:
    r.add_argument("--redis", default=os.environ.get("SPECGATE_REDIS_URL"),
                   help="redis://[:PASSWORD@]HOST:PORT/DB (default: $SPECGATE_REDIS_URL)")
    r.add_argument("--last", type=int, default=10_000, help="the newest N outcomes (default: %(default)s)")
    r.add_argument("--json", action="store_true", help="print the summary as JSON")
    r.add_argument("--png", help="also plot predicted against realised speedup here")


def main(args) -> int:
    import redis

    from telemetry.cmd_retrain import redis_client
    from telemetry.report import decisions, markdown, plot, read, summarise

    client = redis_client(args.redis)
    if client is None:
        return 2
    try:
        records, bad = read(client, args.last)
        judged = decisions(client)
    except redis.RedisError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if not records:
        print("no outcomes in the stream yet", file=sys.stderr)
        return 1
    summary = summarise(records)
    summary["unreadable"] = bad
    if args.json:
        print(json.dumps({**summary, "judgements": judged}, indent=1))
    else:
        print(markdown(summary, judged))
    if args.png:
        plot(summary, args.png)
        print(f"wrote {args.png}", file=sys.stderr)
    return 0
