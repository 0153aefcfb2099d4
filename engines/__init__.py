"""Engines: the decoding backends the gateway routes requests to."""

from engines.api import (
    Arm, ArmInfo, Cancelled, ChatMessage, Engine, EngineError, GenerationRequest, GenerationResult,
    GenerationStats, InvalidRequest, LoadSnapshot, Overloaded, SamplingParams, TokenDelta,
    TokenizerMismatch,
)

__all__ = [
    "Arm", "ArmInfo", "Cancelled", "ChatMessage", "Engine", "EngineError", "GenerationRequest",
    "GenerationResult", "GenerationStats", "InvalidRequest", "LoadSnapshot", "Overloaded",
    "SamplingParams", "TokenDelta", "TokenizerMismatch",
]
