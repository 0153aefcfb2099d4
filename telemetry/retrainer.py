"""The retrainer: outcomes in, better policies out.

Reads the outcome stream through a consumer group (at-least-once; duplicates
dropped by request id), keeps a window of recent outcomes, and every N new ones
fits a candidate, scores it and the live model offline on the window with the
logged propensities, and promotes it only if it is not worse.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from engines.api import ArmInfo
from policy.model import PolicyModel, prior_model
from policy.train import fit, offline_value
from telemetry.artifacts import CURRENT, ArtifactError, load_verified, publish
from telemetry.outcomes import STREAM

log = logging.getLogger(__name__)

GROUP = "specgate-retrainer"


def training_row(record: dict) -> dict | None:
    """A stream record as policy.train expects it; None for records it cannot use."""
    try:
        res, dec = record["result"], record["decision"]
        return dict(features=record["features"], arm=dec["arm"], propensity=float(dec.get("propensity") or 0),
                    output_tokens=int(res["output_tokens"]), rounds=int(res["rounds"]),
                    decode_s=float(res["decode_s"]), request_id=record["request_id"])
    except (KeyError, TypeError, ValueError):
        return None


@dataclass
class Retrainer:
    client: object
    key: bytes
    consumer: str = "retrainer-1"
    window: int = 50_000
    every: int = 500
    min_rows: int = 200
    arms: ArmInfo = field(default_factory=lambda: ArmInfo(("ngram", "selfspec"), 1, 8))

    def __post_init__(self):
        self.rows: deque[dict] = deque(maxlen=self.window)
        self._seen: OrderedDict[str, None] = OrderedDict()  # request ids in the window (idempotence)
        self.new_since_fit = 0
        self.promoted: list[str] = []
        try:
            self.client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
        except Exception as e:  # noqa: BLE001 - BUSYGROUP: it exists already
            if "BUSYGROUP" not in str(e):
                raise

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
        kept = 0
        for start in ("0", ">"):  # our unacknowledged ones first (after a crash), then new ones
            resp = self.client.xreadgroup(GROUP, self.consumer, {STREAM: start}, count=count,
                                          block=None if start == "0" else block_ms)
            for _, entries in resp or []:
                ids = []
                for entry_id, fields in entries:
                    ids.append(entry_id)
                    if not fields:
                        continue
                    try:
                        record = json.loads(fields[b"record"])
                    except (KeyError, ValueError):
                        continue
                    row = training_row(record)
                    if row is None or row["request_id"] in self._seen:
                        continue
                    self._seen[row["request_id"]] = None
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
        rows = list(self.rows)
        t0 = time.perf_counter()
        candidate = fit(rows)
        live = self.live_model()
        arms = self.arms.all_arms()
        cand_score = offline_value(candidate, rows, arms)
        live_score = offline_value(live, rows, arms)
        candidate.metrics.update(offline_value=cand_score, live_offline_value=live_score,
                                 live_version=live.version, train_s=round(time.perf_counter() - t0, 3))
        if cand_score is None or (live_score is not None and cand_score < live_score):
            log.info("candidate %s not promoted: offline value %s < live %s (%s)", candidate.version,
                     cand_score, live_score, live.version)
            return None
        publish(self.client, candidate, self.key, meta=dict(rows=len(rows), offline_value=cand_score,
                                                           live_offline_value=live_score))
        self.promoted.append(candidate.version)
        log.info("promoted %s: %d rows, offline value %.3f (live %s: %s)", candidate.version, len(rows),
                 cand_score, live.version, f"{live_score:.3f}" if live_score is not None else "n/a")
        return candidate

    def run(self, once: bool = False, interval_s: float | None = None) -> None:
        """Serve forever (or one pass with once=True). interval_s: also retrain on a
        schedule when new rows arrived, even fewer than `every`."""
        last = time.monotonic()
        while True:
            self.consume(block_ms=200 if once else 1000)
            due = interval_s is not None and time.monotonic() - last >= interval_s and self.new_since_fit > 0
            if once:
                self.maybe_retrain(force=True)
                return
            if self.maybe_retrain(force=due):
                last = time.monotonic()
