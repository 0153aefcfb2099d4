"""Ask a gateway which arm it would choose for a request, and why: the
decision, the features it was made on, and the predicted speedup of the best
arms. Nothing is generated."""

from __future__ import annotations

from gateway.client import add_request, as_json, fail, request, stub


def add_arguments(c) -> None:
    add_request(c)


def main(args) -> int:
    import grpc

    s, meta = stub(args)
    try:
        resp = s.Decide(request(args), metadata=meta, timeout=args.timeout)
    except grpc.RpcError as e:
        return fail(e)
    if args.json:
        print(as_json(resp))
        return 0
    d, f = resp.decision, resp.features
    print(f"{d.arm} ({d.source}) — {d.reason}")
    print(f"features: category {f.category}, T={f.temperature:g}, ~{f.prompt_tokens} prompt tokens, "
          f"~{f.expected_output_tokens} output tokens, load {f.running + f.waiting}")
    for arm, speed in sorted(d.predicted_speedups.items(), key=lambda kv: -kv[1])[:6]:
        print(f"  {arm:<14} {speed:.2f}x")
    return 0
