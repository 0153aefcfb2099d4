"""The retrainer: outcomes in, better policies out.

Reads the outcome stream through a consumer group (at-least-once; duplicates
dropped by request id), keeps a window of recent outcomes, and every N new ones
judges a candidate against the live model on outcomes the candidate was not
fit on (policy.train.judge: time split, doubly robust, a confidence bound
that tightens with every judgement against the same live model), promotes it
only when it is shown better, and records every judgement.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from engines.arms import ArmMenu
from policy.model import PolicyModel, prior_model
from policy.train import TrainingRow, judge
from telemetry.artifacts import ATTEMPTS, CURRENT, ArtifactError, load_verified, publish
from telemetry.outcomes import STREAM
from telemetry.record import OutcomeRecord, RecordError
from telemetry.redis_server import Outage

log = logging.getLogger(__name__)

GROUP = "specgate-retrainer"
DECISIONS = "specgate:model:decisions"  # every promotion judgement, newest first (JSON)
# give a reserved attempt back only if no judgement reserved one after it (its number is then unused)
_RELEASE = """if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  return redis.call('HINCRBY', KEYS[1], ARGV[1], -1) end
return -1"""


@dataclass
class Retrainer:
    client: object
    key: bytes
    consumer: str = "retrainer-1"
    window: int = 50_000
    every: int = 500
    min_rows: int = 200
    arms: ArmMenu = field(default_factory=lambda: ArmMenu(("ngram", "selfspec"), 1, 8))
    before_retrain: Callable[[], None] | None = None  # e.g. refresh `arms` from the live engines

    def __post_init__(self):
        self.rows: deque[TrainingRow] = deque(maxlen=self.window)
        self.unreadable = 0  # records skipped because this version cannot parse them
        self._seen: OrderedDict[str, None] = OrderedDict()  # request ids in the window (idempotence)
        self.new_since_fit = 0
        self.promoted: list[str] = []
        self.decisions: list[dict] = []
        self._group_ready = False

    def _ensure_group(self) -> None:
        """The consumer group, created on first use (and again after a Redis that lost its data)."""
        if self._group_ready:
            return
        try:
            self.client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self._group_ready = True

    def live_model(self) -> PolicyModel:
        current = self.client.get(CURRENT)
        if current is None:
            return prior_model()
        try:
            return load_verified(self.client, current.decode(), self.key)
        except ArtifactError as e:
            log.error("live model unusable (%s); comparing against the prior", e)
            return prior_model()

    def consume(self, block_ms: int = 1000, count: int = 1000) -> int:
        """Read pending-then-new records once; returns how many new rows were kept."""
        self._ensure_group()
        kept = 0
        for start in ("0", ">"):  # our unacknowledged ones first (after a crash), then new ones
            try:
                resp = self.client.xreadgroup(GROUP, self.consumer, {STREAM: start}, count=count,
                                              block=None if start == "0" else block_ms)
            except redis.ResponseError as e:
                if "NOGROUP" in str(e):  # Redis came back empty: the group goes with the data
                    self._group_ready = False
                raise
            for _, entries in resp or []:
                ids = []
                for entry_id, fields in entries:
                    ids.append(entry_id)
                    if not fields or b"record" not in fields:
                        continue
                    try:
                        row = OutcomeRecord.from_json(fields[b"record"]).training_row()
                    except RecordError as e:
                        self.unreadable += 1
                        if self.unreadable in (1, 10, 100) or self.unreadable % 1000 == 0:
                            log.warning("skipping unreadable outcome records (%d so far): %s", self.unreadable, e)
                        continue
                    if row is None or row.request_id in self._seen:
                        continue
                    self._seen[row.request_id] = None
                    if len(self._seen) > self.window:
                        self._seen.popitem(last=False)
                    self.rows.append(row)
                    kept += 1
                if ids:
                    self.client.xack(STREAM, GROUP, *ids)
        self.new_since_fit += kept
        return kept

    def maybe_retrain(self, force: bool = False) -> PolicyModel | None:
        if len(self.rows) < self.min_rows or (self.new_since_fit < self.every and not force):
            return None
        self.new_since_fit = 0
        return self.retrain()

    def retrain(self) -> PolicyModel | None:
        """Judge a candidate on the window (policy.train.judge) and promote it only
        if it is shown better than the live model; every judgement is recorded."""
        if self.before_retrain is not None:
            self.before_retrain()
        rows = list(self.rows)
        t0 = time.perf_counter()
        live = self.live_model()
        # reserved before judging, so that judgements running at once never share a level
        attempt = int(self.client.hincrby(ATTEMPTS, live.version, 1))
        candidate, decision = judge(rows, live, self.arms.by_preference(), kind_of=self.arms.kind_of,
                                    attempt=attempt)
        if not decision["tested"]:  # it risked nothing: its share of α goes back
            self.client.eval(_RELEASE, 1, ATTEMPTS, live.version, attempt)
        decision.update(train_s=round(time.perf_counter() - t0, 3), time=time.time())
        self.decisions.append(decision)
        try:
            self.client.lpush(DECISIONS, json.dumps(decision))
            self.client.ltrim(DECISIONS, 0, 999)
        except redis.RedisError:
            pass  # the log line below still says it
        if not decision["promoted"]:
            log.info("candidate %s not promoted over %s: %s (difference %s, lower bound %s, %d rows judged, "
                     "same choice on %s of them)", candidate.version, live.version, decision["reason"],
                     decision["difference"], decision["lower_bound"], decision["evaluated_rows"],
                     decision["agreement"])
            return None
        publish(self.client, candidate, self.key, meta=dict(rows=len(rows), judgement=decision))
        self.promoted.append(candidate.version)
        log.info("promoted %s over %s: value %s vs %s on %d newer rows (difference %s, lower bound %s)",
                 candidate.version, live.version, decision["candidate_value"], decision["live_value"],
                 decision["evaluated_rows"], decision["difference"], decision["lower_bound"])
        return candidate

    def run(self, once: bool = False, interval_s: float | None = None, stop: threading.Event | None = None) -> None:
        """Serve until `stop` is set (or one pass with once=True). interval_s: also
        retrain on a schedule when new rows arrived, even fewer than `every`.
        While Redis is away it waits and retries, logging the outage once."""
        stop = stop or threading.Event()
        last = time.monotonic()
        outage = Outage("retrainer", log)
        while not stop.is_set():
            try:
                self.consume(block_ms=200 if once else 500)
                due = interval_s is not None and time.monotonic() - last >= interval_s and self.new_since_fit > 0
                if once:
                    self.maybe_retrain(force=True)
                    return
                if self.maybe_retrain(force=due):
                    last = time.monotonic()
                outage.over()
            except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError, OSError) as e:
                if once:
                    raise
                outage.begin(e)
                stop.wait(outage.backoff())
