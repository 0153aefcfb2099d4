"""Engines (health, arms, load), the live policy model version and the rules
version of a gateway, as JSON."""

from __future__ import annotations

import json

from gateway.client import add_connection, fail, stub


def add_arguments(c) -> None:
    add_connection(c)


def main(args) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from gateway.pb import specgate_pb2 as pb

    s, meta = stub(args)
    try:
        resp = s.GetStatus(pb.GetStatusRequest(), metadata=meta, timeout=10)
    except grpc.RpcError as e:
        return fail(e)
    print(json.dumps(MessageToDict(resp, preserving_proto_field_name=True), indent=1))
    return 0
