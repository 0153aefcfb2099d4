"""Call a gateway and print the text, then the decision and the request's stats
(on stderr). --stream prints text as it is generated."""

from __future__ import annotations

import sys

from gateway.client import add_request, as_json, fail, request, stub


def add_arguments(c) -> None:
    add_request(c)
    c.add_argument("--stream", action="store_true", help="print text as it is generated")


def summary(resp) -> str:
    d, s, t = resp.decision, resp.spec, resp.timings
    return (f"arm {d.arm} ({d.source}{', rule ' + d.rule if d.rule else ''}; policy {d.policy_version}; "
            f"predicted {d.predicted_speedup:.2f}x) — {d.reason}\n"
            f"{resp.usage.output_tokens} tokens, finish {resp.finish_reason}; drafted {s.drafted}, accepted "
            f"{s.accepted} ({s.acceptance_rate:.2f}), mean accepted length {s.mean_accepted_length:.2f}; "
            f"ttft {t.ttft_s * 1e3:.0f} ms, total {t.total_s:.2f} s; engine {resp.engine}; request {resp.request_id}")


def main(args) -> int:
    import grpc

    s, meta = stub(args)
    try:
        if args.stream:
            resp = None
            for ev in s.GenerateStream(request(args), metadata=meta, timeout=args.timeout):
                if ev.HasField("final"):
                    resp = ev.final
                elif not args.json:
                    print(ev.text, end="", flush=True)
            if not args.json:
                print()
        else:
            resp = s.Generate(request(args), metadata=meta, timeout=args.timeout)
            if not args.json:
                print(resp.text)
    except grpc.RpcError as e:
        return fail(e)
    if args.json:
        print(as_json(resp))
    else:
        print("---\n" + summary(resp), file=sys.stderr)
    return 0
