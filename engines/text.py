"""Prompt encoding and incremental detokenization with stop strings."""

from __future__ import annotations

from engines.api import ChatMessage, GenerationRequest
from engines.errors import InvalidRequest

MAX_PROMPT_CHARS = 1_000_000
CHAT_ROLES = {"system", "user", "assistant", "tool"}


def encode_prompt(tokenizer, request: GenerationRequest) -> list[int]:
    """Token ids of the request's prompt: raw text as is, chat messages through
    the model's chat template with the assistant turn opened."""
    if request.prompt_token_ids is not None:
        if not request.prompt_token_ids:
            raise InvalidRequest("prompt_token_ids", "must not be empty")
        vocab = len(tokenizer)
        if any(not 0 <= t < vocab for t in request.prompt_token_ids):
            raise InvalidRequest("prompt_token_ids", f"ids must be in [0, {vocab})")
        return list(request.prompt_token_ids)
    if request.prompt is not None and request.messages:
        raise InvalidRequest("prompt", "give either prompt or messages, not both")
    if request.messages:
        return tokenizer(render_chat(tokenizer, request.messages), add_special_tokens=False)["input_ids"]
    if not request.prompt:
        raise InvalidRequest("prompt", "must not be empty (give prompt text or messages)")
    if len(request.prompt) > MAX_PROMPT_CHARS:
        raise InvalidRequest("prompt", f"longer than {MAX_PROMPT_CHARS} characters")
    return tokenizer(request.prompt)["input_ids"]


def render_chat(tokenizer, messages: tuple[ChatMessage, ...]) -> str:
    total = 0
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise InvalidRequest(f"messages[{i}].role", f"must be one of {sorted(CHAT_ROLES)}, got {m.role!r}")
        total += len(m.content)
    if total > MAX_PROMPT_CHARS:
        raise InvalidRequest("messages", f"longer than {MAX_PROMPT_CHARS} characters in all")
    if not any(m.content for m in messages):
        raise InvalidRequest("messages", "every message is empty")
    if getattr(tokenizer, "chat_template", None) is None:
        # A base model without a template: plain concatenation keeps it usable.
        return "".join(f"{m.role}: {m.content}\n" for m in messages) + "assistant: "
    return tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages],
        add_generation_prompt=True, tokenize=False,
    )


class IncrementalText:
    """Turns output token ids into text deltas, stopping at the first stop string.

    Text that could still be the beginning of a stop string, or an incomplete
    UTF-8 character, is held back until the next tokens settle it.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0  # characters of text already emitted
        self.text = ""
        self.stopped = False

    def push(self, new_ids: list[int], final: bool = False) -> str:
        """Add tokens; return the newly settled text ('' when none)."""
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if self.stop:
            search_from = max(0, self.sent - self.hold)
            hits = [i for i in (text.find(s, search_from) for s in self.stop) if i >= 0]
            if hits:
                text = text[: min(hits)]
                self.stopped = final = True
        self.text = text
        end = len(text)
        if not final:
            end -= self.hold
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.sent:
            return ""
        delta = text[self.sent:end]
        self.sent = end
        return delta

    def finish(self) -> str:
        """Everything still held back."""
        return self.push([], final=True)
