"""Outcome records through a Redis Stream, and rolling acceptance per (draft, category).

Writing never blocks or fails a request: `emit` appends to a bounded in-memory
queue and a background thread ships batches with one pipeline per flush. While
Redis is down the queue holds records until it returns; past the bound the
oldest are dropped and counted.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
STREAM = "specgate:outcomes"
ACCEPT_PREFIX = "specgate:accept:"  # + draft + ":" + category -> hash {drafted, accepted} (decayed)

# Decayed sums, atomically: new = old * decay + x. Rolling acceptance = accepted / drafted.
_DECAY = """
local d = tonumber(ARGV[3])
local drafted = tonumber(redis.call('HGET', KEYS[1], 'drafted') or '0') * d + tonumber(ARGV[1])
local accepted = tonumber(redis.call('HGET', KEYS[1], 'accepted') or '0') * d + tonumber(ARGV[2])
local rounds = tonumber(redis.call('HGET', KEYS[1], 'rounds') or '0') * d + tonumber(ARGV[4])
redis.call('HSET', KEYS[1], 'drafted', drafted, 'accepted', accepted, 'rounds', rounds)
return 1
"""


def outcome_record(outcome, include_prompt: bool = False, prompt: str | None = None) -> dict:
    """The versioned record of one finished request (no prompt text unless asked)."""
    # shallow: an Outcome holds plain dicts already; asdict's deep copy costs ~40 µs
    d = dict(vars(outcome)) if not isinstance(outcome, dict) else dict(outcome)
    d["schema"] = SCHEMA_VERSION
    if include_prompt and prompt is not None:
        d["prompt"] = prompt
    return d


class RedisOutcomeSink:
    def __init__(self, client, max_queue: int = 10_000, stream_maxlen: int = 1_000_000,
                 decay: float = 0.995, flush_interval_s: float = 0.05, include_prompt: bool = False):
        self.client = client
        self.include_prompt = include_prompt
        self._queue: deque[dict] = deque()
        self._max_queue = max_queue
        self._maxlen = stream_maxlen
        self._decay = decay
        self._interval = flush_interval_s
        self._cond = threading.Condition()
        self._stop = False
        self.dropped = 0
        self.written = 0
        self.redis_up = True
        self._script = client.register_script(_DECAY)
        self._thread = threading.Thread(target=self._run, name="specgate-outcomes", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        return len(self._queue)

    def emit(self, outcome) -> None:
        record = outcome_record(outcome)
        with self._cond:
            if len(self._queue) >= self._max_queue:
                self._queue.popleft()
                self.dropped += 1
                if self.dropped in (1, 10, 100) or self.dropped % 1000 == 0:
                    log.warning("telemetry queue full (%d): %d outcome records dropped so far",
                                self._max_queue, self.dropped)
            self._queue.append(record)
            self._cond.notify()

    def _run(self) -> None:
        backoff = self._interval
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait(1.0)
                if self._stop and not self._queue:
                    return
                batch = list(self._queue)[:500]
            try:
                self._write(batch)
            except Exception as e:  # noqa: BLE001 - Redis down or flaky: keep the records, retry
                if self.redis_up:
                    log.warning("telemetry: Redis unavailable (%s); holding %d records", type(e).__name__,
                                len(self._queue))
                self.redis_up = False
                time.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            if not self.redis_up:
                log.info("telemetry: Redis is back; delivering held records")
            self.redis_up, backoff = True, self._interval
            with self._cond:
                # remove exactly what was written: new records may have arrived behind
                # them, and the oldest may have been dropped for space meanwhile
                for rec in batch:
                    if self._queue and self._queue[0] is rec:
                        self._queue.popleft()
            self.written += len(batch)
            time.sleep(self._interval)

    def _write(self, batch: list[dict]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for rec in batch:
            pipe.xadd(STREAM, {"v": str(SCHEMA_VERSION), "id": rec["request_id"], "record": json.dumps(rec)},
                      maxlen=self._maxlen, approximate=True)
            res, cat = rec.get("result", {}), rec.get("features", {}).get("category", "")
            draft = (rec.get("decision") or {}).get("draft")
            if draft and res.get("drafted", 0) > 0:
                self._script(keys=[f"{ACCEPT_PREFIX}{draft}:{cat}"],
                             args=[res["drafted"], res["accepted"], self._decay, res.get("rounds", 0)],
                             client=pipe)
        pipe.execute()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued so far is written (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queue and time.monotonic() < deadline:
            time.sleep(0.02)
        return not self._queue

    def close(self, timeout: float = 5.0) -> None:
        self.flush(timeout)
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout)


def read_rolling_acceptance(client) -> dict[str, dict[str, tuple[float, int]]]:
    """category -> draft -> (rolling acceptance, decayed drafted count)."""
    out: dict[str, dict[str, tuple[float, int]]] = {}
    for key in client.scan_iter(match=ACCEPT_PREFIX + "*", count=1000):
        key = key.decode() if isinstance(key, bytes) else key
        draft, _, cat = key[len(ACCEPT_PREFIX):].partition(":")
        h = client.hgetall(key)
        drafted = float(h.get(b"drafted", h.get("drafted", 0)) or 0)
        accepted = float(h.get(b"accepted", h.get("accepted", 0)) or 0)
        if drafted > 0:
            out.setdefault(cat, {})[draft] = (accepted / drafted, int(drafted))
    return out


class RollingAcceptance:
    """A gateway's copy of the shared rolling acceptance, refreshed in the background."""

    def __init__(self, client, interval_s: float = 1.0):
        self.client = client
        self.table: dict[str, dict[str, tuple[float, int]]] = {}
        self._stop = threading.Event()
        threading.Thread(target=self._run, args=(interval_s,), name="specgate-acceptance", daemon=True).start()

    def _run(self, interval: float) -> None:
        while True:
            try:
                self.table = read_rolling_acceptance(self.client)
            except Exception:  # noqa: BLE001 - stale numbers are fine while Redis is away
                pass
            if self._stop.wait(interval):
                return

    def for_category(self, category: str) -> dict[str, tuple[float, int]]:
        return self.table.get(category, {})

    def close(self) -> None:
        self._stop.set()
