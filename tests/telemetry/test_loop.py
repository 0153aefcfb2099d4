"""The whole loop on real parts: gateway -> Redis stream -> retrainer -> signed
model -> the running gateway; and the spans each request leaves."""

import json
import time

import grpc
import redis
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engines.api import ArmInfo
from gateway.config import AuthConfig
from gateway.interceptors import KeyStore
from gateway.pb import specgate_pb2 as pb
from gateway.pb import specgate_pb2_grpc as pb_grpc
from gateway.router import LocalEndpoint, Router
from gateway.server import GatewayDeps, create_server
from gateway.service import GatewayService, PolicyState
from telemetry.artifacts import ModelWatcher
from telemetry.otel import Instrumentation
from telemetry.outcomes import STREAM, RedisOutcomeSink
from telemetry.retrainer import Retrainer
from tests.gateway.conftest import RULES, tiny_engine
from tests.policy.test_train import simulate

KEY = b"s" * 32


def synthetic_records(n):
    """Outcome records shaped as the gateway writes them, from the synthetic world."""
    for i, row in enumerate(simulate(n, seed=4)):
        arm = row["arm"]
        yield {"schema": 1, "request_id": f"syn{i}", "tenant": "", "features": row["features"],
               "decision": {"arm": arm, "draft": None if arm == "plain" else arm.split(":")[0],
                            "propensity": row["propensity"]},
               "engine": "sim", "result": {"output_tokens": row["output_tokens"], "rounds": row["rounds"],
                                           "decode_s": row["decode_s"], "drafted": 0, "accepted": 0}}


def test_retrain_promote_and_the_running_gateway_serves_the_new_version(rclient, redis_server):
    engine = tiny_engine()
    client = redis.Redis.from_url(redis_server.url)
    policy = PolicyState(RULES)
    sink = RedisOutcomeSink(client)
    watcher = ModelWatcher(client, KEY, policy.set_model, poll_s=0.5)
    service = GatewayService(Router([LocalEndpoint(engine)]), policy, sink)
    server, port, _ = create_server("127.0.0.1:0", GatewayDeps(service, KeyStore(AuthConfig(), env="")))
    server.start()
    stub = pb_grpc.GatewayStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    try:
        # real requests leave real records
        for i in range(5):
            assert stub.Generate(pb.GenerateRequest(prompt="hello world", max_tokens=3)).decision.policy_version \
                == "prior"
        assert sink.flush(10) and client.xlen(STREAM) == 5
        rec = json.loads(client.xrange(STREAM, count=1)[0][1][b"record"])
        assert rec["decision"]["policy_version"] == "prior" and rec["result"]["output_tokens"] == 3
        # plus a synthetic history rich enough to learn from
        for r in synthetic_records(3000):
            client.xadd(STREAM, {"v": "1", "id": r["request_id"], "record": json.dumps(r)})

        retrainer = Retrainer(client, KEY, arms=ArmInfo(("ngram", "draft"), 1, 8), every=100, min_rows=100)
        while retrainer.consume(block_ms=100):
            pass
        assert len(retrainer.rows) == 3005
        assert retrainer.consume(block_ms=100) == 0  # everything acknowledged: read once
        model = retrainer.maybe_retrain(force=True)
        assert model is not None and retrainer.promoted == [model.version]
        assert model.metrics["offline_value"] >= model.metrics["live_offline_value"]

        t0 = time.perf_counter()
        while policy.model.version != model.version and time.perf_counter() - t0 < 5:
            time.sleep(0.02)
        assert policy.model.version == model.version and time.perf_counter() - t0 < 2.0
        assert stub.GetStatus(pb.GetStatusRequest()).policy_version == model.version
        assert stub.Generate(pb.GenerateRequest(prompt="hello", max_tokens=2)).decision.policy_version == \
            model.version
        # a second retrainer start sees the same records as already processed
        again = Retrainer(client, KEY, consumer="retrainer-2")
        assert again.consume(block_ms=100) == 1  # only the request served after the swap
    finally:
        server.stop(0)
        watcher.close()
        sink.close()
        engine.close()


def test_spans_carry_decision_and_outcome_attributes_and_continue_the_callers_trace():
    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    instr = Instrumentation(tp, MeterProvider(metric_readers=[reader]))
    engine = tiny_engine()
    service = GatewayService(Router([LocalEndpoint(engine)]), PolicyState(RULES), instrumentation=instr)
    server, port, _ = create_server("127.0.0.1:0", GatewayDeps(service, KeyStore(AuthConfig(), env="")))
    server.start()
    try:
        stub = pb_grpc.GatewayStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
        resp = stub.Generate(pb.GenerateRequest(prompt="hello world the cat", max_tokens=6, temperature=0.3,
                                                arm="ngram:3"),
                             metadata=(("traceparent", f"00-{trace_id}-00f067aa0ba902b7-01"),))
        spans = {s.name: s for s in exporter.get_finished_spans()}
        root = spans["specgate.generate_request"]
        assert format(root.context.trace_id, "032x") == trace_id  # continued, not a new trace
        assert format(root.parent.span_id, "016x") == "00f067aa0ba902b7"
        for child in ("specgate.decide", "specgate.queue", "specgate.engine_generation"):
            assert spans[child].parent.span_id == root.context.span_id, child
        a = root.attributes
        # sampled: EOS may come early, so compare with what the response reported
        assert abs(a["gen_ai.request.temperature"] - 0.3) < 1e-6
        assert a["gen_ai.usage.output_tokens"] == resp.usage.output_tokens >= 1
        assert a["specgate.arm"] == "ngram:3" and a["specgate.draft"] == "ngram" and a["specgate.gamma"] == 3
        for k in ("specgate.category", "specgate.expected_output_tokens", "specgate.load", "specgate.decision.source",
                  "specgate.rule", "specgate.policy_version", "specgate.predicted_speedup", "specgate.explored",
                  "specgate.spec.drafted", "specgate.spec.accepted", "specgate.spec.acceptance_rate",
                  "specgate.spec.acceptance_source",
                  "specgate.time_to_first_token_s"):
            assert k in a, k
        assert spans["specgate.decide"].attributes["specgate.arm"] == "ngram:3"
        names = {m.name for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
                 for m in sm.metrics}
        assert {"specgate.requests", "specgate.decision.duration", "specgate.output_tokens_per_s"} <= names
    finally:
        server.stop(0)
        engine.close()
