"""Exit 0 if a gateway or an engine worker answers the gRPC health check as
SERVING, else 1: the container and orchestrator probe. Needs no API key."""

from __future__ import annotations

import os
import sys


def add_arguments(h) -> None:
    h.add_argument("--address", default=os.environ.get("SPECGATE_ADDRESS", "127.0.0.1:50051"),
                   help="HOST:PORT (default: $SPECGATE_ADDRESS or %(default)s)")
    h.add_argument("--timeout", type=float, default=5.0, help="seconds (default: %(default)s)")


def main(args) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(args.address) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"{args.address}: {e.code().name}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(f"{args.address}: {status}")
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1
