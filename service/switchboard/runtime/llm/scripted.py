"""The scripted model: answers each request with the next turn of a script. The embedded default, and how tests
drive sessions. ``{{tool_output:NAME}}`` in a turn's text shows the output the request's context held for NAME."""

from __future__ import annotations

import asyncio
import functools
import json
import re
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..chat import AgentHandoff, ChatMessage, FunctionCallOutput
from ..pending import coach_note_text
from .base import LLMChunk, LLMError, LLMRequest, TextDelta, ToolCallChunk, Usage, config_error

KEEP_REQUESTS = 200
_TOOL_OUTPUT = re.compile(r"\{\{tool_output:([A-Za-z0-9_.\-]+)\}\}")
_COACH = "{{coach}}"
_WORDS = re.compile(r"\S+\s*")


class ScriptedToolCall(BaseModel):
    """A tool call the scripted model makes, after its text."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="The tool to call.")
    arguments: dict[str, Any] | str = Field(
        default_factory=dict, description="Its arguments; a string is sent as is (to test arguments that are not JSON)."
    )
    id: str | None = Field(
        default=None,
        description="Ignored by the service, which names every call itself (kept only by test harnesses that trust "
        "their scripts' ids).",
    )


class Turn(BaseModel):
    """One answer of the scripted model: wait ``ttft_ms``, stream ``text`` a word every ``word_ms``, then make the
    ``tool_calls``."""

    model_config = ConfigDict(extra="forbid")

    text: str = Field(
        default="",
        description="What the model says. `{{tool_output:NAME}}` becomes the latest output of tool NAME in the context "
        "the request received (`<none>` if there is none); `{{coach}}` becomes the operator's coaching notes the "
        "request carried (`<none>` if none).",
    )
    tool_calls: list[ScriptedToolCall] = Field(default_factory=list)
    ttft_ms: float = Field(default=0, ge=0, le=600_000, description="Time to the first word, in milliseconds.")
    word_ms: float = Field(default=0, ge=0, le=60_000, description="Time between words, in milliseconds.")
    error: str | None = Field(default=None, description="Fail with this provider error after `ttft_ms` instead.")


class UserRule(BaseModel):
    """Answer with ``turn`` when the latest user message matches ``match``."""

    model_config = ConfigDict(extra="forbid")

    match: str = Field(min_length=1, max_length=200, description="A regular expression, matched case-insensitively.")
    turn: Turn

    @field_validator("match")
    @classmethod
    def _pattern(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as err:
            raise ValueError(f"not a regular expression ({err})") from None
        return value


class ScriptConfig(BaseModel):
    """``{"provider": "scripted", "turns": [...], "fallback"?, "on_user"?, "on_started"?, "on_output"?}``.

    A request answering a tool (its context ends with the tool's output) takes ``on_output[tool]`` (or, for the
    "running in the background" output of a tool's first progress report, ``on_started[tool]``, and for each later
    progress report ``on_progress[tool]``, by default saying nothing: a progress report is not a result); a request
    answering
    the user takes the first ``on_user`` rule matching their latest message; any other request takes the next turn,
    then the fallback once the turns are used up. Rules let a script follow a conversation whatever order it takes.
    """

    model_config = ConfigDict(extra="forbid")

    turns: list[Turn] = Field(default_factory=list)
    fallback: Turn = Field(default_factory=lambda: Turn(text="OK."), description='Default: {"text": "OK."}.')
    on_user: list[UserRule] = Field(default_factory=list, max_length=100)
    on_started: dict[str, Turn] = Field(default_factory=dict)
    on_output: dict[str, Turn] = Field(default_factory=dict)
    on_progress: dict[str, Turn] = Field(default_factory=dict)


#: How the executor words the output of a call that moved to the background (``on_started`` keys on it) and of its
#: later progress reports (``on_progress``).
BACKGROUND_OUTPUT_PREFIX = "Started and running in the background"
PROGRESS_OUTPUT_PREFIX = "Progress of the call running in the background"


def rule_turn(config: ScriptConfig, request: LLMRequest) -> Turn | None:
    """The turn a rule of ``config`` gives for ``request``, if any."""
    # what the request answers: its last item (a handoff is committed with the output of the tool that made it)
    last = next((item for item in reversed(request.items) if not aside(item)), None)
    if isinstance(last, FunctionCallOutput):
        if last.output.startswith(PROGRESS_OUTPUT_PREFIX):
            return config.on_progress.get(last.name, Turn())
        rules = config.on_started if last.output.startswith(BACKGROUND_OUTPUT_PREFIX) else config.on_output
        return rules.get(last.name)
    # the user's latest words, unless a tool has answered since (an assistant message cut off after them, say)
    for item in reversed(request.items):
        if isinstance(item, FunctionCallOutput):
            return None
        if isinstance(item, ChatMessage) and item.role == "user":
            return next((r.turn for r in config.on_user if re.search(r.match, item.text, re.IGNORECASE)), None)
    return None


def aside(item: object) -> bool:
    """An item a request's answer does not answer: a handoff, an operator's coaching note."""
    return isinstance(item, AgentHandoff) or (isinstance(item, ChatMessage) and coach_note_text(item) is not None)


def _coach_notes(request: LLMRequest) -> str:
    notes = [note for item in request.items if isinstance(item, ChatMessage) and (note := coach_note_text(item))]
    return " / ".join(notes) if notes else "<none>"


def render_text(text: str, request: LLMRequest) -> str:
    if _COACH in text:
        text = text.replace(_COACH, _coach_notes(request))

    def latest(match: re.Match[str]) -> str:
        name = match.group(1)
        for item in reversed(request.items):
            if isinstance(item, FunctionCallOutput) and item.name == name:
                return item.output
        return "<none>"

    return _TOOL_OUTPUT.sub(latest, text)


def _validated(config: dict[str, Any]) -> ScriptConfig:
    try:
        return ScriptConfig.model_validate(config)
    except ValidationError as err:
        raise config_error("scripted", err, ScriptConfig, extra_keys="provider") from None


@functools.lru_cache(maxsize=128)
def _parsed(config_json: str) -> ScriptConfig:
    """A script parsed once, shared by the sessions that run it (an agent's default script, a test's): each holds
    nothing of it that it changes (its position is its own), and parsing it cost a create more than the rest of it."""
    return _validated(json.loads(config_json))


def parse_script(config: dict[str, Any]) -> ScriptConfig:
    """Parse a script once for the many models that will run it (``ScriptedLLM.from_script``). Raises ``ValueError``."""
    return _validated(config)


class ScriptedLLM:
    def __init__(
        self, turns: list[Turn] | None = None, fallback: Turn | None = None, rules: ScriptConfig | None = None
    ) -> None:
        self.turns = list(turns or [])
        self.fallback = fallback or Turn(text="OK.")
        self.rules = rules
        self.position = 0
        self._requests: deque[LLMRequest] | None = None  # made at the first request: an idle session has none

    @property
    def requests(self) -> deque[LLMRequest]:
        """The latest requests received, for tests and debugging (bounded: a session can live for a long time)."""
        if self._requests is None:
            self._requests = deque(maxlen=KEEP_REQUESTS)
        return self._requests

    @requests.setter
    def requests(self, value: deque[LLMRequest]) -> None:
        self._requests = value

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ScriptedLLM:
        try:
            parsed = _parsed(json.dumps(config, sort_keys=True))
        except TypeError:  # not JSON: parsed for itself
            parsed = _validated(config)
        return cls.from_script(parsed)

    @classmethod
    def from_script(cls, parsed: ScriptConfig) -> ScriptedLLM:
        """A model of a parsed script, at its first turn (the script is shared, never changed)."""
        has_rules = parsed.on_user or parsed.on_started or parsed.on_output or parsed.on_progress
        return cls(parsed.turns, parsed.fallback, parsed if has_rules else None)

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
        turn = rule_turn(self.rules, request) if self.rules is not None else None
        turn = turn or self._next_turn()
        return play_turn(turn, render_text(turn.text, request), request)


async def play_turn(turn: Turn, text: str, request: LLMRequest) -> AsyncIterator[LLMChunk]:
    """Answer ``request`` with ``turn``, saying ``text`` (its rendered text): wait, stream the words, make the calls."""
    if turn.ttft_ms:
        await asyncio.sleep(turn.ttft_ms / 1000)
    if turn.error:
        raise LLMError(turn.error)
    words = _WORDS.findall(text)
    for index, word in enumerate(words):
        if index and turn.word_ms:
            await asyncio.sleep(turn.word_ms / 1000)
        yield TextDelta(word)
    # like a provider: tools off means no call, but a model offered no tools at all may still make one (it is sent
    # no tool_choice, and earlier calls in its context invite more)
    if request.tool_choice != "none" or not request.tools:
        for call in turn.tool_calls:
            args = call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments)
            yield ToolCallChunk(name=call.name, arguments=args, call_id=call.id)
    yield Usage(prompt_tokens=len(request.items), completion_tokens=len(words))
