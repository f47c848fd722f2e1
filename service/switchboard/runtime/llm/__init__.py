"""Language models: the protocol the session speaks and the providers that implement it."""

from .base import LLM, LLMError, LLMRequest, MissingCredential, TextDelta, ToolCallChunk, Usage
from .factory import build_llm
from .scripted import ScriptedLLM, Turn

__all__ = [
    "LLM",
    "LLMError",
    "LLMRequest",
    "MissingCredential",
    "ScriptedLLM",
    "TextDelta",
    "ToolCallChunk",
    "Turn",
    "Usage",
    "build_llm",
]
