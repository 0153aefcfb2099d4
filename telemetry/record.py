"""The outcome record: what one served request leaves in the outcome stream.

One typed, versioned schema. The gateway builds it (`OutcomeRecord.of`), the
sink writes `to_json()`, and every reader (the retrainer, `specgate report`,
the tests) parses it with `from_json()`, which refuses what it cannot read.

Schema 2 (schema 1, without `classified_category`, `verified_per_round` and
typed sections, is still read):

    request_id, tenant, time, engine
    features             policy.features.RequestFeatures at decision time
    decision             policy.decide.Decision (arm, source, propensity, versions, ...)
    result               ResultRecord: tokens, per-round drafted/verified/accepted, timings
    classified_category  the classifier's category when the request gave a hint
    prompt               the prompt text, only with telemetry.include_prompt
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field, fields

from engines.api import GenerationStats
from engines.errors import InvalidRequest
from policy.decide import Decision
from policy.features import RequestFeatures
from policy.train import TrainingRow

SCHEMA_VERSION = 2
READABLE = (1, 2)


class RecordError(ValueError):
    """A record this version cannot read."""


@dataclass
class ResultRecord:
    """What the engine reported, plus the gateway's timings. Seconds."""

    arm: str = "plain"
    output_tokens: int = 0
    prompt_tokens: int = 0
    rounds: int = 0
    drafted_per_round: list[int] = field(default_factory=list)
    verified_per_round: list[int] = field(default_factory=list)  # drafts sent to verification (<= drafted)
    accepted_per_round: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0  # after the first token
    total_s: float = 0.0
    queue_s: float = 0.0
    ttft_s: float = 0.0
    finish_reason: str = ""
    acceptance_source: str = "measured"
    speculation_s: float | None = None  # what drafting and verification added (engines.api.GenerationStats)
    draft_error: str = ""  # drafting failed mid-request; the rest decoded without drafts (GenerationStats)

    @property
    def drafted(self) -> int:
        return sum(self.drafted_per_round)

    @property
    def verified(self) -> int:
        return sum(self.verified_per_round) if self.verified_per_round else self.drafted

    @property
    def accepted(self) -> int:
        return sum(self.accepted_per_round)

    @staticmethod
    def of(stats: GenerationStats, ttft_s: float) -> ResultRecord:
        return ResultRecord(
            arm=stats.arm, output_tokens=stats.output_tokens, prompt_tokens=stats.prompt_tokens, rounds=stats.rounds,
            drafted_per_round=list(stats.drafted_per_round), verified_per_round=list(stats.verified_per_round),
            accepted_per_round=list(stats.accepted_per_round), prefill_s=stats.prefill_s,
            decode_s=max(stats.total_s - stats.prefill_s, 0.0), total_s=stats.total_s, queue_s=stats.queue_s,
            ttft_s=ttft_s, finish_reason=stats.finish_reason, acceptance_source=stats.acceptance_source,
            speculation_s=stats.speculation_s, draft_error=stats.draft_error)


_RESULT_FIELDS = {f.name for f in fields(ResultRecord)}


@dataclass
class OutcomeRecord:
    request_id: str
    tenant: str
    engine: str
    features: RequestFeatures
    decision: Decision
    result: ResultRecord
    time: float = field(default_factory=time.time)
    classified_category: str | None = None
    prompt: str | None = None

    @staticmethod
    def of(request_id: str, tenant: str, engine: str, features: RequestFeatures, decision: Decision,
           stats: GenerationStats, ttft_s: float, classified_category: str | None = None,
           prompt: str | None = None) -> OutcomeRecord:
        return OutcomeRecord(request_id, tenant, engine, features, decision, ResultRecord.of(stats, ttft_s),
                             classified_category=classified_category, prompt=prompt)

    @property
    def guard_category(self) -> str:
        """The category this outcome's acceptance counts for: the classifier's,
        not a hint it disagreed with (a hint cannot poison another category)."""
        return self.classified_category or self.features.category

    @property
    def policy_chosen(self) -> bool:
        """Chosen by the policy (or its exploration), not forced by the request or a rule."""
        return self.decision.source in ("policy", "exploration")

    # storage
    def to_dict(self) -> dict:
        d = {"schema": SCHEMA_VERSION, "request_id": self.request_id, "tenant": self.tenant, "engine": self.engine,
             "time": self.time, "features": self.features.to_dict(), "decision": self.decision.to_dict(),
             "result": dict(vars(self.result))}
        if self.classified_category is not None:
            d["classified_category"] = self.classified_category
        if self.prompt is not None:
            d["prompt"] = self.prompt
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @staticmethod
    def from_dict(d: dict) -> OutcomeRecord:
        if not isinstance(d, dict):
            raise RecordError(f"a record is a JSON object, got {type(d).__name__}")
        schema = d.get("schema")
        if schema not in READABLE:
            raise RecordError(f"unknown record schema {schema!r} (this version reads {READABLE})")
        try:
            feats = dict(d["features"])
            feats["rolling_acceptance"] = {}  # live guard state, not a learning input
            res = {k: v for k, v in d["result"].items() if k in _RESULT_FIELDS}
            return OutcomeRecord(
                request_id=str(d["request_id"]), tenant=str(d.get("tenant", "")), engine=str(d.get("engine", "")),
                features=RequestFeatures.from_dict(feats), decision=Decision.from_dict(d["decision"]),
                result=ResultRecord(**res), time=float(d.get("time", 0.0)),
                classified_category=d.get("classified_category"), prompt=d.get("prompt"))
        except (KeyError, TypeError, ValueError, InvalidRequest) as e:
            raise RecordError(f"record {d.get('request_id', '?')!r}: {type(e).__name__}: {e}") from None

    @staticmethod
    def from_json(text: str | bytes) -> OutcomeRecord:
        try:
            d = json.loads(text)
        except ValueError as e:
            raise RecordError(f"not JSON: {e}") from None
        return OutcomeRecord.from_dict(d)

    def training_row(self) -> TrainingRow | None:
        """The row learning uses; None when this outcome teaches nothing (no
        measured rounds, e.g. a server that reports no acceptance)."""
        r = self.result
        if r.rounds <= 0 or r.decode_s <= 0 or r.output_tokens <= 0:
            return None
        trials = accepted = verified = verifying = 0
        covered = False  # every round's verification known: the share of rounds that verified is learnt from it
        if r.acceptance_source == "measured":  # per round: tried up to and including the first rejection
            per_round = r.verified_per_round or r.drafted_per_round
            covered = len(per_round) == r.rounds
            for v, a in zip(per_round, r.accepted_per_round):
                if v > 0:
                    trials += a + (1 if a < v else 0)
                    accepted += a
                    verified += v
                    verifying += 1
        spec = r.speculation_s
        # the same rounds undrafted; a report that would make them nearly free is not believed
        plain_s = (min(max(r.decode_s - spec, 0.2 * r.decode_s), r.decode_s)
                   if isinstance(spec, (int, float)) and math.isfinite(spec) else None)
        return TrainingRow(features=self.features, arm=self.decision.arm, propensity=self.decision.propensity,
                           output_tokens=r.output_tokens, rounds=r.rounds, decode_s=r.decode_s, tenant=self.tenant,
                           request_id=self.request_id, trials=trials, accepted=accepted, verified=verified,
                           verifying_rounds=verifying if covered else None, plain_s=plain_s)
