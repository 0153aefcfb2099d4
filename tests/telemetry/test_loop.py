"""The whole loop on real parts: gateway -> Redis stream -> retrainer -> signed
model -> the running gateway; and the spans each request leaves."""

import dataclasses
import gc
import json
import time

import redis
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engines.api import GenerationStats
from engines.arms import ArmMenu
from gateway.pb import specgate_pb2 as pb
from policy.decide import Decision
from policy.model import prior_model
from policy.train import fit
from telemetry.artifacts import ModelWatcher, publish
from telemetry.otel import Instrumentation
from telemetry.outcomes import STREAM, RedisOutcomeSink
from telemetry.record import OutcomeRecord
from telemetry.retrainer import Retrainer
from tests.helpers import start_gateway, world_outcomes

KEY = b"s" * 32


def synthetic_records(n):
    """Outcome records as the gateway writes them, from the synthetic world."""
    for i, row in enumerate(world_outcomes(n, seed=4)):
        stats = GenerationStats(arm=row.arm.name, output_tokens=row.output_tokens, rounds=row.rounds,
                                total_s=row.decode_s + 0.01, prefill_s=0.01)
        decision = Decision(row.arm, "exploration", None, "prior", "r", {}, row.propensity)
        yield OutcomeRecord.of(f"syn{i}", "", "sim", row.features, decision, stats, 0.01)


def test_retrain_promote_and_the_running_gateway_serves_the_new_version(rclient, redis_server):
    client = redis.Redis.from_url(redis_server.url)
    sink = RedisOutcomeSink(client)
    g = start_gateway(sink=sink)
    policy = g.service.policy
    watcher = ModelWatcher(client, KEY, policy.set_model, poll_s=0.5)
    stub = g.stub
    try:
        # real requests leave real records
        for _ in range(5):
            assert stub.Generate(pb.GenerateRequest(prompt="hello world", max_tokens=3)).decision.policy_version \
                == "prior"
        assert sink.flush(10) and client.xlen(STREAM) == 5
        rec = json.loads(client.xrange(STREAM, count=1)[0][1][b"record"])
        assert rec["decision"]["policy_version"] == "prior" and rec["result"]["output_tokens"] == 3
        # plus a synthetic history rich enough to learn from
        for r in synthetic_records(3000):
            client.xadd(STREAM, {"v": "2", "id": r.request_id, "record": r.to_json()})

        retrainer = Retrainer(client, KEY, arms=ArmMenu(("ngram", "draft"), 1, 8), every=100, min_rows=100)
        while retrainer.consume(block_ms=100):
            pass
        assert len(retrainer.rows) == 3005
        assert retrainer.consume(block_ms=100) == 0  # everything acknowledged: read once
        model = retrainer.maybe_retrain(force=True)
        assert model is not None and retrainer.promoted == [model.version]
        judged = model.metrics["judgement"]  # promoted only on a lower bound of the gain above zero
        assert judged["promoted"] and judged["lower_bound"] > 0 and judged["candidate_value"] > judged["live_value"]

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
        g.close()
        watcher.close()
        sink.close()


def test_judgements_against_one_live_model_are_counted_and_a_promotion_starts_afresh(rclient, redis_server):
    client = redis.Redis.from_url(redis_server.url)
    retrainer = Retrainer(client, KEY, arms=ArmMenu(("ngram", "draft"), 1, 8), every=100, min_rows=100)
    # live: a model as good as any the rows can fit; enough rows that each half of the newer
    # ones fits both drafts (else the prior alone prices the differences, and nothing is tested)
    publish(client, fit(world_outcomes(3000, seed=5), version="v-live"), KEY)
    for r in synthetic_records(600):
        client.xadd(STREAM, {"v": "2", "id": r.request_id, "record": r.to_json()})
    while retrainer.consume(block_ms=100):
        pass
    for _ in range(3):  # no gain to show: the same candidate judged three times
        retrainer.maybe_retrain(force=True)
    early = retrainer.decisions[:3]
    assert [(d["attempt"], d["tested"], d["promoted"]) for d in early] == [(k, True, False) for k in (1, 2, 3)]
    assert early[0]["z"] < early[1]["z"] < early[2]["z"] and early[0]["lower_bound"] > early[2]["lower_bound"]
    # the count is Redis's, not the process's: a restarted retrainer goes on from it
    restarted = Retrainer(client, KEY, arms=ArmMenu(("ngram", "draft"), 1, 8))
    restarted.rows.extend(list(retrainer.rows)[:20])  # too few newer rows to judge: it could not have promoted
    restarted.retrain()
    assert (restarted.decisions[-1]["attempt"], restarted.decisions[-1]["tested"]) == (4, False)
    restarted.rows.extend(retrainer.rows)
    restarted.retrain()  # the untested judgement gave its number back
    assert (restarted.decisions[-1]["attempt"], restarted.decisions[-1]["tested"]) == (4, True)
    # a live model never judged against (here another retrainer's promotion): its judgements count from one
    publish(client, dataclasses.replace(prior_model(), version="v-other"), KEY)
    retrainer.maybe_retrain(force=True)
    assert (retrainer.decisions[-1]["live"], retrainer.decisions[-1]["attempt"]) == ("v-other", 1)


def test_spans_carry_decision_and_outcome_attributes_and_continue_the_callers_trace():
    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    instr = Instrumentation(tp, MeterProvider(metric_readers=[reader]))
    g = start_gateway(instrumentation=instr)
    try:
        stub = g.stub
        trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
        gc.disable()  # the request's span must end when the call does, not when its generator is collected
        try:
            resp = stub.Generate(pb.GenerateRequest(prompt="hello world the cat", max_tokens=6, temperature=0.3,
                                                    arm="ngram:3"),
                                 metadata=(("traceparent", f"00-{trace_id}-00f067aa0ba902b7-01"),))
            spans = {s.name: s for s in exporter.get_finished_spans()}
        finally:
            gc.enable()
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
        g.close()


def test_http_requests_continue_the_callers_trace_too():
    import http.client

    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    g = start_gateway(instrumentation=Instrumentation(tp), http=True)
    try:
        trace_id = "0af7651916cd43dd8448eb211c80319c"
        conn = http.client.HTTPConnection("127.0.0.1", g.http_port, timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "hello world", "max_tokens": 3}),
                     headers={"Content-Type": "application/json",
                              "traceparent": f"00-{trace_id}-b7ad6b7169203331-01"})
        assert conn.getresponse().status == 200
        conn.close()
        root = next(s for s in exporter.get_finished_spans() if s.name == "specgate.generate_request")
        assert format(root.context.trace_id, "032x") == trace_id
        assert format(root.parent.span_id, "016x") == "b7ad6b7169203331"
    finally:
        g.close()


def test_the_prompt_is_recorded_only_when_the_operator_asks():
    from telemetry.outcomes import MemoryOutcomeSink

    for include in (False, True):
        sink = MemoryOutcomeSink()
        g = start_gateway(sink=sink, telemetry={"include_prompt": include})
        try:
            g.stub.Generate(pb.GenerateRequest(prompt="a private prompt", max_tokens=2))
            deadline = time.monotonic() + 5
            while not sink.items and time.monotonic() < deadline:
                time.sleep(0.02)
            record = json.loads(sink.items[-1].to_json())
        finally:
            g.close()
        assert record.get("prompt") == ("a private prompt" if include else None)
        assert "private" not in json.dumps(record) or include
