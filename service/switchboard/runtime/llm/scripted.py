"""The scripted model: answers each request with the next turn of a script. The embedded default, and how tests
drive sessions. ``{{tool_output:NAME}}`` in a turn's text shows the output the request's context held for NAME."""

from __future__ import annotations

import asyncio
import json
import re
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..chat import FunctionCallOutput
from .base import LLMChunk, LLMError, LLMRequest, TextDelta, ToolCallChunk, Usage

KEEP_REQUESTS = 200
_TOOL_OUTPUT = re.compile(r"\{\{tool_output:([A-Za-z0-9_.\-]+)\}\}")
_WORDS = re.compile(r"\S+\s*")


class ScriptedToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)  # a string is sent raw (to test bad JSON)
    id: str | None = None


class Turn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str = ""
    tool_calls: list[ScriptedToolCall] = Field(default_factory=list)
    ttft_ms: float = Field(default=0, ge=0, le=600_000)
    word_ms: float = Field(default=0, ge=0, le=60_000)
    error: str | None = None  # raise a provider error after ttft (for fault tests)


class ScriptConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    turns: list[Turn] = Field(default_factory=list)
    fallback: Turn = Field(default_factory=lambda: Turn(text="OK."))


def render_text(text: str, request: LLMRequest) -> str:
    def latest(match: re.Match[str]) -> str:
        name = match.group(1)
        for item in reversed(request.items):
            if isinstance(item, FunctionCallOutput) and item.name == name:
                return item.output
        return "<none>"

    return _TOOL_OUTPUT.sub(latest, text)


class ScriptedLLM:
    def __init__(self, turns: list[Turn] | None = None, fallback: Turn | None = None) -> None:
        self.turns = list(turns or [])
        self.fallback = fallback or Turn(text="OK.")
        self.position = 0
        # the latest requests received, for tests and debugging (bounded: a session can live for a long time)
        self.requests: deque[LLMRequest] = deque(maxlen=KEEP_REQUESTS)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ScriptedLLM:
        parsed = ScriptConfig.model_validate(config)
        return cls(parsed.turns, parsed.fallback)

    def save_state(self) -> dict[str, Any] | None:
        return {"position": self.position}

    def load_state(self, state: dict[str, Any] | None) -> None:
        if state and isinstance(state.get("position"), int):
            self.position = max(0, min(state["position"], len(self.turns)))

    async def aclose(self) -> None:
        return None

    def _next_turn(self) -> Turn:
        if self.position < len(self.turns):
            turn = self.turns[self.position]
            self.position += 1
            return turn
        return self.fallback

    def stream(self, request: LLMRequest) -> AsyncIterator[LLMChunk]:
        # The turn is taken now, not at first iteration, so the position is saved with the request.
        self.requests.append(request)
        return self._play(self._next_turn(), request)

    async def _play(self, turn: Turn, request: LLMRequest) -> AsyncIterator[LLMChunk]:
        if turn.ttft_ms:
            await asyncio.sleep(turn.ttft_ms / 1000)
        if turn.error:
            raise LLMError(turn.error)
        words = _WORDS.findall(render_text(turn.text, request))
        for index, word in enumerate(words):
            if index and turn.word_ms:
                await asyncio.sleep(turn.word_ms / 1000)
            yield TextDelta(word)
        if request.tool_choice != "none":
            for call in turn.tool_calls:
                args = call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments)
                yield ToolCallChunk(name=call.name, arguments=args, call_id=call.id)
        yield Usage(prompt_tokens=len(request.items), completion_tokens=len(words))
