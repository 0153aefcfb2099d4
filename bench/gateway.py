"""Gateway overhead and throughput.

1. Added latency: the same requests sent to an engine directly and through the
   gateway over a loopback channel, interleaved, in one run (p50/p99 of each and
   of the difference).
2. Sustained unary requests/s against a trivial echo engine, with client
   processes so the load generator does not share the server's GIL.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time

from engines.api import GenerationResult, GenerationStats, LoadSnapshot, TokenDelta
from engines.arms import ArmMenu


class EchoHandle:
    def __init__(self, request):
        self.request_id = request.request_id
        text = request.prompt or "".join(m.content for m in request.messages)
        self._result = GenerationResult(request.request_id, text, (), GenerationStats(
            arm=request.arm.name, output_tokens=1, finish_reason="stop", total_s=1e-6))

    async def __aiter__(self):
        yield TokenDelta(self._result.text, ())

    async def result(self, timeout=None):
        return self._result

    def cancel(self):
        pass


class EchoEndpoint:
    """Answers at once with the prompt: everything measured is the gateway."""

    id, address, healthy = "echo", "in-process", True
    MENU = ArmMenu(("ngram",), 1, 8)

    def arms(self):
        return self.MENU

    def load(self):
        return LoadSnapshot()

    def max_context(self):
        return 4096

    async def open(self):
        pass

    async def check(self):
        return True

    def mark_failed(self):
        pass

    async def submit(self, request):
        return EchoHandle(request)

    async def close(self):
        pass


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def start(endpoint):
    """A real gateway (gRPC on loopback, the default rules' structure, no Redis) over `endpoint`."""
    from gateway.app import build_app, serve_in_background
    from gateway.auth import KeyStore
    from gateway.config import AuthConfig, GatewayConfig
    from gateway.policy_state import PolicyState
    from policy.rules import parse_rules
    from telemetry.otel import Instrumentation
    from telemetry.outcomes import MemoryOutcomeSink
    from telemetry.runtime import Telemetry

    sink = MemoryOutcomeSink()
    app = build_app(GatewayConfig(listen="127.0.0.1:0", embedded_engine=False, max_concurrent_streams=1024),
                    endpoints=[endpoint], policy=PolicyState(parse_rules("default: {explore: 0.05}")),
                    keys=KeyStore(AuthConfig(), env=""), telemetry=Telemetry(sink, Instrumentation(sink=sink)))
    return serve_in_background(app)


def overhead(endpoint, n: int, prompt: str, max_tokens: int) -> dict:
    import grpc

    from engines.api import GenerationRequest, SamplingParams
    from engines.arms import Arm
    from gateway.pb import specgate_pb2 as pb
    from gateway.pb import specgate_pb2_grpc as pb_grpc

    serving = start(endpoint)
    stub = pb_grpc.GatewayStub(grpc.insecure_channel(f"127.0.0.1:{serving.grpc_port}"))
    req = pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens, arm="plain")

    async def direct_call(i):
        h = await endpoint.submit(GenerationRequest(request_id=str(i), prompt=prompt, arm=Arm(),
                                                    sampling=SamplingParams(max_tokens=max_tokens)))
        async for _ in h:
            pass
        return await h.result()

    direct, via = [], []
    loop = asyncio.new_event_loop()
    for i in range(n + 20):
        t0 = time.perf_counter()
        loop.run_until_complete(direct_call(i))
        t1 = time.perf_counter()
        stub.Generate(req)
        t2 = time.perf_counter()
        if i >= 20:  # warm-up
            direct.append(t1 - t0)
            via.append(t2 - t1)
    loop.close()
    serving.stop()
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
    serving = start(EchoEndpoint())
    port = serving.grpc_port
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
    serving.stop()
    return {"clients": clients, "rps": len(lats) / seconds, "p50_ms": _pct(lats, 0.5) * 1e3,
            "p99_ms": _pct(lats, 0.99) * 1e3, "cpu_ms_per_request": cpu / max(len(lats), 1) * 1e3}


def main(args) -> int:
    from bench import cpu_model

    print(f"machine: {cpu_model()}")
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
