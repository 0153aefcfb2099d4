"""The engine interface the gateway talks to, and the domain types it speaks.

An engine serves *arms*: plain decoding, or speculative decoding with a named
draft and a speculation length γ (the number of tokens drafted per round).
The gateway (through its policy) picks the arm; the engine only executes it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterator, Protocol, Sequence


class EngineError(Exception):
    """Base class of every error an engine raises on purpose."""


class InvalidRequest(EngineError):
    """A request field is out of range or malformed; `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class Overloaded(EngineError):
    """The engine's queue is full; the caller should back off and retry."""


class Cancelled(EngineError):
    """The request was cancelled before it finished."""


class EngineUnavailable(EngineError):
    """The endpoint could not be reached, failed, or died mid-request."""

    def __init__(self, message: str, streamed: bool = False, retryable: bool | None = None):
        super().__init__(message)
        self.streamed = streamed  # whether output had reached the client
        # another endpoint may take the request only when this one never started it
        # (connection refused or reset before an answer); never after output
        self.retryable = (not streamed) if retryable is None else (retryable and not streamed)


class TokenizerMismatch(EngineError):
    """A draft's tokenizer differs from the target's: its proposals would be meaningless."""


PLAIN = "plain"


@dataclass(frozen=True, order=True)
class Arm:
    """A decoding strategy: `draft=None` is plain decoding, else (draft, gamma)."""

    draft: str | None = None
    gamma: int = 0

    @property
    def is_plain(self) -> bool:
        return self.draft is None

    @property
    def name(self) -> str:
        return PLAIN if self.draft is None else f"{self.draft}:{self.gamma}"

    @staticmethod
    def parse(text: str) -> "Arm":
        """`plain` or `DRAFT:GAMMA`, e.g. `ngram:4`."""
        text = text.strip()
        if text == PLAIN:
            return Arm()
        draft, sep, gamma = text.rpartition(":")
        if not sep or not draft or not gamma.isdigit():
            raise InvalidRequest("arm", f"expected 'plain' or 'DRAFT:GAMMA', got {text!r}")
        return Arm(draft=draft, gamma=int(gamma))

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature == 0 means greedy (top_p/top_k ignored)."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None  # None: a fresh random seed, reported in the stats
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
    accepted_per_round: list[int] = field(default_factory=list)
    queue_s: float = 0.0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0  # target forwards after prefill (plain decode steps count here)
    acceptance_source: str = "measured"  # measured (per round, by this engine), reported (totals from the
    # serving engine's response), estimated (from its metrics counters), unknown (drafted/accepted left empty)
    ttft_s: float = 0.0  # from start of service (after queue) to first token
    total_s: float = 0.0  # from start of service to the last token

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
    """The engine's live load, as the policy reads it. Cheap, lock-free copy."""

    running: int = 0
    waiting: int = 0
    tokens_per_step: float = 0.0  # tokens fed to the target in the latest step
    kv_used_tokens: int = 0
    kv_limit_tokens: int = 0
    recent_step_s: float = 0.0  # moving average of target step time


@dataclass(frozen=True)
class ArmInfo:
    """Arms an engine serves: plain, plus each draft with its allowed γ range."""

    drafts: tuple[str, ...]
    gamma_min: int
    gamma_max: int
    only: frozenset[Arm] | None = None
    """An explicit menu (servers configured per arm, e.g. a vLLM with K=4): only
    these arms, plain included only if listed. None: plain plus every draft at
    every γ in the range."""

    def allows(self, arm: Arm) -> bool:
        if self.only is not None:
            return arm in self.only
        return arm.is_plain or (
            arm.draft in self.drafts and self.gamma_min <= arm.gamma <= self.gamma_max
        )

    def all_arms(self) -> list[Arm]:
        if self.only is not None:
            return sorted(self.only, key=lambda a: (not a.is_plain, a.draft or "", a.gamma))  # plain first
        return [Arm()] + [
            Arm(d, g) for d in self.drafts for g in range(self.gamma_min, self.gamma_max + 1)
        ]

    @staticmethod
    def of(arms) -> "ArmInfo":
        """The menu of exactly these arms."""
        arms = frozenset(arms)
        spec = [a for a in arms if not a.is_plain]
        return ArmInfo(tuple(sorted({a.draft for a in spec})), min((a.gamma for a in spec), default=1),
                       max((a.gamma for a in spec), default=1), arms)


class GenerationHandle(Protocol):
    """A running generation. Iterate it for `TokenDelta`s; `result()` blocks for the end."""

    request_id: str

    def __iter__(self) -> Iterator[TokenDelta]: ...

    def result(self, timeout: float | None = None) -> GenerationResult: ...

    def cancel(self) -> None: ...


class Engine(Protocol):
    """What the gateway needs of an engine, in-process or remote."""

    def arms(self) -> ArmInfo: ...

    def load(self) -> LoadSnapshot: ...

    def submit(self, request: GenerationRequest) -> GenerationHandle:
        """Validate and enqueue; raises InvalidRequest or Overloaded at once."""
        ...

    def count_tokens(self, text: str) -> int: ...

    def close(self) -> None: ...


def first_differing_token(a: Sequence[str], b: Sequence[str]) -> tuple[int, str | None, str | None] | None:
    """Index and tokens where two id->token tables first differ, or None when identical."""
    for i in range(max(len(a), len(b))):
        ta = a[i] if i < len(a) else None
        tb = b[i] if i < len(b) else None
        if ta != tb:
            return i, ta, tb
    return None
