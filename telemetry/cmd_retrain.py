"""Learn policy models from the outcome stream and promote the better ones.

Reads the stream through a consumer group (several retrainers split it), keeps a
window of recent outcomes, and every N new ones fits a candidate on the older 70%
and scores it against the live model on the newer 30% (doubly robust, paired). It
publishes the candidate, signed with $SPECGATE_ARTIFACT_KEY, only when the lower
confidence bound of the difference is above zero; the bound tightens with every
judgement against the same live model (counted in Redis, across restarts and
retrainers). Every judgement is kept in specgate:model:decisions (`specgate
report` shows them). Gateways sharing the key and Redis swap to a promoted model."""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("specgate")


def add_arguments(r) -> None:
    r.add_argument("--redis", default=os.environ.get("SPECGATE_REDIS_URL"),
                   help="redis://[:PASSWORD@]HOST:PORT/DB (default: $SPECGATE_REDIS_URL; the password may come "
                        "from $SPECGATE_REDIS_PASSWORD)")
    r.add_argument("--once", action="store_true", help="read what is there, retrain once, exit")
    r.add_argument("--every", type=int, default=500, help="retrain after this many new outcomes (default: %(default)s)")
    r.add_argument("--interval", type=float, help="also retrain every this many seconds when anything is new")
    r.add_argument("--window", type=int, default=50_000, help="outcomes kept for training (default: %(default)s)")
    r.add_argument("--min-rows", type=int, default=200,
                   help="outcomes needed before the first retraining (default: %(default)s)")
    menu = r.add_mutually_exclusive_group()
    menu.add_argument("--engine-config", metavar="YAML",
                      help="the built-in engines' config: their drafts, what each is, and their γ bounds (default: "
                           "the built-in engine's defaults)")
    menu.add_argument("--arms",
                      help="arms the engines serve instead, e.g. 'ngram:4,draft:5' for servers configured per arm or "
                           "'ngram,draft:1-8'; a draft no engine config describes is judged by its name (ngram*, "
                           "eagle*, ngram-<model> the hybrid; else a separate draft model)")
    r.add_argument("--draft-kind", action="append", default=[], metavar="NAME=KIND",
                   help="with --arms, what a draft is where its name does not say (e.g. spec=eagle; KIND: ngram, "
                        "eagle, model or layers), as the gateway's draft_kinds; repeatable")
    r.add_argument("--fixed-gamma", action="store_true",
                   help="with --arms: the engines run the γ they are given (servers such as vLLM); default: γ is a "
                        "bound the engine verifies within, as the built-in engine does (a larger one is never slower)")


def artifact_key() -> bytes | None:
    key = os.environ.get("SPECGATE_ARTIFACT_KEY", "").encode()
    if not key:
        print("error: set SPECGATE_ARTIFACT_KEY (the HMAC key gateways verify policy models with)", file=sys.stderr)
        return None
    return key


def redis_client(url: str | None):
    if not url:
        print("error: give --redis or set SPECGATE_REDIS_URL", file=sys.stderr)
        return None
    import redis

    from telemetry.runtime import with_password

    return redis.Redis.from_url(with_password(url, "SPECGATE_REDIS_PASSWORD"), socket_timeout=10,
                                socket_connect_timeout=5)


def main(args) -> int:
    from dataclasses import replace

    from engines.arms import ArmMenu, DraftKind
    from engines.config import load_engine_config
    from telemetry.retrainer import Retrainer

    key, client = artifact_key(), redis_client(args.redis)
    if key is None or client is None:
        return 2
    if args.draft_kind and not args.arms:
        print("error: --draft-kind goes with --arms (an engine config says what its drafts are)", file=sys.stderr)
        return 2
    try:
        menu = (ArmMenu.parse(args.arms, adaptive=not args.fixed_gamma) if args.arms
                else load_engine_config(args.engine_config).arm_menu())
    except (OSError, ValueError) as e:  # pydantic's ValidationError is a ValueError
        print(f"error: {'--arms' if args.arms else '--engine-config'}: {e}", file=sys.stderr)
        return 2
    try:
        menu = replace(menu, kinds=menu.kinds + tuple(DraftKind.parse(k, menu.drafts) for k in args.draft_kind))
    except ValueError as e:
        print(f"error: --draft-kind {e}", file=sys.stderr)
        return 2
    r = Retrainer(client, key, window=args.window, every=args.every, min_rows=args.min_rows, arms=menu)
    log.info("retrainer: every %d outcomes, window %d", args.every, args.window)
    try:
        r.run(once=args.once, interval_s=args.interval)
    except KeyboardInterrupt:
        return 0
    except Exception as e:  # noqa: BLE001 - --once against an unreachable Redis: say so, no traceback
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if args.once:
        print(f"{len(r.rows)} outcomes; promoted: {r.promoted or 'none'}")
    return 0
