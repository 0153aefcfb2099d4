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
        ids = tokenizer(render_chat(tokenizer, request.messages), add_special_tokens=False)["input_ids"]
    else:
        if not request.prompt:
            raise InvalidRequest("prompt", "must not be empty (give prompt text or messages)")
        if len(request.prompt) > MAX_PROMPT_CHARS:
            raise InvalidRequest("prompt", f"longer than {MAX_PROMPT_CHARS} characters")
        ids = tokenizer(request.prompt)["input_ids"]
    if not ids:  # e.g. only whitespace a tokenizer drops: decoding needs a last token to continue from
        raise InvalidRequest("messages" if request.messages else "prompt", "encodes to no tokens")
    return ids


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

    Each push decodes only the tokens since the last settled point and the few
    before it (their context: a tokenizer may render a token differently at the
    start of a text), not the whole output: decoding everything every token made
    a request's detokenization quadratic in its length.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0  # characters of text already emitted
        self.text = ""
        self.stopped = False
        self._settled = ""  # the text of ids[:_read], which later tokens no longer change
        self._prefix = self._read = 0  # ids[_prefix:_read]: the settled tokens the next window starts with
        self._prefix_text = ""  # what they decode to on their own

    def push(self, new_ids: list[int], final: bool = False) -> str:
        """Add tokens; return the newly settled text ('' when none)."""
        self.ids.extend(new_ids)
        text = self._decode()
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

    def _decode(self) -> str:
        """The text of every id so far: the settled text, then what the window
        beyond the settled tokens' own text decodes to."""
        window = self.tokenizer.decode(self.ids[self._prefix:], skip_special_tokens=True)
        if not window.startswith(self._prefix_text):  # a tokenizer that rewrites across tokens
            self._settled, self._prefix, self._read, self._prefix_text = "", 0, 0, ""
            window = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        text = self._settled + window[len(self._prefix_text):]
        if len(self.ids) > self._read and not text.endswith("\ufffd"):  # new tokens, whole characters: settle
            fresh = self.tokenizer.decode(self.ids[self._read:], skip_special_tokens=True)
            # the next window starts at these tokens, unless they render nothing (special tokens): a
            # window must open on text, or a tokenizer that joins tokens with spaces loses one
            if fresh:
                self._prefix, self._prefix_text = self._read, fresh
            else:
                self._prefix_text = window
            self._settled, self._read = text, len(self.ids)
        return text
