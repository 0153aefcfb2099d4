"""Rolling acceptance per (tenant, draft, category), shared through Redis: the
evidence the operator rules' acceptance guard reads.

Only requests the policy chose (not ones whose arm a request or a rule forced)
count, under the category the classifier gave (not a hint it disagreed with),
and every tenant has its own tally: one tenant's odd traffic cannot switch a
draft off for another. Evidence is counted in rounds, decayed per update.

Acceptance is per token sent to verification, not per token drafted: the
adaptive engine drafts freely and verifies only what it expects to keep, so
accepted over drafted reads low whether or not verification pays (prompt
lookup: 5 of 420 drafted tokens on one chat prompt), and the guard, judging by
it, had switched prompt lookup off for summarization and rag, fixed
prompt-lookup requests included, in a `specgate bench` run.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)

PREFIX = "specgate:accept:"  # + tenant + "|" + draft + "|" + category -> hash {verified, accepted, rounds}

# Decayed sums, atomically: new = old * decay + x. Rolling acceptance = accepted / verified.
DECAY_SCRIPT = """
local d = tonumber(ARGV[3])
local verified = tonumber(redis.call('HGET', KEYS[1], 'verified') or '0') * d + tonumber(ARGV[1])
local accepted = tonumber(redis.call('HGET', KEYS[1], 'accepted') or '0') * d + tonumber(ARGV[2])
local rounds = tonumber(redis.call('HGET', KEYS[1], 'rounds') or '0') * d + tonumber(ARGV[4])
redis.call('HSET', KEYS[1], 'verified', verified, 'accepted', accepted, 'rounds', rounds)
return 1
"""


def key(tenant: str, draft: str, category: str) -> str:
    return f"{PREFIX}{tenant}|{draft}|{category}"


def update_for(record) -> tuple[str, int, int, int] | None:
    """(key, verified, accepted, rounds) a telemetry.record.OutcomeRecord adds, or None."""
    res, draft = record.result, record.decision.arm.draft
    if draft is None or not record.policy_chosen or res.verified <= 0:
        return None
    return key(record.tenant, draft, record.guard_category), res.verified, res.accepted, res.rounds


Table = dict[tuple[str, str], dict[str, tuple[float, float]]]  # (tenant, category) -> draft -> (acceptance, rounds)


def read_table(client) -> Table:
    out: Table = {}
    for k in client.scan_iter(match=PREFIX + "*", count=1000):
        k = k.decode() if isinstance(k, bytes) else k
        parts = k[len(PREFIX):].split("|")
        if len(parts) != 3:
            continue
        tenant, draft, cat = parts
        h = {(f.decode() if isinstance(f, bytes) else f): v for f, v in client.hgetall(k).items()}
        verified = float(h.get("verified", 0) or 0)
        if verified > 0:
            out.setdefault((tenant, cat), {})[draft] = (float(h.get("accepted", 0) or 0) / verified,
                                                        float(h.get("rounds", 0) or 0))
    return out


class RollingAcceptance:
    """A gateway's copy of the shared table, refreshed in the background (stale
    numbers are fine while Redis is away)."""

    def __init__(self, client, interval_s: float = 1.0):
        self.client = client
        self.table: Table = {}
        self._stop = threading.Event()
        threading.Thread(target=self._run, args=(interval_s,), name="specgate-acceptance", daemon=True).start()

    def _run(self, interval: float) -> None:
        while True:
            try:
                self.table = read_table(self.client)
            except Exception:  # noqa: BLE001 - Redis away: keep the last table
                pass
            if self._stop.wait(interval):
                return

    def lookup(self, tenant: str, category: str) -> dict[str, tuple[float, float]]:
        return self.table.get((tenant, category), {})

    def close(self) -> None:
        self._stop.set()
