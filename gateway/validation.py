"""Turning what a client sent (gRPC or HTTP) into a validated GatewayRequest.

Every check that needs no engine lives here and raises InvalidRequest naming
the field; the engine checks what depends on the model (the context window).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from engines.api import ChatMessage, SamplingParams
from engines.arms import Arm
from engines.errors import InvalidRequest
from engines.sampling import validate_sampling
from policy.classifier import CATEGORIES

MAX_MESSAGES = 256
MAX_STOP = 16
MAX_TOKENS_LIMIT = 1 << 20  # far above any context window; keeps every integer in its wire type
MAX_TOP_K = (1 << 31) - 1
DEFAULT_MAX_TOKENS = 128
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class Hints:
    category: str | None = None
    expected_output_tokens: int | None = None
    requested_arm: str | None = None


@dataclass(frozen=True)
class GatewayRequest:
    """A validated request: what the engine needs plus the policy's hints."""

    request_id: str
    tenant: str
    prompt: str | None
    messages: tuple[ChatMessage, ...]
    sampling: SamplingParams
    hints: Hints
    trace_carrier: tuple[tuple[str, str], ...] = ()

    @property
    def text(self) -> str:
        """The prompt's text, for the classifier and the copy signal."""
        return self.prompt if self.prompt is not None else "\n".join(m.content for m in self.messages)


def _check_text(text: str, name: str) -> None:
    if "\x00" in text:
        raise InvalidRequest(name, "must not contain NUL characters")
    if not text.isascii() and _SURROGATE.search(text):
        raise InvalidRequest(name, "is not valid Unicode (it contains a lone surrogate)")


def validate(request_id: str, tenant: str, prompt: str, messages: list[tuple[str, str]], *,
             max_tokens: int | None, temperature: float | None, top_p: float | None, top_k: int | None,
             seed: int | None, stop: list[str], category: str, expected_output_tokens: int | None, arm: str,
             max_prompt_chars: int, trace_carrier: tuple[tuple[str, str], ...] = ()) -> GatewayRequest:
    if prompt and messages:
        raise InvalidRequest("prompt", "give either prompt or messages, not both")
    if not prompt and not messages:
        raise InvalidRequest("prompt", "must not be empty (give prompt or messages)")
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequest("messages", f"at most {MAX_MESSAGES} messages")
    size = len(prompt) + sum(len(c) for _, c in messages)
    if size > max_prompt_chars:
        raise InvalidRequest("prompt" if prompt else "messages", f"longer than {max_prompt_chars} characters")
    _check_text(prompt, "prompt")
    for i, (role, content) in enumerate(messages):
        _check_text(content, f"messages[{i}].content")
        _check_text(role, f"messages[{i}].role")
    if max_tokens is not None and not 0 < max_tokens <= MAX_TOKENS_LIMIT:
        raise InvalidRequest("max_tokens", f"must be in [1, {MAX_TOKENS_LIMIT}], got {max_tokens}")
    for name, v in (("temperature", temperature), ("top_p", top_p)):
        if v is not None and not math.isfinite(v):
            raise InvalidRequest(name, f"must be a finite number, got {v}")
    if top_k is not None and not 0 <= top_k <= MAX_TOP_K:
        raise InvalidRequest("top_k", f"must be in [0, {MAX_TOP_K}] (0 disables it), got {top_k}")
    if len(stop) > MAX_STOP or any(not s or len(s) > 256 for s in stop):
        raise InvalidRequest("stop", f"at most {MAX_STOP} non-empty stop strings of at most 256 characters")
    for s in stop:
        _check_text(s, "stop")
    if category and category not in CATEGORIES:
        raise InvalidRequest("category", f"unknown category {category[:40]!r}; known: {list(CATEGORIES)}")
    if expected_output_tokens is not None and not 0 < expected_output_tokens <= MAX_TOKENS_LIMIT:
        raise InvalidRequest("expected_output_tokens", f"must be in [1, {MAX_TOKENS_LIMIT}], "
                                                       f"got {expected_output_tokens}")
    if arm:
        Arm.parse(arm)  # raises InvalidRequest("arm", ...)
    sampling = SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else DEFAULT_MAX_TOKENS,
        temperature=temperature if temperature is not None else 0.0,
        top_p=top_p if top_p is not None else 1.0,
        top_k=top_k if top_k is not None else 0,
        seed=seed, stop=tuple(stop),
    )
    validate_sampling(sampling, max_new_tokens_allowed=MAX_TOKENS_LIMIT)  # the context window is the engine's check
    return GatewayRequest(request_id, tenant, prompt or None, tuple(ChatMessage(r, c) for r, c in messages), sampling,
                          Hints(category or None, expected_output_tokens, arm or None), trace_carrier)
