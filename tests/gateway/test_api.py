"""The public API through a real channel: unary, streaming, decide, status,
health, reflection, bad fields, deadlines, cancellation, auth, concurrency, and a
request whose draft fails."""

import http.client
import json
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engines.config import EngineConfig, NgramDraftConfig, TargetConfig
from gateway.config import AuthConfig
from gateway.pb import specgate_pb2 as pb
from telemetry.otel import Instrumentation
from telemetry.outcomes import MemoryOutcomeSink
from tests.helpers import SLOW, RaisingDraft, key, request, slow_engine, start_gateway, tiny_engine, wait_idle


def test_generate_returns_text_decision_stats_and_request_id(gw):
    resp, call = gw.stub.Generate.with_call(request(arm="ngram:3"), metadata=(("x-request-id", "abc-123"),))
    assert resp.request_id == "abc-123" and ("x-request-id", "abc-123") in call.trailing_metadata()
    assert resp.text and resp.usage.output_tokens > 0 and resp.usage.prompt_tokens > 0
    d = resp.decision
    assert d.arm == "ngram:3" and d.source == "request" and d.speculative and d.draft == "ngram" and d.gamma == 3
    assert d.policy_version == "prior" and d.rules_version and d.reason
    assert resp.spec.rounds > 0 and resp.timings.total_s >= resp.timings.ttft_s > 0
    assert resp.engine == "local" and resp.finish_reason in ("stop", "length")


def test_generated_request_ids_are_unique(gw):
    ids = {gw.stub.Generate(request(max_tokens=1)).request_id for _ in range(5)}
    assert len(ids) == 5


def test_stream_chunks_add_up_to_the_final_text(gw):
    call = gw.stub.GenerateStream(request(max_tokens=12), metadata=(("x-request-id", "s-1"),))
    assert ("x-request-id", "s-1") in call.initial_metadata()  # before the first chunk
    events = list(call)
    assert events[-1].HasField("final") and all(e.HasField("text") for e in events[:-1])
    assert "".join(e.text for e in events[:-1]) == events[-1].final.text
    assert len(events) > 2


def test_greedy_output_is_the_same_for_every_arm(gw):
    texts = {gw.stub.Generate(request(max_tokens=16, arm=arm)).text for arm in ("plain", "ngram:1", "ngram:6")}
    assert len(texts) == 1


def test_chat_messages(gw):
    resp = gw.stub.Generate(pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="hello world")],
                                               max_tokens=4))
    assert resp.usage.prompt_tokens >= 2


def test_decide_is_a_dry_run_with_features(gw):
    resp = gw.stub.Decide(request(category="summarization", expected_output_tokens=50, temperature=0.5, max_tokens=64))
    assert resp.features.category == "summarization" and resp.features.expected_output_tokens == 50
    assert resp.features.temperature == pytest.approx(0.5)
    assert resp.decision.arm in resp.decision.predicted_speedups and resp.decision.reason


def test_a_burst_is_decided_on_the_load_it_makes_before_the_engine_reports_it():
    """An engine whose load report lags (a worker between health checks reports the
    load of its last check): the gateway's own generations in flight are a floor on
    the load a decision sees."""
    from engines.api import LoadSnapshot
    from gateway.endpoints.local import LocalEndpoint

    class Lagging(LocalEndpoint):
        def load(self):
            return LoadSnapshot()  # idle, whatever runs

    engine, sink = slow_engine(), MemoryOutcomeSink()
    g = start_gateway(endpoints=[Lagging(engine)], sink=sink)
    try:
        streams = [g.stub.GenerateStream(pb.GenerateRequest(**SLOW)) for _ in range(3)]
        for s in streams:
            next(s)  # all three generating
        f = g.stub.Decide(request()).features
        assert f.running + f.waiting == 3  # a dry run: every generation in flight is another's
        served = g.stub.Generate(request(max_tokens=2))
        record = next(r for r in sink.items if r.request_id == served.request_id)
        assert record.features.load == 3  # a generation does not count itself
        for s in streams:
            s.cancel()
        assert wait_idle(engine, 5.0)
        deadline = time.monotonic() + 5
        while g.service.active and time.monotonic() < deadline:
            time.sleep(0.01)
        f = g.stub.Decide(request()).features
        assert f.running + f.waiting == 0
    finally:
        g.close()
        engine.close()


def test_status_lists_engines_arms_and_versions(gw):
    s = gw.stub.GetStatus(pb.GetStatusRequest())
    assert s.policy_version == "prior" and s.rules_version
    (e,) = s.engines
    assert e.id == "local" and e.healthy and list(e.drafts) == ["ngram"] and e.gamma_max == 6 and e.max_context == 96


def test_health_and_reflection_work_without_a_proto(gw):
    h = health_pb2_grpc.HealthStub(gw.channel)
    assert h.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
    assert h.Check(health_pb2.HealthCheckRequest(service="specgate.v1.Gateway")).status == \
        health_pb2.HealthCheckResponse.SERVING
    r = reflection_pb2_grpc.ServerReflectionStub(gw.channel)
    out = next(r.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in out.list_services_response.service}
    assert {"specgate.v1.Gateway", "grpc.health.v1.Health"} <= names
    fd = next(r.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
        file_containing_symbol="specgate.v1.Gateway")])))
    assert fd.file_descriptor_response.file_descriptor_proto


@pytest.mark.parametrize("field,req", [
    ("prompt", pb.GenerateRequest()),
    ("prompt", pb.GenerateRequest(prompt="x", messages=[pb.ChatMessage(role="user", content="y")])),
    ("max_tokens", request(max_tokens=0)),
    ("max_tokens", request(max_tokens=500)),  # beyond the 96-token context
    ("temperature", request(temperature=-1)),
    ("temperature", request(temperature=float("nan"))),
    ("top_p", request(top_p=0)),
    ("top_p", request(top_p=1.5)),
    ("top_k", request(top_k=-1)),
    ("stop", request(stop=[""])),
    ("category", request(category="poetry")),
    ("expected_output_tokens", request(expected_output_tokens=0)),
    ("arm", request(arm="ngram")),
    ("arm.gamma", request(arm="ngram:7")),
    ("arm.draft", request(arm="medusa:2")),
    ("messages[0].role", pb.GenerateRequest(messages=[pb.ChatMessage(role="god", content="hi")])),
    ("prompt", request(prompt="a\x00b")),
])
def test_each_bad_field_is_invalid_argument_naming_it(gw, field, req):
    with pytest.raises(grpc.RpcError) as e:
        gw.stub.Generate(req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(field + ":"), e.value.details()


def test_deadline_exceeded_and_the_slot_is_freed():
    g = start_gateway(slow_engine())
    try:
        with pytest.raises(grpc.RpcError) as e:
            g.stub.Generate(pb.GenerateRequest(**SLOW), timeout=0.3)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert wait_idle(g.engine, 3.0), "the engine kept decoding for a client that had gone"
    finally:
        g.close()


def test_client_cancellation_reaches_the_engine():
    g = start_gateway(slow_engine())
    try:
        stream = g.stub.GenerateStream(pb.GenerateRequest(**SLOW))
        next(stream)  # generation is running
        assert g.engine.load().running == 1
        stream.cancel()
        assert wait_idle(g.engine, 3.0)
        assert g.stub.Generate(request(max_tokens=2)).usage.output_tokens > 0  # still serving
    finally:
        g.close()


def test_full_engine_gives_resource_exhausted():
    g = start_gateway(slow_engine(max_queue=1))
    try:
        streams = [g.stub.GenerateStream(pb.GenerateRequest(**SLOW))]
        next(streams[0])  # running
        streams.append(g.stub.GenerateStream(pb.GenerateRequest(**SLOW)))
        deadline = time.monotonic() + 5
        while g.engine.load().waiting < 1 and time.monotonic() < deadline:
            time.sleep(0.01)  # the second is queued
        with pytest.raises(grpc.RpcError) as e:
            g.stub.Generate(request())
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "overloaded" in e.value.details()
        for s in streams:
            s.cancel()
    finally:
        g.close()


def test_auth_no_key_wrong_key_other_tenant_and_open_health():
    keys = AuthConfig(keys=[key("acme", "s3cret"), key("reader", "r3ad", methods=["Decide"])])
    g = start_gateway(keys=keys)
    try:
        for meta, code in [((), grpc.StatusCode.UNAUTHENTICATED),
                           ((("authorization", "Bearer nope"),), grpc.StatusCode.UNAUTHENTICATED),
                           ((("authorization", "Basic s3cret"),), grpc.StatusCode.UNAUTHENTICATED),
                           ((("authorization", "Bearer r3ad"),), grpc.StatusCode.PERMISSION_DENIED)]:
            with pytest.raises(grpc.RpcError) as e:
                g.stub.Generate(request(), metadata=meta)
            assert e.value.code() == code
            assert "s3cret" not in e.value.details() and "nope" not in e.value.details()
        ok = g.stub.Decide(request(), metadata=(("authorization", "Bearer r3ad"),))
        assert ok.features.tenant == "reader"  # the tenant is a policy feature
        assert g.stub.Generate(request(), metadata=(("authorization", "Bearer s3cret"),)).text
        h = health_pb2_grpc.HealthStub(g.channel)
        assert h.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
    finally:
        g.close()


def test_without_keys_only_loopback_is_allowed():
    eng = tiny_engine()
    try:
        with pytest.raises(ValueError, match="without API keys"):
            start_gateway(eng, listen="0.0.0.0:0")
    finally:
        eng.close()


def test_concurrent_clients_all_get_their_answers(gw):
    errors, results = [], []

    def client(i):
        try:
            for j in range(4):
                r = gw.stub.Generate(request(max_tokens=4, seed=i * 10 + j, temperature=0.8))
                results.append(r.request_id)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(set(results)) == 32


def test_drain_finishes_in_flight_calls_and_refuses_new_ones():
    g = start_gateway(slow_engine())
    try:
        results, errors = [], []

        def call():
            try:
                results.append(g.stub.Generate(pb.GenerateRequest(**{**SLOW, "max_tokens": 15}), timeout=30))
            except grpc.RpcError as e:
                errors.append(e)

        threads = [threading.Thread(target=call) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.3)  # all three are in flight
        draining = threading.Thread(target=g.serving.stop, args=(20,))
        draining.start()
        time.sleep(0.2)
        with pytest.raises(grpc.RpcError) as e:  # new calls are refused
            g.stub.Generate(request(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        for t in threads:
            t.join(30)
        assert not errors and len(results) == 3 and all(r.usage.output_tokens == 15 for r in results)
        draining.join(10)
        assert not draining.is_alive()
    finally:
        g.engine.close()
        g.channel.close()


def test_a_request_whose_draft_fails_gets_the_targets_output_and_says_so():
    """Drafting that raises mid-request: the caller still gets the target's output
    (over gRPC and the OpenAI API alike), with spec.draft_error naming the draft;
    the outcome record and the request's span keep it and the draft_errors counter
    counts it per draft."""
    cfg = EngineConfig(target=TargetConfig(max_context=96), drafts=[NgramDraftConfig(name="broken")], gamma_max=4)
    reader, sink, spans = InMemoryMetricReader(), MemoryOutcomeSink(), InMemorySpanExporter()
    tracing = TracerProvider()
    tracing.add_span_processor(SimpleSpanProcessor(spans))
    g = start_gateway(tiny_engine(cfg, broken=lambda cap: RaisingDraft()), http=True, sink=sink,
                      instrumentation=Instrumentation(tracing, MeterProvider(metric_readers=[reader])))
    try:
        plain = g.stub.Generate(request(arm="plain"))
        assert plain.spec.draft_error == ""
        failed = g.stub.Generate(request(arm="broken:3"))
        assert failed.decision.arm == "broken:3" and failed.text == plain.text and failed.spec.drafted == 0
        assert failed.spec.draft_error == "drafting with broken failed (RuntimeError): decoded on without drafts"
        conn = http.client.HTTPConnection("127.0.0.1", g.http_port, timeout=30)
        conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"}, body=json.dumps(
            {"prompt": "hello world the cat", "max_tokens": 8, "temperature": 0, "specgate": {"arm": "broken:3"}}))
        body = json.loads(conn.getresponse().read())
        conn.close()
        assert body["choices"][0]["text"] == plain.text
        assert body["specgate"]["spec"]["draft_error"] == failed.spec.draft_error
        records = {r.request_id: r.result.draft_error for r in sink.items}
        assert records[plain.request_id] == "" and records[failed.request_id] == failed.spec.draft_error
        counts = {tuple(p.attributes.items()): p.value for rm in reader.get_metrics_data().resource_metrics
                  for sm in rm.scope_metrics for m in sm.metrics if m.name == "specgate.draft_errors"
                  for p in m.data.data_points}
        assert counts == {(("draft", "broken"),): 2}
        deadline = time.monotonic() + 5  # a request's span ends as its call's handler returns
        while len([x for x in spans.get_finished_spans() if x.name == "specgate.generate_request"]) < 3 and \
                time.monotonic() < deadline:
            time.sleep(0.01)
        said = sorted(x.attributes.get("specgate.spec.draft_error", "") for x in spans.get_finished_spans()
                      if x.name == "specgate.generate_request")
        assert said == ["", failed.spec.draft_error, failed.spec.draft_error]
    finally:
        g.close()
