"""Language models: the protocol the session speaks and the providers that implement it."""

from .base import LLM, LLMError, LLMRequest, MissingCredential, TextDelta, ToolCallChunk, Usage
from .factory import build_llm, prepare_llm
from .scripted import ScriptedLLM, Turn
from .stand_in import STAND_IN_PROVIDER, StandInLLM

__all__ = [
    "LLM",
    "STAND_IN_PROVIDER",
    "LLMError",
    "LLMRequest",
    "MissingCredential",
    "ScriptedLLM",
    "StandInLLM",
    "TextDelta",
    "ToolCallChunk",
    "Turn",
    "Usage",
    "build_llm",
    "prepare_llm",
]
