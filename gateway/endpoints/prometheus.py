"""Reading the Prometheus text format that serving engines expose on /metrics.

Only what the gateway needs: a metric's value summed over its label sets
(vLLM, for one, labels every series with the model name)."""

from __future__ import annotations

import math

MAX_METRICS_BYTES = 4 << 20  # a /metrics page larger than this is not read


def parse_sums(text: str, names: set[str]) -> dict[str, float]:
    """{name: sum of its samples} for the metric names asked for. Comments,
    other metrics and malformed lines are skipped; absent names are absent."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        if space < 0:
            continue
        if 0 <= brace < space:  # name{labels} value [timestamp]
            name = line[:brace]
            close = line.rfind("}")
            rest = line[close + 1:].split() if close > brace else []
        else:
            name, rest = line[:space], line[space + 1:].split()
        if name not in names or not rest:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        if math.isfinite(value):
            out[name] = out.get(name, 0.0) + value
    return out
