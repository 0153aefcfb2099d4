"""The errors an engine raises on purpose; the gateway maps each to a status code."""

from __future__ import annotations


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
