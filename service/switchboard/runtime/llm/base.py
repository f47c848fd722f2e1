"""The LLM protocol: a request built from the chat context, answered by a stream of chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..chat import ChatItem


class LLMError(Exception):
    """A provider failure that ends the generation (the session keeps working)."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


class MissingCredential(ValueError):
    """The model needs a credential the service's environment does not hold (it names the variable, never a value)."""

    def __init__(self, variable: str, message: str) -> None:
        super().__init__(message)
        self.variable = variable


def config_error(what: str, err: ValidationError, model: type[BaseModel], *, extra_keys: str = "") -> ValueError:
    """A readable ``ValueError`` for an invalid provider configuration: each bad key and what is wrong with it (no
    pydantic dump, no links). ``extra_keys`` names keys allowed besides the model's fields."""
    problems: list[str] = []
    for e in err.errors():
        key = ".".join(str(part) for part in e["loc"]) or "llm"
        if e["type"] == "extra_forbidden" and len(e["loc"]) == 1:
            allowed = ", ".join(filter(None, [extra_keys, *model.model_fields]))
            problems.append(f"unknown key {key!r} (allowed: {allowed})")
        elif e["type"] == "extra_forbidden":
            problems.append(f"unknown key {key!r}")
        else:
            problems.append(f"{key}: {e['msg']}")
    return ValueError(f"invalid {what} llm config: " + "; ".join(problems))


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


class WrappedLLM:
    """An ``LLM`` around another that observes its generations (``stream``, each subclass's own); its state, its
    closing and what else tests and tools read of a provider (the script's requests...) are the wrapped model's."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm

    def __getattr__(self, name: str) -> Any:
        return getattr(self.llm, name)

    def stream(self, request: LLMRequest) -> AsyncIterator[LLMChunk]:
        return self.llm.stream(request)

    def save_state(self) -> dict[str, Any] | None:
        return self.llm.save_state()

    def load_state(self, state: dict[str, Any] | None) -> None:
        self.llm.load_state(state)

    async def aclose(self) -> None:
        await self.llm.aclose()
