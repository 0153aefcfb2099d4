from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "category", "expected_output_tokens", "arm")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ARM_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    category: str
    expected_output_tokens: int
    arm: str
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., category: _Optional[str] = ..., expected_output_tokens: _Optional[int] = ..., arm: _Optional[str] = ...) -> None: ...

class Decision(_message.Message):
    __slots__ = ("arm", "speculative", "draft", "gamma", "source", "rule", "policy_version", "rules_version", "predicted_speedup", "predicted_speedups", "propensity", "explored", "reason", "min_confidence")
    class PredictedSpeedupsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ARM_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    RULES_VERSION_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_SPEEDUP_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_SPEEDUPS_FIELD_NUMBER: _ClassVar[int]
    PROPENSITY_FIELD_NUMBER: _ClassVar[int]
    EXPLORED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MIN_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    arm: str
    speculative: bool
    draft: str
    gamma: int
    source: str
    rule: str
    policy_version: str
    rules_version: str
    predicted_speedup: float
    predicted_speedups: _containers.ScalarMap[str, float]
    propensity: float
    explored: bool
    reason: str
    min_confidence: float
    def __init__(self, arm: _Optional[str] = ..., speculative: _Optional[bool] = ..., draft: _Optional[str] = ..., gamma: _Optional[int] = ..., source: _Optional[str] = ..., rule: _Optional[str] = ..., policy_version: _Optional[str] = ..., rules_version: _Optional[str] = ..., predicted_speedup: _Optional[float] = ..., predicted_speedups: _Optional[_Mapping[str, float]] = ..., propensity: _Optional[float] = ..., explored: _Optional[bool] = ..., reason: _Optional[str] = ..., min_confidence: _Optional[float] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "output_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    output_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ...) -> None: ...

class SpecStats(_message.Message):
    __slots__ = ("drafted", "accepted", "acceptance_rate", "mean_accepted_length", "rounds", "acceptance_source", "draft_error")
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ERROR_FIELD_NUMBER: _ClassVar[int]
    drafted: int
    accepted: int
    acceptance_rate: float
    mean_accepted_length: float
    rounds: int
    acceptance_source: str
    draft_error: str
    def __init__(self, drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_accepted_length: _Optional[float] = ..., rounds: _Optional[int] = ..., acceptance_source: _Optional[str] = ..., draft_error: _Optional[str] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_s", "ttft_s", "total_s")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    ttft_s: float
    total_s: float
    def __init__(self, queue_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., total_s: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "finish_reason", "usage", "decision", "spec", "timings", "engine", "seed")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    finish_reason: str
    usage: Usage
    decision: Decision
    spec: SpecStats
    timings: Timings
    engine: str
    seed: int
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., decision: _Optional[_Union[Decision, _Mapping]] = ..., spec: _Optional[_Union[SpecStats, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., engine: _Optional[str] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("request_id", "text", "final")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    final: GenerateResponse
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., final: _Optional[_Union[GenerateResponse, _Mapping]] = ...) -> None: ...

class Features(_message.Message):
    __slots__ = ("category", "temperature", "top_p", "prompt_tokens", "expected_output_tokens", "copy_signal", "running", "waiting", "tenant")
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COPY_SIGNAL_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    category: str
    temperature: float
    top_p: float
    prompt_tokens: int
    expected_output_tokens: int
    copy_signal: float
    running: int
    waiting: int
    tenant: str
    def __init__(self, category: _Optional[str] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., expected_output_tokens: _Optional[int] = ..., copy_signal: _Optional[float] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class DecideResponse(_message.Message):
    __slots__ = ("request_id", "decision", "features")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    decision: Decision
    features: Features
    def __init__(self, request_id: _Optional[str] = ..., decision: _Optional[_Union[Decision, _Mapping]] = ..., features: _Optional[_Union[Features, _Mapping]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Load(_message.Message):
    __slots__ = ("running", "waiting", "tokens_per_step", "kv_used_tokens", "kv_limit_tokens", "recent_step_s", "lone_step_s", "drafting_s")
    class DraftingSEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    KV_USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_LIMIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECENT_STEP_S_FIELD_NUMBER: _ClassVar[int]
    LONE_STEP_S_FIELD_NUMBER: _ClassVar[int]
    DRAFTING_S_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    tokens_per_step: float
    kv_used_tokens: int
    kv_limit_tokens: int
    recent_step_s: float
    lone_step_s: _containers.RepeatedScalarFieldContainer[float]
    drafting_s: _containers.ScalarMap[str, float]
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., tokens_per_step: _Optional[float] = ..., kv_used_tokens: _Optional[int] = ..., kv_limit_tokens: _Optional[int] = ..., recent_step_s: _Optional[float] = ..., lone_step_s: _Optional[_Iterable[float]] = ..., drafting_s: _Optional[_Mapping[str, float]] = ...) -> None: ...

class EngineStatus(_message.Message):
    __slots__ = ("id", "address", "healthy", "drafts", "gamma_min", "gamma_max", "load", "max_context", "arms", "adaptive_gamma", "draft_kinds")
    ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    GAMMA_MIN_FIELD_NUMBER: _ClassVar[int]
    GAMMA_MAX_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    ARMS_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_GAMMA_FIELD_NUMBER: _ClassVar[int]
    DRAFT_KINDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    address: str
    healthy: bool
    drafts: _containers.RepeatedScalarFieldContainer[str]
    gamma_min: int
    gamma_max: int
    load: Load
    max_context: int
    arms: _containers.RepeatedScalarFieldContainer[str]
    adaptive_gamma: bool
    draft_kinds: _containers.RepeatedCompositeFieldContainer[DraftKind]
    def __init__(self, id: _Optional[str] = ..., address: _Optional[str] = ..., healthy: _Optional[bool] = ..., drafts: _Optional[_Iterable[str]] = ..., gamma_min: _Optional[int] = ..., gamma_max: _Optional[int] = ..., load: _Optional[_Union[Load, _Mapping]] = ..., max_context: _Optional[int] = ..., arms: _Optional[_Iterable[str]] = ..., adaptive_gamma: _Optional[bool] = ..., draft_kinds: _Optional[_Iterable[_Union[DraftKind, _Mapping]]] = ...) -> None: ...

class DraftKind(_message.Message):
    __slots__ = ("draft", "kind", "model")
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    draft: str
    kind: str
    model: str
    def __init__(self, draft: _Optional[str] = ..., kind: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("engines", "policy_version", "rules_version")
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    RULES_VERSION_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedCompositeFieldContainer[EngineStatus]
    policy_version: str
    rules_version: str
    def __init__(self, engines: _Optional[_Iterable[_Union[EngineStatus, _Mapping]]] = ..., policy_version: _Optional[str] = ..., rules_version: _Optional[str] = ...) -> None: ...

class EngineGenerateRequest(_message.Message):
    __slots__ = ("request_id", "request", "arm", "min_confidence")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    ARM_FIELD_NUMBER: _ClassVar[int]
    MIN_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    request: GenerateRequest
    arm: str
    min_confidence: float
    def __init__(self, request_id: _Optional[str] = ..., request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., arm: _Optional[str] = ..., min_confidence: _Optional[float] = ...) -> None: ...

class EngineEvent(_message.Message):
    __slots__ = ("text", "result")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    text: str
    result: EngineResult
    def __init__(self, text: _Optional[str] = ..., result: _Optional[_Union[EngineResult, _Mapping]] = ...) -> None: ...

class EngineResult(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "prompt_tokens", "output_tokens", "drafted_per_round", "accepted_per_round", "rounds", "queue_s", "prefill_s", "draft_s", "verify_s", "ttft_s", "total_s", "seed", "arm", "acceptance_source", "verified_per_round", "speculation_s", "draft_error")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    ARM_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ERROR_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    prompt_tokens: int
    output_tokens: int
    drafted_per_round: _containers.RepeatedScalarFieldContainer[int]
    accepted_per_round: _containers.RepeatedScalarFieldContainer[int]
    rounds: int
    queue_s: float
    prefill_s: float
    draft_s: float
    verify_s: float
    ttft_s: float
    total_s: float
    seed: int
    arm: str
    acceptance_source: str
    verified_per_round: _containers.RepeatedScalarFieldContainer[int]
    speculation_s: float
    draft_error: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., drafted_per_round: _Optional[_Iterable[int]] = ..., accepted_per_round: _Optional[_Iterable[int]] = ..., rounds: _Optional[int] = ..., queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., draft_s: _Optional[float] = ..., verify_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., total_s: _Optional[float] = ..., seed: _Optional[int] = ..., arm: _Optional[str] = ..., acceptance_source: _Optional[str] = ..., verified_per_round: _Optional[_Iterable[int]] = ..., speculation_s: _Optional[float] = ..., draft_error: _Optional[str] = ...) -> None: ...

class CountTokensRequest(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class CountTokensResponse(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    def __init__(self, tokens: _Optional[int] = ...) -> None: ...
