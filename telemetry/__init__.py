"""telemetry: what served requests teach, and how it reaches the gateways (imports engines and policy).

    record.py        the outcome record: one typed, versioned schema, written and read here
    outcomes.py      outcome sinks: a Redis Stream behind a bounded queue, or memory
    acceptance.py    rolling acceptance per (tenant, draft, category) for the acceptance guard
    artifacts.py     signed policy models in Redis: publish, verify, watch, roll back
    retrainer.py     outcomes in, better policies out (consumer group, fit, offline score, promote)
    otel.py          OpenTelemetry providers, spans' attributes, metrics
    redis_server.py  a private, supervised redis-server on loopback; outage logging
    runtime.py       starts all of the above for a gateway and returns its closers
    config.py        TelemetryConfig
    cmd_*.py         `specgate retrain`, `specgate rollback`
"""
