"""OpenTelemetry: a span per request with child spans for the decision, the
queue wait and the engine's generation, and the gateway's metrics.

Attribute names follow the OpenTelemetry GenAI semantic conventions where they
apply (gen_ai.*); the decision's own attributes live under specgate.*.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal

from opentelemetry import trace
from opentelemetry.propagators.textmap import DefaultGetter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

Exporter = Literal["none", "console", "otlp-grpc", "otlp-http"]
_PROPAGATOR = TraceContextTextMapPropagator()


def build_providers(exporter: Exporter, endpoint: str | None = None, service_name: str = "specgate-gateway",
                    extra_readers: tuple = ()) -> tuple[TracerProvider, MeterProvider]:
    """Providers for the configured exporter; 'none' records nothing (no processor).
    `extra_readers`: e.g. the Prometheus reader behind the HTTP /metrics."""
    resource = Resource.create({"service.name": service_name})
    tp = TracerProvider(resource=resource)
    readers = list(extra_readers)
    if exporter == "console":
        tp.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter(), export_interval_millis=60_000))
    elif exporter in ("otlp-grpc", "otlp-http"):
        try:
            if exporter == "otlp-grpc":
                from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            else:
                from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as e:
            raise RuntimeError(f"exporter {exporter} needs the package opentelemetry-exporter-"
                               f"otlp-proto-{exporter.split('-')[1]}") from e
        kw = {"endpoint": endpoint} if endpoint else {}
        tp.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(**kw)))
        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter(**kw)))
    return tp, MeterProvider(resource=resource, metric_readers=readers)


def extract_context(carrier: dict[str, str]):
    """W3C trace context (traceparent/tracestate) from gRPC metadata."""
    return _PROPAGATOR.extract(carrier, getter=DefaultGetter()) if carrier else None


def prometheus_reader() -> tuple[object, Callable[[], bytes]]:
    """A metric reader for the MeterProvider and a function rendering the
    Prometheus text exposition (the HTTP API's /metrics)."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import REGISTRY, generate_latest

    return PrometheusMetricReader(), lambda: generate_latest(REGISTRY)


class Instrumentation:
    """Tracer and metric instruments of one gateway, built in the composition
    root and passed in. `sink`: the outcome sink, whose queue depth, writes,
    drops and Redis state become metrics."""

    def __init__(self, tracer_provider: TracerProvider | None = None, meter_provider: MeterProvider | None = None,
                 sink=None):
        self.tracer = (tracer_provider or trace.NoOpTracerProvider()).get_tracer("specgate.gateway")
        mp = meter_provider or MeterProvider()
        meter = self._meter = mp.get_meter("specgate.gateway")
        self.requests = meter.create_counter("specgate.requests", description="requests by arm and source")
        self.acceptance = meter.create_histogram("specgate.acceptance_rate", description="per-request acceptance")
        self.draft_errors = meter.create_counter("specgate.draft_errors", description="requests whose drafting "
                                                 "failed, by draft (decoded on without drafts)")
        self.tokens_per_s = meter.create_histogram("specgate.output_tokens_per_s",
                                                   description="a request's output tokens per second")
        self.decision_latency = meter.create_histogram("specgate.decision.duration", unit="s")
        self.ttft = meter.create_histogram("gen_ai.server.time_to_first_token", unit="s")
        from opentelemetry.metrics import Observation

        if sink is not None:
            meter.create_observable_gauge("specgate.telemetry.queue_depth", description="outcome records held",
                                          callbacks=[lambda _o: [Observation(sink.depth)]])
            meter.create_observable_counter("specgate.telemetry.written", description="outcome records written",
                                            callbacks=[lambda _o: [Observation(sink.written)]])
            meter.create_observable_counter("specgate.telemetry.dropped", description="outcome records dropped "
                                            "past the bound", callbacks=[lambda _o: [Observation(sink.dropped)]])
            meter.create_observable_gauge("specgate.telemetry.redis_up", description="1 while Redis takes writes",
                                          callbacks=[lambda _o: [Observation(int(sink.redis_up))]])

    def watch(self, loads: Callable[[], dict], active: Callable[[], int]) -> None:
        """Gauges of the live load of every endpoint ({id: LoadSnapshot}) and of the
        generations in flight in this gateway."""
        from opentelemetry.metrics import Observation

        def running(_o):
            return [Observation(v.running, {"engine": k}) for k, v in loads().items()]

        def waiting(_o):
            return [Observation(v.waiting, {"engine": k}) for k, v in loads().items()]

        self._meter.create_observable_gauge("specgate.engine.running", callbacks=[running],
                                            description="sequences the engine is decoding")
        self._meter.create_observable_gauge("specgate.engine.waiting", callbacks=[waiting],
                                            description="requests queued in the engine")
        self._meter.create_observable_gauge("specgate.generations.active", callbacks=[lambda _o: [Observation(
            active())]], description="generations in flight in this gateway")


def decision_attributes(features, decision) -> dict:
    return {
        "gen_ai.request.temperature": features.temperature,
        "gen_ai.request.top_p": features.top_p,
        "specgate.category": features.category,
        "specgate.expected_output_tokens": features.expected_output_tokens,
        "specgate.load": features.load,
        "specgate.arm": decision.arm.name,
        "specgate.draft": decision.arm.draft or "",
        "specgate.gamma": decision.arm.gamma,
        "specgate.decision.source": decision.source,
        "specgate.rule": decision.rule or "",
        "specgate.policy_version": decision.policy_version,
        "specgate.predicted_speedup": decision.predicted_speedup.get(decision.arm.name, 1.0),
        "specgate.explored": decision.explored,
    }


def outcome_attributes(stats, ttft_s: float) -> dict:
    a = {
        "gen_ai.usage.input_tokens": stats.prompt_tokens,
        "gen_ai.usage.output_tokens": stats.output_tokens,
        "gen_ai.response.finish_reasons": [stats.finish_reason],
        "specgate.spec.drafted": stats.drafted,
        "specgate.spec.accepted": stats.accepted,
        "specgate.spec.acceptance_rate": stats.acceptance_rate,
        "specgate.spec.acceptance_source": stats.acceptance_source,  # measured, reported, estimated, unknown
        "specgate.time_to_first_token_s": ttft_s,
    }
    if stats.draft_error:  # drafting failed mid-request: the rest decoded without drafts
        a["specgate.spec.draft_error"] = stats.draft_error
    return a


def ns(perf_t: float, perf_ref: float, wall_ref_ns: int) -> int:
    """A perf_counter instant as wall-clock nanoseconds (for spans timed afterwards)."""
    return wall_ref_ns + int((perf_t - perf_ref) * 1e9)


def now_refs() -> tuple[float, int]:
    return time.perf_counter(), time.time_ns()
