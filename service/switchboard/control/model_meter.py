"""Model metrics: each session's model wrapped so that every generation reports its time to first token, its
tokens and its failure, labelled by model name (never a URL or a key). The session keeps its latest turn's timing
for its header in the console."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from ..runtime.llm import LLM, STAND_IN_PROVIDER, LLMRequest, Usage
from ..runtime.llm.base import LLMChunk, WrappedLLM


class ModelObserver(Protocol):
    def model_first_token(self, model: str, seconds: float) -> None: ...

    def model_tokens(self, model: str, prompt: int, completion: int) -> None: ...

    def model_failed(self, model: str) -> None: ...


class MeteredLLM(WrappedLLM):
    """An ``LLM`` that reports each generation to an observer; everything else is the wrapped model's."""

    def __init__(self, llm: LLM, label: str, observer: ModelObserver) -> None:
        super().__init__(llm)
        self.label = label
        self.observer = observer
        self.last_ttft_s: float | None = None  # the latest generation's time to its first chunk

    def stream(self, request: LLMRequest) -> AsyncIterator[LLMChunk]:
        return self._stream(self.llm.stream(request))

    async def _stream(self, stream: AsyncIterator[LLMChunk]) -> AsyncIterator[LLMChunk]:
        started = time.perf_counter()
        first = True
        try:
            async for chunk in stream:
                if first:
                    first = False
                    self.last_ttft_s = time.perf_counter() - started
                    self.observer.model_first_token(self.label, self.last_ttft_s)
                if isinstance(chunk, Usage):
                    self.observer.model_tokens(self.label, chunk.prompt_tokens, chunk.completion_tokens)
                yield chunk
        except Exception:
            self.observer.model_failed(self.label)
            raise
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()


def model_label(config: dict[str, Any] | None) -> str:
    """``provider/model`` of a provider configuration (the first model of a fallback list); none: the stand-in."""
    if config is None:
        return STAND_IN_PROVIDER
    if config.get("provider") == "fallback" and config.get("models"):
        config = config["models"][0]
    provider = str(config.get("provider", "scripted"))
    model = config.get("model")
    return f"{provider}/{model}" if isinstance(model, str) else provider
