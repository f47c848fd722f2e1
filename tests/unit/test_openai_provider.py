"""The OpenAI-compatible provider against a real HTTP server on loopback: what the server receives, what the
provider yields, and how it fails (retries before the first chunk only, timeouts, malformed streams)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from switchboard.runtime.chat import AgentHandoff, ChatItem, ChatMessage, FunctionCall, FunctionCallOutput
from switchboard.runtime.llm import build_llm
from switchboard.runtime.llm.base import LLMChunk, LLMError, LLMRequest, TextDelta, ToolCallChunk, Usage
from switchboard.runtime.llm.openai import OpenAILLM
from tests.waiting import WAIT_S

from . import fake_openai as f
from .fake_openai import FakeOpenAI, Reply

BOOK = {
    "name": "book",
    "description": "Book a table.",
    "parameters": {"type": "object", "properties": {"what": {"type": "string"}}, "required": ["what"]},
}


@pytest.fixture
async def server() -> AsyncIterator[FakeOpenAI]:
    srv = await FakeOpenAI().start()
    yield srv
    await srv.aclose()


@pytest.fixture
async def make_llm(server: FakeOpenAI) -> AsyncIterator[Callable[..., OpenAILLM]]:
    made: list[OpenAILLM] = []

    def make(**config: Any) -> OpenAILLM:
        llm = build_llm({"provider": "openai", "model": "fake-model", "base_url": server.base_url, **config})
        assert isinstance(llm, OpenAILLM)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        await llm.aclose()


def request(*items: ChatItem, tools: list[dict[str, Any]] | None = None, tool_choice: str = "auto") -> LLMRequest:
    return LLMRequest(
        instructions="You book tables.",
        items=list(items) or [user("hi")],
        tools=[BOOK] if tools is None else tools,
        tool_choice=tool_choice,  # type: ignore[arg-type]
    )


_ids = iter(range(1_000_000))


def user(text: str) -> ChatMessage:
    return ChatMessage(id=f"i{next(_ids)}", role="user", text=text)


async def collect(llm: OpenAILLM, req: LLMRequest | None = None) -> list[LLMChunk]:
    return [c async for c in llm.stream(req or request())]


async def fails(llm: OpenAILLM, req: LLMRequest | None = None) -> tuple[LLMError, list[LLMChunk], float]:
    got: list[LLMChunk] = []
    start = time.monotonic()
    with pytest.raises(LLMError) as info:
        async for c in llm.stream(req or request()):
            got.append(c)
    return info.value, got, time.monotonic() - start


# -- configuration ----------------------------------------------------------------------------------------------


def test_config_is_validated_with_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"unknown key 'api_key' \(allowed: provider, model, base_url"):
        build_llm({"provider": "openai", "model": "m", "api_key": "sk-123"})
    with pytest.raises(ValueError, match="model: Field required"):
        build_llm({"provider": "openai"})
    with pytest.raises(ValueError, match="timeout_s: Input should be greater than 0"):
        build_llm({"provider": "openai", "model": "m", "timeout_s": 0})
    with pytest.raises(ValueError, match="base_url: Value error, must be an http"):
        build_llm({"provider": "openai", "model": "m", "base_url": "localhost:8000"})
    with pytest.raises(
        ValueError, match="unknown llm provider 'anthropic' \\(available: scripted, openai, fallback\\)"
    ):
        build_llm({"provider": "anthropic"})
    llm = build_llm({"provider": "openai", "model": "m", "base_url": "http://127.0.0.1:1/v1", "temperature": 0.2})
    assert isinstance(llm, OpenAILLM)
    assert llm.save_state() is None
    assert "127.0.0.1:1" in repr(llm)


# -- request building -------------------------------------------------------------------------------------------


async def test_the_server_receives_the_chat_context_as_chat_completions_messages(
    server: FakeOpenAI, make_llm: Callable[..., OpenAILLM]
) -> None:
    at = datetime(2024, 1, 1, tzinfo=UTC)
    items: list[ChatItem] = [
        ChatMessage(id="m1", role="user", text="book a table and a taxi", created_at=at),
        ChatMessage(id="m2", role="assistant", text="Let me do both.", created_at=at + timedelta(seconds=1)),
        FunctionCall(id="c1", call_id="call_a", name="book", arguments={"what": "table"}),
        FunctionCallOutput(id="o1", call_id="call_a", name="book", output="booked table"),
        FunctionCall(id="c2", call_id="call_b", name="book", arguments={"what": "taxi"}),
        FunctionCallOutput(id="o2", call_id="call_b", name="book", output="no taxi", is_error=True),
        ChatMessage(id="m3", role="assistant", text="Both are", interrupted=True),  # what was heard
        ChatMessage(id="m4", role="developer", text="Be brief."),
        AgentHandoff(id="h1", from_agent="concierge", to_agent="driver"),
        ChatMessage(id="m5", role="system", text="The user is a VIP."),
        FunctionCall(id="c3", call_id="call_c", name="book", arguments={}),
        FunctionCallOutput(id="o3", call_id="call_c", name="book", output="still in progress"),
        ChatMessage(id="m6", role="user", text="well?"),
    ]
    llm = make_llm(temperature=0.3)
    assert await collect(llm, request(*items)) == [TextDelta("OK."), Usage(10, 1)]
    body = server.requests[0].body
    assert server.requests[0].path == "/v1/chat/completions"
    assert body["model"] == "fake-model"
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0.3
    assert body["tools"] == [{"type": "function", "function": BOOK}]
    assert body["tool_choice"] == "auto"

    def call(call_id: str, arguments: dict[str, Any]) -> dict[str, Any]:
        return {"id": call_id, "type": "function", "function": {"name": "book", "arguments": json.dumps(arguments)}}

    assert body["messages"] == [
        {"role": "system", "content": "You book tables."},
        {"role": "user", "content": "book a table and a taxi"},
        # the preamble and both parallel calls are one assistant turn; each output follows as a tool message
        {
            "role": "assistant",
            "content": "Let me do both.",
            "tool_calls": [call("call_a", {"what": "table"}), call("call_b", {"what": "taxi"})],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "booked table"},
        {"role": "tool", "tool_call_id": "call_b", "content": "no taxi"},
        {"role": "assistant", "content": "Both are"},
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "The conversation was handed off from concierge to driver."},
        {"role": "system", "content": "The user is a VIP."},
        {"role": "assistant", "content": "", "tool_calls": [call("call_c", {})]},
        {"role": "tool", "tool_call_id": "call_c", "content": "still in progress"},
        {"role": "user", "content": "well?"},
    ]


async def test_tool_choice_none_is_passed_and_tools_are_omitted_when_there_are_none(
    server: FakeOpenAI, make_llm: Callable[..., OpenAILLM]
) -> None:
    llm = make_llm()
    await collect(llm, request(tool_choice="none"))
    await collect(llm, request(tools=[], tool_choice="none"))
    with_tools, without = server.bodies()
    assert with_tools["tool_choice"] == "none" and with_tools["tools"] == [{"type": "function", "function": BOOK}]
    assert "tools" not in without and "tool_choice" not in without
    assert "temperature" not in without
    assert server.requests[0].headers["authorization"].startswith("Bearer ")


# -- streaming --------------------------------------------------------------------------------------------------


async def test_text_and_two_parallel_tool_calls_split_mid_json(
    server: FakeOpenAI, make_llm: Callable[..., OpenAILLM]
) -> None:
    server.script(
        Reply(
            events=[
                f.role(),
                f.text("Booking "),
                f.text("both."),
                f.tool(0, id="call_1", name="book", args=""),
                f.tool(0, args='{"wh'),
                f.tool(0, args='at": "tab'),
                f.tool(0, args='le \\u00e9"}'),
                f.tool(1, id="call_2", name="book", args='{"what"'),
                f.tool(1, args=': "taxi"}'),
                f.finish("tool_calls"),
                f.usage(42, 17),
            ]
        )
    )
    chunks = await collect(make_llm())
    assert chunks == [
        TextDelta("Booking "),
        TextDelta("both."),
        ToolCallChunk(name="book", arguments='{"what": "table \\u00e9"}', call_id="call_1"),
        ToolCallChunk(name="book", arguments='{"what": "taxi"}', call_id="call_2"),
        Usage(prompt_tokens=42, completion_tokens=17),
    ]
    first = chunks[2]
    assert isinstance(first, ToolCallChunk) and json.loads(first.arguments) == {"what": "table é"}


async def test_chunks_are_yielded_as_they_arrive_and_cancelling_closes_the_http_stream(
    server: FakeOpenAI, make_llm: Callable[..., OpenAILLM]
) -> None:
    # the first call is complete as soon as the second starts: it is yielded while the stream is still open
    server.script(
        Reply(
            events=[f.role(), f.text("Hello"), f.tool(0, id="c1", name="book", args="{}"), f.tool(1, id="c2")],
            stall=True,
        )
    )
    llm = make_llm(timeout_s=30)
    got: list[LLMChunk] = []
    two = asyncio.Event()

    async def consume() -> None:
        async for c in llm.stream(request()):
            got.append(c)
            if len(got) == 2:
                two.set()

    task = asyncio.create_task(consume())
    async with asyncio.timeout(WAIT_S):
        await two.wait()
    assert got == [TextDelta("Hello"), ToolCallChunk(name="book", arguments="{}", call_id="c1")]
    assert server.disconnects == 0
    start = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await server.wait_disconnect(timeout=1.0)  # bound: the server saw the connection go: it can stop generating
    assert time.monotonic() - start < 0.5


# -- errors and retries -----------------------------------------------------------------------------------------


async def test_a_500_before_any_chunk_is_retried(server: FakeOpenAI, make_llm: Callable[..., OpenAILLM]) -> None:
    server.script(Reply(status=500), f.text_reply("Recovered."))
    assert await collect(make_llm()) == [TextDelta("Recovered."), Usage(10, 1)]
    assert len(server.requests) == 2
    assert server.requests[0].body == server.requests[1].body


async def test_a_400_is_not_retried(server: FakeOpenAI, make_llm: Callable[..., OpenAILLM]) -> None:
    server.script(Reply(status=400, body={"error": {"message": "Unknown parameter: 'foo'.", "type": "invalid"}}))
    err, got, _ = await fails(make_llm())
    assert str(err) == "the model server answered 400: Unknown parameter: 'foo'."
    assert err.retryable is False
    assert got == [] and len(server.requests) == 1


async def test_a_429_waits_for_retry_after(server: FakeOpenAI, make_llm: Callable[..., OpenAILLM]) -> None:
    server.script(Reply(status=429, headers={"Retry-After": "1"}), f.text_reply("Fine."))
    start = time.monotonic()
    assert await collect(make_llm()) == [TextDelta("Fine."), Usage(10, 1)]
    assert time.monotonic() - start >= 0.95
    assert len(server.requests) == 2


async def test_a_retry_after_beyond_the_timeout_fails_at_once(
    server: FakeOpenAI, make_llm: Callable[..., OpenAILLM]
) -> None:
    server.script(Reply(status=429, headers={"Retry-After": "30"}, body={"error": {"message": "Rate limit"}}))
    err, _, elapsed = await fails(make_llm(timeout_s=10))
    assert err.retryable is True
    assert "429: Rate limit" in str(err) and "no retry" in str(err)
    assert elapsed < 10 and len(server.requests) == 1  # at once: neither the 30 s asked for nor its own timeout


async def test_retries_are_bounded(server: FakeOpenAI, make_llm: Callable[..., OpenAILLM]) -> None:
    server.script(Reply(status=503), Reply(status=502), Reply(status=500), f.text_reply("never"))
    err, _, _ = await fails(make_llm(max_retries=1))
    assert err.retryable is True and "(after 2 attempts)" in str(err)
    assert len(server.requests) == 2


async def test_an_unreachable_server_is_a_retryable_error(make_llm: Callable[..., OpenAILLM]) -> None:
    llm = make_llm(base_url="http://127.0.0.1:9/v1", max_retries=1)
    err, _, _ = await fails(llm)
    assert err.retryable is True
    assert "could not talk to the model server at 127.0.0.1:9" in str(err)


async def test_a_stream_broken_after_the_first_chunk_is_not_retried(
    server: FakeOpenAI, make_llm: Callable[..., OpenAILLM]
) -> None:
    server.script(Reply(events=[f.role(), f.text("Half a sen")], abort=True), f.text_reply("again"))
    err, got, _ = await fails(make_llm())
    assert got == [TextDelta("Half a sen")]  # already played: repeating it would make the agent say it twice
    assert err.retryable is True and "after it had started" in str(err)
    assert len(server.requests) == 1


async def test_a_stream_broken_before_any_chunk_is_retried(
    server: FakeOpenAI, make_llm: Callable[..., OpenAILLM]
) -> None:
    server.script(Reply(events=[f.role()], abort=True), f.text_reply("Whole."))
    assert await collect(make_llm()) == [TextDelta("Whole."), Usage(10, 1)]
    assert len(server.requests) == 2


async def test_a_stream_that_ends_before_the_model_finished_is_retried_only_before_output(
    server: FakeOpenAI, make_llm: Callable[..., OpenAILLM]
) -> None:
    server.script(Reply(events=[f.role()]), f.text_reply("Whole."), Reply(events=[f.role(), f.text("Half")]))
    assert await collect(make_llm()) == [TextDelta("Whole."), Usage(10, 1)]
    assert len(server.requests) == 2
    err, got, _ = await fails(make_llm())
    assert got == [TextDelta("Half")] and err.retryable is True
    assert str(err) == "the model stream ended before the model finished (the stream broke after it had started)"
    assert len(server.requests) == 3


async def test_a_server_that_never_answers_times_out_without_a_retry_past_the_deadline(
    make_llm: Callable[..., OpenAILLM],
) -> None:
    requests = 0

    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal requests
        requests += 1
        with contextlib.suppress(ConnectionError):
            await reader.read()  # never answers; returns when the client hangs up
        writer.close()

    mute_server = await asyncio.start_server(mute, "127.0.0.1", 0)
    try:
        port = mute_server.sockets[0].getsockname()[1]
        err, got, elapsed = await fails(make_llm(base_url=f"http://127.0.0.1:{port}/v1", timeout_s=0.3))
    finally:
        mute_server.close()
        await mute_server.wait_closed()
    assert got == [] and err.retryable is True and requests == 1
    assert str(err) == "no response from the model within timeout_s=0.3 (no retry: it would end after timeout_s=0.3)"
    assert 0.25 <= elapsed < 5  # its own timeout, with room for a loaded machine


async def test_a_silent_server_times_out(server: FakeOpenAI, make_llm: Callable[..., OpenAILLM]) -> None:
    server.script(Reply(events=[f.role()], stall=True))
    err, got, elapsed = await fails(make_llm(timeout_s=0.3))
    assert got == [] and err.retryable is True
    assert "timeout_s=0.3" in str(err)
    assert 0.25 <= elapsed < 5  # its own timeout, with room for a loaded machine
    await server.wait_disconnect()


async def test_a_stream_that_stalls_midway_times_out(server: FakeOpenAI, make_llm: Callable[..., OpenAILLM]) -> None:
    server.script(Reply(events=[f.role(), f.text("Let me"), 0.15, f.text(" see")], stall=True))
    # a 0.15 s gap is fine, 3 s of silence is not (3 s, not less: on a loaded machine the first chunk itself took
    # longer than 0.3 s to come)
    err, got, elapsed = await fails(make_llm(timeout_s=3.0))
    assert got == [TextDelta("Let me"), TextDelta(" see")]
    assert "stalled for more than timeout_s=3" in str(err)
    assert elapsed < WAIT_S
    await server.wait_disconnect()


@pytest.mark.parametrize(
    ("events", "message"),
    [
        (["{not json"], "malformed stream: a chunk is not valid JSON"),
        ([f.tool(0, id="c1", args="{}"), f.finish("tool_calls")], "malformed stream: tool call 0 has no name"),
        ([f.tool(0, id="c1", name="a"), f.tool(1, id="c2", name="b"), f.tool(0, args="{}")], "continued after"),
        ([{"error": {"message": "The server is overloaded"}}], "the model reported an error: The server is overl"),
        ([{**f.text("x"), "choices": 5}], "malformed stream: unexpected chunk (TypeError)"),
    ],
)
async def test_a_malformed_stream_ends_with_an_error(
    server: FakeOpenAI, make_llm: Callable[..., OpenAILLM], events: list[Any], message: str
) -> None:
    server.script(Reply(events=[f.role(), f.text("Hi"), *events]))
    err, got, _ = await fails(make_llm())
    assert message in str(err)
    assert err.retryable is False
    assert got[0] == TextDelta("Hi")  # nothing is retried once output was yielded
    assert len(server.requests) == 1


async def test_errors_never_include_the_api_key(
    server: FakeOpenAI, make_llm: Callable[..., OpenAILLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    key = "sk-proj-VERYSECRET0123456789"
    monkeypatch.setenv("FAKE_OPENAI_KEY", key)
    server.script(
        Reply(status=401, body={"error": {"message": f"Incorrect API key provided: {key}. Bearer {key}"}}),
        Reply(status=500, body={"error": {"message": f"upstream said {key}"}}),
    )
    llm = make_llm(api_key_env="FAKE_OPENAI_KEY", max_retries=0)
    err401, _, _ = await fails(llm)
    err500, _, _ = await fails(llm)
    assert server.requests[0].headers["authorization"] == f"Bearer {key}"  # the key is used ...
    for err in (err401, err500):
        assert key not in str(err) and "VERYSECRET" not in str(err), str(err)  # ... and never shown
    assert str(err401).startswith("the model server answered 401: Incorrect API key provided: ***")
    assert err401.retryable is False and err500.retryable is True


async def test_a_model_server_emitting_lone_surrogates_yields_valid_text(
    server: FakeOpenAI, make_llm: Callable[..., OpenAILLM]
) -> None:
    """A lone surrogate (``\\ud800`` in the stream's JSON) has no UTF-8 form: it becomes U+FFFD, while a pair split
    between two chunks is joined into its character. NUL and control characters are kept."""
    server.script(
        Reply(
            events=[
                f.role(),
                f.text("a\ud800b\x00"),
                f.text("x\ud83d"),
                f.text("\ude00y"),
                f.tool(0, id="call\udfff", name="bo\ud800ok", args='{"what": "\ud800"}'),
                f.text("end\ud83d"),
                f.finish("stop"),
            ]
        )
    )
    chunks = await collect(make_llm())
    assert chunks == [
        TextDelta("a\ufffdb\x00"),
        TextDelta("x"),
        TextDelta("😀y"),
        TextDelta("end"),
        ToolCallChunk(name="bo\ufffdok", arguments='{"what": "\ufffd"}', call_id="call\ufffd"),
        TextDelta("\ufffd"),
    ]
    for c in chunks:
        text = c.text if isinstance(c, TextDelta) else c.name + c.arguments  # type: ignore[union-attr]
        text.encode("utf-8")  # would raise on a surrogate
