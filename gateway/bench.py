"""Gateway overhead and throughput.

1. Added latency: the same requests sent to an engine directly and through the
   gateway over a loopback channel, interleaved, in one run (p50/p99 of each and
   of the difference).
2. Sustained unary requests/s against a trivial echo engine, with client
   processes so the load generator does not share the server's GIL.
"""

from __future__ import annotations

import multiprocessing as mp
import time

from engines.api import ArmInfo, GenerationResult, GenerationStats, LoadSnapshot, TokenDelta


class EchoHandle:
    def __init__(self, request):
        self.request_id = request.request_id
        text = request.prompt or "".join(m.content for m in request.messages)
        self._result = GenerationResult(request.request_id, text, (), GenerationStats(
            arm=request.arm.name, output_tokens=1, finish_reason="stop", total_s=1e-6))

    def __iter__(self):
        yield TokenDelta(self._result.text, ())

    def result(self, timeout=None):
        return self._result

    def cancel(self):
        pass


class EchoEndpoint:
    """Answers at once with the prompt: everything measured is the gateway."""

    id, address, healthy = "echo", "in-process", True

    def arms(self):
        return ArmInfo(("ngram",), 1, 8)

    def load(self):
        return LoadSnapshot()

    def max_context(self):
        return 4096

    def submit(self, request):
        return EchoHandle(request)

    def close(self):
        pass


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def start(endpoint, workers=16):
    import grpc

    from gateway.config import AuthConfig
    from gateway.interceptors import KeyStore
    from gateway.router import Router
    from gateway.server import GatewayDeps, create_server
    from gateway.service import GatewayService, PolicyState
    from policy.rules import parse_rules

    service = GatewayService(Router([endpoint]), PolicyState(parse_rules("default: {explore: 0.05}")))
    server, port, _ = create_server("127.0.0.1:0", GatewayDeps(service, KeyStore(AuthConfig(), env=""),
                                                                workers=workers))
    server.start()
    return server, port, grpc


def overhead(endpoint, n: int, prompt: str, max_tokens: int) -> dict:
    from engines.api import Arm, GenerationRequest, SamplingParams
    from gateway.pb import specgate_pb2 as pb
    from gateway.pb import specgate_pb2_grpc as pb_grpc

    server, port, grpc = start(endpoint)
    stub = pb_grpc.GatewayStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    req = pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens, arm="plain")
    direct, via = [], []
    for i in range(n + 20):
        t0 = time.perf_counter()
        endpoint.submit(GenerationRequest(request_id=str(i), prompt=prompt, arm=Arm(),
                                          sampling=SamplingParams(max_tokens=max_tokens))).result()
        t1 = time.perf_counter()
        stub.Generate(req)
        t2 = time.perf_counter()
        if i >= 20:  # warm-up
            direct.append(t1 - t0)
            via.append(t2 - t1)
    server.stop(0)
    diff = [b - a for a, b in zip(direct, via)]
    return {k: {"p50_ms": _pct(v, 0.5) * 1e3, "p99_ms": _pct(v, 0.99) * 1e3}
            for k, v in (("direct", direct), ("gateway", via), ("added", diff))}


def _client(port: int, seconds: float, out, category: str):
    import grpc

    from gateway.pb import specgate_pb2 as pb
    from gateway.pb import specgate_pb2_grpc as pb_grpc

    stub = pb_grpc.GatewayStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    req = pb.GenerateRequest(prompt="echo this back", max_tokens=1, category=category)
    stub.Generate(req)
    lat = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        stub.Generate(req)
        lat.append(time.perf_counter() - t0)
    out.put(lat)


def throughput(clients: int, seconds: float, category: str) -> dict:
    server, port, _ = start(EchoEndpoint(), workers=max(8, clients * 2))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_client, args=(port, seconds, q, category)) for _ in range(clients)]
    cpu0 = time.process_time()  # this process is the gateway; the clients are other processes
    for p in procs:
        p.start()
    lats = [x for _ in procs for x in q.get(timeout=seconds + 120)]
    cpu = time.process_time() - cpu0
    for p in procs:
        p.join()
    server.stop(0)
    return {"clients": clients, "rps": len(lats) / seconds, "p50_ms": _pct(lats, 0.5) * 1e3,
            "p99_ms": _pct(lats, 0.99) * 1e3, "cpu_ms_per_request": cpu / max(len(lats), 1) * 1e3}


def main(args) -> int:
    print("added latency, echo engine (same requests, interleaved):")
    for k, v in overhead(EchoEndpoint(), args.requests, "echo this back", 1).items():
        print(f"  {k:<8} p50 {v['p50_ms']:.3f} ms  p99 {v['p99_ms']:.3f} ms")
    for category in ("", "chat"):
        for c in args.clients:
            r = throughput(c, args.seconds, category)
            hint = "category hint (no classifier)" if category else "classifier on every request"
            print(f"echo engine, {c} client processes, {hint}: {r['rps']:.0f} req/s, "
                  f"p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms; gateway CPU "
                  f"{r['cpu_ms_per_request']:.2f} ms/request = {r['cpu_ms_per_request']:.2f} cores per 1000 req/s")
    return 0


def add_arguments(p) -> None:
    p.add_argument("--requests", type=int, default=500, help="requests per overhead measurement")
    p.add_argument("--clients", type=int, nargs="+", default=[2, 4], help="client processes for throughput")
    p.add_argument("--seconds", type=float, default=5.0, help="duration of each throughput run")
