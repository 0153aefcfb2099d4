"""Make an earlier policy model version live again (default: the one before the
current). Gateways watching the registry swap to it within milliseconds."""

from __future__ import annotations

import os
import sys


def add_arguments(rb) -> None:
    rb.add_argument("version", nargs="?", help="version to restore (default: the one before the current)")
    rb.add_argument("--redis", default=os.environ.get("SPECGATE_REDIS_URL"),
                    help="redis://[:PASSWORD@]HOST:PORT/DB (default: $SPECGATE_REDIS_URL)")


def main(args) -> int:
    from telemetry.artifacts import ArtifactError, rollback
    from telemetry.cmd_retrain import redis_client

    client = redis_client(args.redis)
    if client is None:
        return 2
    try:
        version = rollback(client, args.version)
    except ArtifactError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"live policy model: {version}")
    return 0
