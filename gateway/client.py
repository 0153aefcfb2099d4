"""What the client commands share: address and key options, a stub, the request
message from the command line, and printing a gRPC error without a traceback."""

from __future__ import annotations

import os
import sys


def add_connection(c) -> None:
    c.add_argument("--address", default=os.environ.get("SPECGATE_ADDRESS", "127.0.0.1:50051"),
                   help="gateway HOST:PORT (default: $SPECGATE_ADDRESS or %(default)s)")
    c.add_argument("--api-key", default=os.environ.get("SPECGATE_API_KEY"), help="API key (default: $SPECGATE_API_KEY)")


def add_request(c) -> None:
    c.add_argument("prompt", help="the user message (sent as chat; --raw sends plain text)")
    add_connection(c)
    c.add_argument("--raw", action="store_true", help="send prompt text without the chat template")
    c.add_argument("--max-tokens", type=int)
    c.add_argument("--temperature", type=float)
    c.add_argument("--top-p", type=float)
    c.add_argument("--top-k", type=int)
    c.add_argument("--seed", type=int)
    c.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    c.add_argument("--category", default="", help="category hint")
    c.add_argument("--expected-tokens", type=int, help="expected output length hint")
    c.add_argument("--arm", default="", help="request an arm (honoured if the rules allow)")
    c.add_argument("--timeout", type=float, default=600, help="deadline in seconds (default: %(default)s)")
    c.add_argument("--json", action="store_true", help="print the response as JSON")


def request(args):
    from gateway.pb import specgate_pb2 as pb

    req = pb.GenerateRequest(stop=args.stop, category=args.category, arm=args.arm)
    if args.raw:
        req.prompt = args.prompt
    else:
        req.messages.append(pb.ChatMessage(role="user", content=args.prompt))
    for field, value in (("max_tokens", args.max_tokens), ("temperature", args.temperature),
                         ("top_p", args.top_p), ("top_k", args.top_k), ("seed", args.seed),
                         ("expected_output_tokens", args.expected_tokens)):
        if value is not None:
            setattr(req, field, value)
    return req


def stub(args):
    import grpc

    from gateway.pb import specgate_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(args.address)
    meta = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else ()
    return pb_grpc.GatewayStub(channel), meta


def fail(e) -> int:
    print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
    return 1


def as_json(message) -> str:
    import json

    from google.protobuf.json_format import MessageToDict

    return json.dumps(MessageToDict(message, preserving_proto_field_name=True))
