"""Outcome records into a Redis Stream (and the rolling acceptance they update).

Writing never blocks or fails a request: `emit` appends to a bounded in-memory
queue and a background thread ships batches with one pipeline per flush. While
Redis is down the queue holds records until it returns; past the bound the
oldest are dropped and counted. An outage is logged once, and its end once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from telemetry import acceptance
from telemetry.record import SCHEMA_VERSION, OutcomeRecord

log = logging.getLogger(__name__)

STREAM = "specgate:outcomes"


class RedisOutcomeSink:
    def __init__(self, client, max_queue: int = 10_000, stream_maxlen: int = 1_000_000,
                 decay: float = 0.995, flush_interval_s: float = 0.05):
        self.client = client
        self._queue: deque[OutcomeRecord] = deque()
        self._max_queue = max_queue
        self._maxlen = stream_maxlen
        self._decay = decay
        self._interval = flush_interval_s
        self._cond = threading.Condition()
        self._stop = False
        self.dropped = 0
        self.written = 0
        self.redis_up = True
        self._script = client.register_script(acceptance.DECAY_SCRIPT)
        self._thread = threading.Thread(target=self._run, name="specgate-outcomes", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        return len(self._queue)

    def emit(self, record: OutcomeRecord) -> None:
        """Queue one record (serialised off the request path)."""
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

    def _write(self, batch: list[OutcomeRecord]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for rec in batch:
            pipe.xadd(STREAM, {"v": str(SCHEMA_VERSION), "id": rec.request_id, "record": rec.to_json()},
                      maxlen=self._maxlen, approximate=True)
            update = acceptance.update_for(rec)
            if update is not None:
                k, verified, accepted, rounds = update
                self._script(keys=[k], args=[verified, accepted, self._decay, rounds], client=pipe)
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


class MemoryOutcomeSink:
    """Without Redis: the latest records in memory (learning is off)."""

    def __init__(self, maxlen: int = 10_000):
        self.items: deque[OutcomeRecord] = deque(maxlen=maxlen)
        self.dropped = self.written = 0
        self.redis_up = False

    @property
    def depth(self) -> int:
        return 0

    def emit(self, record: OutcomeRecord) -> None:
        self.items.append(record)

    def flush(self, timeout: float = 0.0) -> bool:
        return True

    def close(self, timeout: float = 0.0) -> None:
        pass
