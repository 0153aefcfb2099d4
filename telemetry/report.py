"""Does it pay? The operator's view of the outcome stream.

Per category and arm: requests, acceptance (accepted over verified draft
tokens), the speedup over plain the policy predicted and the one realised
(each request's tokens per second over what plain decoding managed at the same
load, from the plain requests in the same window), how often the acceptance
guard excluded a draft, and how many requests' drafting failed (served on
without drafts); then the policy versions over time and the retrainer's
promotion judgements.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from policy.train import observed_speed, plain_step_model
from telemetry.record import OutcomeRecord, RecordError


@dataclass
class Cell:
    requests: int = 0
    verified: int = 0
    accepted: int = 0
    predicted: list[float] = field(default_factory=list)
    realised: list[float] = field(default_factory=list)
    guarded: int = 0
    draft_errors: int = 0


def read(client, count: int) -> tuple[list[OutcomeRecord], int]:
    """The newest `count` records, oldest first, and how many could not be read."""
    from telemetry.outcomes import STREAM

    records, bad = [], 0
    for _, fields in reversed(client.xrevrange(STREAM, count=count)):
        try:
            records.append(OutcomeRecord.from_json(fields[b"record"]))
        except (RecordError, KeyError):
            bad += 1
    return records, bad


def summarise(records: list[OutcomeRecord]) -> dict:
    rows = [(rec, rec.training_row()) for rec in records]
    step = plain_step_model([r for _, r in rows if r is not None])
    cells: dict[tuple[str, str], Cell] = defaultdict(Cell)
    versions: list[tuple[float, str]] = []
    for rec, row in rows:
        arm = rec.decision.arm.name
        c = cells[(rec.features.category, arm)]
        c.requests += 1
        res = rec.result
        c.verified += res.verified
        c.accepted += res.accepted
        c.predicted.append(rec.decision.predicted_speedup.get(arm, 1.0))
        if row is not None:
            c.realised.append(observed_speed(row, step))
        c.guarded += "guard excluded" in rec.decision.reason
        c.draft_errors += bool(res.draft_error)
        if not versions or versions[-1][1] != rec.decision.policy_version:
            versions.append((rec.time, rec.decision.policy_version))
    table = {f"{cat}|{arm}": dict(category=cat, arm=arm, requests=c.requests,
                                  acceptance=round(c.accepted / c.verified, 3) if c.verified else None,
                                  predicted=round(float(np.mean(c.predicted)), 3),
                                  realised=round(float(np.median(c.realised)), 3) if c.realised else None,
                                  guard_trips=c.guarded, draft_errors=c.draft_errors)
             for (cat, arm), c in sorted(cells.items())}
    return dict(records=len(records), plain_step_s=[round(float(v), 5) for v in step], table=table,
                versions=[dict(time=t, version=v) for t, v in versions])


def markdown(summary: dict, decisions: list[dict]) -> str:
    lines = [f"{summary['records']} outcomes; plain step {summary['plain_step_s'][0] * 1e3:.1f} ms "
             f"+ {summary['plain_step_s'][1] * 1e3:.2f} ms per request of load", "",
             "| category | arm | requests | acceptance | predicted x | realised x | guard trips | draft errors |",
             "|---|---|---|---|---|---|---|---|"]
    for row in summary["table"].values():
        acc = "" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
        real = "" if row["realised"] is None else f"{row['realised']:.2f}"
        lines.append(f"| {row['category']} | {row['arm']} | {row['requests']} | {acc} | {row['predicted']:.2f} | "
                     f"{real} | {row['guard_trips']} | {row['draft_errors']} |")
    lines += ["", "Policy versions served, in order: " + " -> ".join(v["version"] for v in summary["versions"])]
    if decisions:
        # attempt (its z) and the prior-priced share: why a bound above zero may still not promote
        lines += ["", "| judged | candidate | live | rows judged | same choice | candidate value | live value | "
                      "lower bound | attempt (z) | prior-priced share | promoted | why |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for d in decisions:
            attempt = f"{d['attempt']} ({d.get('z')})" if "attempt" in d else ""  # older records: none
            priced = d.get("prior_priced")  # None: no newer rows judged
            lines.append(f"| {d.get('time', 0):.0f} | {d['candidate']} | {d['live']} | {d['evaluated_rows']} | "
                         f"{d.get('agreement')} | {d['candidate_value']} | {d['live_value']} | {d['lower_bound']} | "
                         f"{attempt} | {'' if priced is None else priced} | {d['promoted']} | {d.get('reason', '')} |")
    return "\n".join(lines)


def plot(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in summary["table"].values() if r["realised"] is not None and r["arm"] != "plain"]
    fig, ax = plt.subplots(figsize=(6, 5))
    ax.scatter([r["predicted"] for r in rows], [r["realised"] for r in rows],
               s=[10 + 3 * r["requests"] for r in rows], alpha=0.6)
    for r in rows:
        ax.annotate(f"{r['category']}/{r['arm']}", (r["predicted"], r["realised"]), fontsize=6)
    lim = max([1.5] + [r["predicted"] for r in rows] + [r["realised"] for r in rows])
    ax.plot([0, lim], [0, lim], color="grey", lw=0.8)
    ax.axhline(1.0, color="black", lw=0.6)
    ax.set_xlabel("predicted speedup over plain")
    ax.set_ylabel("realised speedup over plain (median)")
    ax.set_title("Does it pay? (per category and arm)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def decisions(client, count: int = 20) -> list[dict]:
    from telemetry.retrainer import DECISIONS

    out = []
    for raw in client.lrange(DECISIONS, 0, count - 1):
        try:
            out.append(json.loads(raw))
        except ValueError:
            continue
    return list(reversed(out))
