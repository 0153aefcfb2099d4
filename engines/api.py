"""The engine interface the gateway talks to, and the domain types it speaks.

An engine serves *arms* (engines/arms.py): plain decoding, or speculative
decoding with a named draft and a bound on γ. The gateway, through its policy,
picks the arm; the engine executes it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from engines.arms import PLAIN, Arm, ArmMenu


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature == 0 means greedy (top_p/top_k ignored)."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None  # None: a fresh seed, reported in the stats. Reproduces text under fixed γ;
    # adaptive drafting sizes rounds from measured timings, so a seed then fixes the distribution only
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # benchmarks only: decode exactly max_tokens


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class GenerationRequest:
    """One request: either raw `prompt` text or chat `messages` (templated by the engine)."""

    request_id: str
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] = ()
    arm: Arm = field(default_factory=Arm)
    min_confidence: float = 0.0  # a model draft stops drafting once its running confidence falls below this
    fixed_gamma: bool = False  # verify every drafted token, never adapt (benchmarks of fixed γ against adaptive)
    prompt_token_ids: tuple[int, ...] | None = None  # bypasses tokenization (benchmarks, tests)


@dataclass
class GenerationStats:
    """What happened while serving one request. Times are seconds."""

    arm: str = PLAIN
    seed: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str = ""  # "stop" (EOS or stop string), "length", "cancelled"
    rounds: int = 0  # speculative rounds (plain decoding: one per token)
    drafted_per_round: list[int] = field(default_factory=list)
    verified_per_round: list[int] = field(default_factory=list)  # drafts verified (the engine may verify fewer)
    accepted_per_round: list[int] = field(default_factory=list)
    queue_s: float = 0.0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0  # target forwards after prefill (plain decode steps count here)
    acceptance_source: str = "measured"  # measured (per round, by this engine), reported (totals from the
    # serving engine's response), estimated (from its metrics counters), unknown (drafted/accepted left empty)
    ttft_s: float = 0.0  # from start of service (after queue) to first token
    total_s: float = 0.0  # from start of service to the last token
    # seconds its drafting and verification added to the steps it ran in: drafting and judging
    # timed, verification's extra forward time priced by the engine's step-cost model. Less than
    # the decode time by what the same rounds would have cost undrafted: the learner's yardstick
    # where plain requests are few. None: the serving engine does not say.
    speculation_s: float | None = None
    # set when drafting raised mid-request (which draft, the exception's type): the rest of the request
    # was decoded without drafts, so its output is still the target's, at plain speed
    draft_error: str = ""

    @property
    def drafted(self) -> int:
        return sum(self.drafted_per_round)

    @property
    def accepted(self) -> int:
        return sum(self.accepted_per_round)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target forward: accepted drafts plus the one the target adds."""
        if not self.rounds:
            return 0.0
        return (self.accepted + self.rounds) / self.rounds

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.total_s if self.total_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(
            drafted=self.drafted,
            accepted=self.accepted,
            acceptance_rate=self.acceptance_rate,
            mean_accepted_length=self.mean_accepted_length,
            tokens_per_s=self.tokens_per_s,
        )
        return d


@dataclass(frozen=True)
class TokenDelta:
    """A streamed piece of output: new text and the token ids that produced it."""

    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    text: str
    token_ids: tuple[int, ...]
    stats: GenerationStats


@dataclass(frozen=True)
class LoadSnapshot:
    """The engine's live load, and what it prices work at, as the gateway reads
    them. Cheap, lock-free copy."""

    running: int = 0
    waiting: int = 0
    tokens_per_step: float = 0.0  # tokens fed to the target in the latest step
    kv_used_tokens: int = 0
    kv_limit_tokens: int = 0
    recent_step_s: float = 0.0  # moving average of target step time
    # this machine's prices (empty where the engine does not say): seconds of a lone row feeding 1, 2, ...
    # tokens (a decode step, then verifying 1, 2, ... drafts), from its start-up profile and every step since
    lone_step_s: tuple[float, ...] = ()
    drafting_s: tuple[tuple[str, float], ...] = ()  # (draft, measured seconds per drafted token) per model draft


class GenerationHandle(Protocol):
    """A running generation, as the gateway consumes it (asynchronously):
    `async for delta in handle`, then `await handle.result()`."""

    request_id: str

    def __aiter__(self) -> AsyncIterator[TokenDelta]: ...

    async def result(self, timeout: float | None = None) -> GenerationResult:
        """The end of the generation (consuming what was not iterated); raises
        TimeoutError after `timeout` seconds and cancels the generation."""
        ...

    def cancel(self) -> None: ...


class Engine(Protocol):
    """What the gateway needs of an engine."""

    def arms(self) -> ArmMenu: ...

    def load(self) -> LoadSnapshot: ...

    def submit(self, request: GenerationRequest) -> GenerationHandle:
        """Validate and enqueue; raises InvalidRequest or Overloaded at once."""
        ...

    def count_tokens(self, text: str) -> int: ...

    def close(self) -> None: ...
