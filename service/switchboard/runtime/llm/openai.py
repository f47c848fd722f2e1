"""The OpenAI-compatible provider: streaming Chat Completions against OpenAI or any server that speaks the same API
(vLLM, Ollama, llama.cpp's server, LM Studio, ...).

Session config: ``{"provider": "openai", "model": "gpt-4o-mini", "base_url"?, "api_key_env"?, "temperature"?,
"timeout_s"?, "max_retries"?}``. The key is read from the environment variable named by ``api_key_env``; it never
appears in the config, in errors or in logs.

Errors: connection failures, timeouts, 429 and 5xx are retried (with backoff, honouring ``Retry-After``) only
while nothing has been yielded, and only within ``timeout_s`` of the request; anything else ends the stream with
an ``LLMError``. ``timeout_s`` also bounds any silence inside the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import logging
import os
import random
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import openai
from openai import AsyncOpenAI, AsyncStream
from openai.types.chat import ChatCompletionChunk
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..chat import AgentHandoff, ChatItem, ChatMessage, FunctionCall, FunctionCallOutput
from ..text import StreamText, valid_text
from .base import LLMChunk, LLMError, LLMRequest, MissingCredential, TextDelta, ToolCallChunk, Usage, config_error

logger = logging.getLogger("switchboard.runtime.llm.openai")

DEFAULT_BASE_URL = "https://api.openai.com/v1"
PLACEHOLDER_API_KEY = "not-needed"  # local servers ignore the key; the SDK insists on one
BACKOFF_INITIAL_S = 0.2
BACKOFF_MAX_S = 4.0
ERROR_DETAIL_MAX_CHARS = 300
_RETRY_STATUSES = frozenset({408, 429})  # and every 5xx
_SECRET_PATTERNS = (
    re.compile(r"\bsk-[A-Za-z0-9_\-*.]+"),
    re.compile(r"(?i)\bbearer\s+[^\s'\",}]+"),
)


class OpenAIConfig(BaseModel):
    """A session's ``llm`` config for the OpenAI-compatible provider (``provider`` removed)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1)
    base_url: str | None = None
    api_key_env: str = Field(default="OPENAI_API_KEY", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    temperature: float | None = Field(default=None, ge=0, le=2)
    timeout_s: float = Field(default=30.0, gt=0, le=600)
    max_retries: int = Field(default=2, ge=0, le=10)

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^https?://[^\s/]+", value):
            raise ValueError("must be an http:// or https:// URL")
        return value


def parse_config(config: dict[str, Any]) -> OpenAIConfig:
    """Validate a config; a problem becomes a ``ValueError`` naming each bad key (the API answers 422)."""
    try:
        return OpenAIConfig.model_validate(config)
    except ValidationError as err:
        raise config_error("openai", err, OpenAIConfig, extra_keys="provider") from None


# -- request building -----------------------------------------------------------------------------------------

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def handoff_note(item: AgentHandoff) -> str:
    if item.from_agent:
        return f"The conversation was handed off from {item.from_agent} to {item.to_agent}."
    return f"The conversation was handed off to {item.to_agent}."


def build_messages(request: LLMRequest) -> list[dict[str, Any]]:
    """Chat Completions messages for ``request``.

    - the instructions first, as a system message;
    - ``developer`` messages are sent as ``system`` (every compatible server accepts it; OpenAI treats both alike);
    - an interrupted assistant message is sent as is: its text already is what the user heard;
    - a run of function calls (each followed by its output in the context) becomes one assistant message carrying
      every call, merged into the assistant text just before it (the model's own preamble), then one ``tool``
      message per output, in call order;
    - an agent handoff becomes a short system note, so the new agent knows earlier turns were someone else's.
    """
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    items = request.items
    index = 0
    while index < len(items):
        item = items[index]
        if isinstance(item, FunctionCall | FunctionCallOutput):
            end = index
            while end < len(items) and isinstance(items[end], FunctionCall | FunctionCallOutput):
                end += 1
            _append_tool_run(messages, items[index:end])
            index = end
            continue
        if isinstance(item, ChatMessage):
            messages.append({"role": _ROLES[item.role], "content": item.text})
        elif isinstance(item, AgentHandoff):
            messages.append({"role": "system", "content": handoff_note(item)})
        index += 1
    return messages


def _append_tool_run(messages: list[dict[str, Any]], run: list[ChatItem]) -> None:
    calls = [it for it in run if isinstance(it, FunctionCall)]
    outputs = {it.call_id: it for it in run if isinstance(it, FunctionCallOutput)}
    # The context handed in is valid (I2); this only keeps a broken one from being rejected by the provider.
    paired = [call for call in calls if call.call_id in outputs]
    if len(paired) != len(calls) or len(outputs) != len(paired):
        logger.warning("dropping unpaired tool items from the model request")
    if not paired:
        return
    tool_calls = [
        {
            "id": call.call_id,
            "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
        }
        for call in paired
    ]
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and "tool_calls" not in last:
        last["tool_calls"] = tool_calls
    else:
        # "" rather than null: Ollama rejects a null content; OpenAI and vLLM take either
        messages.append({"role": "assistant", "content": "", "tool_calls": tool_calls})
    for call in paired:
        messages.append({"role": "tool", "tool_call_id": call.call_id, "content": outputs[call.call_id].output})


def build_params(config: OpenAIConfig, request: LLMRequest) -> dict[str, Any]:
    """The keyword arguments of ``chat.completions.create`` for ``request``."""
    params: dict[str, Any] = {
        "model": config.model,
        "messages": build_messages(request),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request.tools:
        params["tools"] = [{"type": "function", "function": tool} for tool in request.tools]
        params["tool_choice"] = request.tool_choice
    if config.temperature is not None:
        params["temperature"] = config.temperature
    return params


# -- errors -----------------------------------------------------------------------------------------------------


class _Transient(Exception):
    """A failure that is safe to retry if nothing has been yielded yet."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s


def _retry_after(headers: Any) -> float | None:
    """Seconds from ``retry-after-ms`` / ``retry-after`` (seconds or an HTTP date), or None."""
    try:
        if (ms := headers.get("retry-after-ms")) is not None:
            return max(float(ms) / 1000, 0.0)
        value = headers.get("retry-after")
        if value is None:
            return None
        with contextlib.suppress(ValueError):
            return max(float(value), 0.0)
        when = email.utils.parsedate_to_datetime(value)
        return max(when.timestamp() - time.time(), 0.0)
    except (TypeError, ValueError, OverflowError):
        return None


def _detail(body: object) -> str:
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return str(inner["message"])
        if isinstance(inner, str):
            return inner
        with contextlib.suppress(TypeError, ValueError):
            return json.dumps(body)
    return str(body) if body is not None else ""


@dataclass
class _PendingCall:
    index: int
    call_id: str | None = None
    name: str = ""
    arguments: str = ""


class _ToolCallAssembler:
    """Assembles tool calls from argument deltas by index. A call is complete when a later index starts, when the
    choice finishes, or when the stream ends (OpenAI-compatible servers stream calls one after another)."""

    def __init__(self) -> None:
        self._pending: dict[int, _PendingCall] = {}
        self._emitted: set[int] = set()
        self._last_index = -1

    def add(self, delta: Any) -> list[ToolCallChunk]:
        index = getattr(delta, "index", None)
        if not isinstance(index, int):
            # a server that omits the index: a delta with an id starts a new call, one without continues the last
            starts = bool(getattr(delta, "id", None)) or self._last_index < 0
            index = self._last_index + 1 if starts else self._last_index
        if index in self._emitted:
            raise LLMError(f"malformed stream: tool call {index} continued after it was complete")
        done = [i for i in self._pending if i < index] if index > self._last_index else []
        ready = [self._finish(i) for i in sorted(done)]
        self._last_index = max(self._last_index, index)
        pending = self._pending.setdefault(index, _PendingCall(index))
        call_id = getattr(delta, "id", None)
        if isinstance(call_id, str) and call_id:
            pending.call_id = call_id
        function = getattr(delta, "function", None)
        name = getattr(function, "name", None)
        if isinstance(name, str) and name and not pending.name:
            pending.name = name
        arguments = getattr(function, "arguments", None)
        if isinstance(arguments, str):
            pending.arguments += arguments
        return ready

    def flush(self) -> list[ToolCallChunk]:
        return [self._finish(i) for i in sorted(self._pending)]

    def _finish(self, index: int) -> ToolCallChunk:
        call = self._pending.pop(index)
        self._emitted.add(index)
        if not call.name:
            raise LLMError(f"malformed stream: tool call {index} has no name")
        call_id = valid_text(call.call_id) if call.call_id is not None else None
        return ToolCallChunk(name=valid_text(call.name), arguments=valid_text(call.arguments), call_id=call_id)


# -- the provider -----------------------------------------------------------------------------------------------


@dataclass
class _Progress:
    yielded: bool = False  # has anything reached the consumer? then nothing may be retried


def needs_key(config: OpenAIConfig) -> bool:
    """OpenAI itself needs a key, and so does a server whose configuration names the variable; a local server (a
    ``base_url``, no ``api_key_env``) does not."""
    return config.base_url in (None, DEFAULT_BASE_URL) or "api_key_env" in config.model_fields_set


class OpenAILLM:
    """Streams Chat Completions from an OpenAI-compatible server. Stateless across restarts.

    One HTTP client per provider (connections are reused between turns); ``aclose()`` releases it.
    """

    def __init__(self, config: OpenAIConfig) -> None:
        self.config = config
        key = os.environ.get(config.api_key_env)
        if not key and needs_key(config):
            raise MissingCredential(
                config.api_key_env,
                f"the model {config.model!r} needs an API key in the service's environment variable "
                f"{config.api_key_env}, which is not set",
            )
        self._api_key = key or PLACEHOLDER_API_KEY
        self._client: AsyncOpenAI | None = None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> OpenAILLM:
        return cls(parse_config(config))

    def __repr__(self) -> str:
        return f"<OpenAILLM model={self.config.model!r} base_url={self.base_url!r}>"

    @property
    def base_url(self) -> str:
        return self.config.base_url or DEFAULT_BASE_URL

    def save_state(self) -> dict[str, Any] | None:
        return None

    def load_state(self, state: dict[str, Any] | None) -> None:
        return None

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    def _get_client(self) -> AsyncOpenAI:
        if self._client is None:
            self._client = AsyncOpenAI(
                api_key=self._api_key,
                base_url=self.base_url,
                timeout=self.config.timeout_s + 1.0,  # a safety net: the asyncio timeouts here fire first
                max_retries=0,  # retries are ours: only before the first chunk, within timeout_s
            )
        return self._client

    def _redact(self, text: str) -> str:
        if len(self._api_key) >= 4:
            text = text.replace(self._api_key, "***")
        for pattern in _SECRET_PATTERNS:
            text = pattern.sub("***", text)
        if len(text) > ERROR_DETAIL_MAX_CHARS:
            text = text[:ERROR_DETAIL_MAX_CHARS] + "..."
        return text

    def stream(self, request: LLMRequest) -> AsyncIterator[LLMChunk]:
        return self._stream(request)

    async def _stream(self, request: LLMRequest) -> AsyncIterator[LLMChunk]:
        params = build_params(self.config, request)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.timeout_s
        progress = _Progress()
        attempt = 0
        while True:
            try:
                # aclosing: an interruption closes the attempt (and its HTTP response) now, not at garbage collection
                async with contextlib.aclosing(self._attempt(params, deadline, progress)) as chunks:
                    async for chunk in chunks:
                        progress.yielded = True
                        yield chunk
                return
            except _Transient as err:
                message = self._redact(err.message)
                if progress.yielded:
                    raise LLMError(f"{message} (the stream broke after it had started)", retryable=True) from None
                if attempt >= self.config.max_retries:
                    raise LLMError(f"{message} (after {attempt + 1} attempts)", retryable=True) from None
                delay = err.retry_after_s
                if delay is None:
                    delay = min(BACKOFF_INITIAL_S * 2**attempt, BACKOFF_MAX_S) * random.uniform(0.5, 1.0)
                if loop.time() + delay >= deadline:
                    raise LLMError(
                        f"{message} (no retry: it would end after timeout_s={self.config.timeout_s:g})",
                        retryable=True,
                    ) from None
                attempt += 1
                logger.warning("model request failed (%s); retry %d in %.2fs", message, attempt, delay)
                await asyncio.sleep(delay)

    async def _attempt(
        self, params: dict[str, Any], deadline: float, progress: _Progress
    ) -> AsyncGenerator[LLMChunk, None]:
        """One HTTP request. Raises ``_Transient`` for what may be retried, ``LLMError`` for the rest."""
        stream: AsyncStream[ChatCompletionChunk] | None = None
        try:
            stream = await self._open(params, deadline)
            response = _Response()
            while (chunk := await self._next_chunk(stream, deadline, progress)) is not None:
                for item in response.read(chunk):
                    yield item
            for item in response.end():
                yield item
        except openai.OpenAIError as err:
            raise self._failure(err) from None
        except json.JSONDecodeError:
            raise LLMError("malformed stream: a chunk is not valid JSON", retryable=False) from None
        finally:
            if stream is not None:
                await _close_stream(stream)

    async def _open(self, params: dict[str, Any], deadline: float) -> AsyncStream[ChatCompletionChunk]:
        create = cast(
            Callable[..., Awaitable[AsyncStream[ChatCompletionChunk]]], self._get_client().chat.completions.create
        )
        try:
            async with asyncio.timeout_at(deadline):
                return await create(**params)
        except TimeoutError:
            raise _Transient(f"no response from the model within timeout_s={self.config.timeout_s:g}") from None

    async def _next_chunk(
        self, stream: AsyncStream[ChatCompletionChunk], deadline: float, progress: _Progress
    ) -> ChatCompletionChunk | None:
        """The next chunk, or None at the end of the stream."""
        # Until something is yielded the request's deadline bounds the wait; after that, each silence does.
        started = progress.yielded
        limit = asyncio.get_running_loop().time() + self.config.timeout_s if started else deadline
        try:
            async with asyncio.timeout_at(limit):
                return await anext(stream)
        except StopAsyncIteration:
            return None
        except TimeoutError:
            what = "the model stream stalled for more than" if started else "no output from the model within"
            raise LLMError(f"{what} timeout_s={self.config.timeout_s:g}", retryable=True) from None

    def _failure(self, err: openai.OpenAIError) -> LLMError | _Transient:
        """What an SDK error means for the stream: a retry (``_Transient``) or its end (``LLMError``)."""
        if isinstance(err, openai.APIStatusError):
            detail = _detail(err.body) or err.response.reason_phrase
            message = f"the model server answered {err.status_code}: {detail}"
            if err.status_code in _RETRY_STATUSES or err.status_code >= 500:
                return _Transient(message, _retry_after(err.response.headers))
            return LLMError(self._redact(message), retryable=False)
        if isinstance(err, openai.APITimeoutError):
            return _Transient("the model server timed out")
        if isinstance(err, openai.APIConnectionError):
            cause = err.__cause__
            reason = f": {type(cause).__name__}" if cause is not None else ""
            return _Transient(f"could not talk to the model server at {self._host()}{reason}")
        if isinstance(err, openai.APIError):  # an error event inside the stream
            return LLMError(self._redact(f"the model reported an error: {err.message}"), retryable=False)
        return LLMError(self._redact(f"model request failed: {type(err).__name__}: {err}"))

    def _host(self) -> str:
        match = re.match(r"^https?://(?:[^@/]*@)?([^/]+)", self.base_url)
        return match.group(1) if match else "?"


class _Response:
    """What one streamed response has produced so far: tool calls being assembled, whether the choice finished, and
    the usage it reported."""

    def __init__(self) -> None:
        self.calls = _ToolCallAssembler()
        self.text = StreamText()  # the model's text is made valid Unicode as it arrives (runtime.text)
        self.finished = False
        self.usage: Usage | None = None

    def read(self, chunk: ChatCompletionChunk) -> list[LLMChunk]:
        """The output chunks ``chunk`` completes."""
        try:
            out, finished, usage = _read_chunk(chunk, self.calls)
        except (AttributeError, TypeError, ValueError) as err:
            raise LLMError(f"malformed stream: unexpected chunk ({type(err).__name__})") from None
        self.finished = self.finished or finished
        self.usage = usage or self.usage
        return [piece for piece in map(self._valid, out) if not (isinstance(piece, TextDelta) and not piece.text)]

    def _valid(self, piece: LLMChunk) -> LLMChunk:
        return TextDelta(self.text.feed(piece.text)) if isinstance(piece, TextDelta) else piece

    def end(self) -> list[LLMChunk]:
        """What is left once the stream ended: the last tool calls, then the usage."""
        if not self.finished:
            raise _Transient("the model stream ended before the model finished")
        held = self.text.end()
        text: list[LLMChunk] = [TextDelta(held)] if held else []
        usage: list[LLMChunk] = [self.usage] if self.usage is not None else []
        return [*text, *self.calls.flush(), *usage]


async def _close_stream(stream: AsyncStream[ChatCompletionChunk]) -> None:
    # Closes the HTTP response at once: on an interruption the server sees the connection go and stops generating.
    with contextlib.suppress(Exception):
        await stream.close()


def _read_chunk(chunk: ChatCompletionChunk, calls: _ToolCallAssembler) -> tuple[list[LLMChunk], bool, Usage | None]:
    """What one stream chunk contributes: output chunks, whether the choice finished, the usage it reports."""
    out: list[LLMChunk] = []
    finished = False
    for choice in getattr(chunk, "choices", None) or ():
        if getattr(choice, "index", 0) not in (0, None):
            continue  # n=1: only the first choice is ours
        delta = getattr(choice, "delta", None)
        content = getattr(delta, "content", None)
        if isinstance(content, str) and content:
            out.append(TextDelta(content))
        for tool_delta in getattr(delta, "tool_calls", None) or ():
            out.extend(calls.add(tool_delta))
        if getattr(choice, "finish_reason", None):
            finished = True
            out.extend(calls.flush())
    usage = None
    raw_usage = getattr(chunk, "usage", None)
    if raw_usage is not None:
        usage = Usage(
            prompt_tokens=int(getattr(raw_usage, "prompt_tokens", 0) or 0),
            completion_tokens=int(getattr(raw_usage, "completion_tokens", 0) or 0),
        )
    return out, finished, usage


__all__ = ["OpenAIConfig", "OpenAILLM", "build_messages", "build_params", "parse_config"]
