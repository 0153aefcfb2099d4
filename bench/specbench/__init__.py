"""`specgate bench`: the end-to-end proof. Replays a Spec-Bench-style workload
through a gateway under every fixed arm and the adaptive policy, derives the
per-request oracle, records the learning curve from a cold start, and writes
JSON, a Markdown report and PNG plots.

    workload.py   the requests (prompt, category, temperature, seed)
    runner.py     sending them: interleaved at concurrency 1, per mode above it
    stack.py      the gateway + Redis + retrainer it starts when none is given
    analysis.py   pure arithmetic: oracle, speedups, identity check, curves
    report.py     Markdown and plots
    cli.py        arguments and the order of the phases
    replay.py     `specgate bench-replay`: a run's concurrency-1 requests priced for any policy, offline
    gate.py       `specgate bench-gate`: the retrainer's promotion gate on learning streams priced by runs
"""
