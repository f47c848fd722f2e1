"""The LLM protocol: a request built from the chat context, answered by a stream of chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from ..chat import ChatItem


class LLMError(Exception):
    """A provider failure that ends the generation (the session keeps working)."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


class LLMRequest(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)

    instructions: str
    items: list[ChatItem]
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Literal["auto", "none"] = "auto"
    speech_id: str | None = None
    step: int = 0
    preemptive: bool = False


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ToolCallChunk:
    """A complete tool call from the stream. ``arguments`` is the raw JSON text the model produced."""

    name: str
    arguments: str
    call_id: str | None = None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0


LLMChunk = TextDelta | ToolCallChunk | Usage


class LLM(Protocol):
    def stream(self, request: LLMRequest) -> AsyncIterator[LLMChunk]:
        """Answer ``request``. Cancelling the iteration stops the generation."""
        ...

    def save_state(self) -> dict[str, Any] | None:
        """State worth persisting across restarts (the scripted model's position); None for stateless models."""
        ...

    def load_state(self, state: dict[str, Any] | None) -> None: ...

    async def aclose(self) -> None:
        """Release what the provider holds (an HTTP client); called when its session closes or is suspended."""
        ...
