"""Fallback models: a list of providers tried in order, for one generation at a time.

A provider that fails before it has produced anything (an error, or no first chunk within ``ttft_timeout_s``) hands
the request to the next one; once a provider has produced something, its failure is the generation's (what was
said cannot be taken back). Each hand-over is logged at WARNING; the last provider's failure ends the generation.

Config: ``{"provider": "fallback", "models": [<provider config>, ...], "ttft_timeout_s"?}`` (model profiles build it
from a profile's ``fallbacks``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from .base import LLM, LLMChunk, LLMError, LLMRequest

logger = logging.getLogger("switchboard.runtime.llm.fallback")


class FallbackLLM:
    def __init__(self, models: list[LLM], *, names: list[str] | None = None, ttft_timeout_s: float | None = None):
        if not models:
            raise ValueError("a fallback model needs at least one model")
        self.models = models
        self.names = names or [f"model {i + 1}" for i in range(len(models))]
        self.ttft_timeout_s = ttft_timeout_s

    @classmethod
    def from_config(cls, config: dict[str, Any], build: Callable[[dict[str, Any]], LLM]) -> FallbackLLM:
        unknown = sorted(set(config) - {"models", "ttft_timeout_s"})
        if unknown:
            raise ValueError(f"invalid fallback llm config: unknown key(s) {', '.join(unknown)}")
        configs = config.get("models")
        if not isinstance(configs, list) or not configs or not all(isinstance(c, dict) for c in configs):
            raise ValueError("invalid fallback llm config: models must be a non-empty list of model configs")
        timeout = config.get("ttft_timeout_s")
        if timeout is not None and (not isinstance(timeout, int | float) or not 0 < timeout <= 600):
            raise ValueError("invalid fallback llm config: ttft_timeout_s must be a number of seconds in (0, 600]")
        names = [str(c.get("model") or c.get("provider") or "scripted") for c in configs]
        return cls([build(dict(c)) for c in configs], names=names, ttft_timeout_s=timeout)

    def save_state(self) -> dict[str, Any] | None:
        return {"models": [m.save_state() for m in self.models]}

    def load_state(self, state: dict[str, Any] | None) -> None:
        states = (state or {}).get("models")
        if isinstance(states, list):
            for model, saved in zip(self.models, states, strict=False):
                model.load_state(saved if isinstance(saved, dict) else None)

    async def aclose(self) -> None:
        for model in self.models:
            await model.aclose()

    def stream(self, request: LLMRequest) -> AsyncIterator[LLMChunk]:
        return self._stream(request)

    async def _stream(self, request: LLMRequest) -> AsyncIterator[LLMChunk]:
        last = len(self.models) - 1
        for index, model in enumerate(self.models):
            stream = model.stream(request)
            try:
                try:
                    first = await self._first(stream)
                except (LLMError, TimeoutError) as err:
                    if index == last:
                        raise LLMError(f"{self.names[index]}: {_what(err)}") from err
                    logger.warning(
                        "speech %s: %s failed (%s); trying %s",
                        request.speech_id,
                        self.names[index],
                        _what(err),
                        self.names[index + 1],
                    )
                    continue
                if first is not None:
                    yield first
                async for chunk in stream:
                    yield chunk
                return
            finally:
                await _close(stream)

    async def _first(self, stream: AsyncIterator[LLMChunk]) -> LLMChunk | None:
        """The stream's first chunk (None: it ended without any), within ``ttft_timeout_s``."""
        try:
            async with asyncio.timeout(self.ttft_timeout_s):
                return await anext(stream)
        except StopAsyncIteration:
            return None


def _what(err: BaseException) -> str:
    if isinstance(err, TimeoutError):
        return "no answer in time"
    return str(err) or type(err).__name__


async def _close(stream: AsyncIterator[LLMChunk]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:  # a provider's cleanup error must not hide the outcome
            logger.debug("closing a model stream failed", exc_info=True)
