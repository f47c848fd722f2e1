"""OpenTelemetry spans, caught by the SDK's in-memory exporter: a span per command (continuing the caller's
``traceparent``), per speech with its generation steps, per tool call with its progress, each linked to its cause;
the tool call's trace context goes out with its webhook deliveries. Off unless the OTEL_* variables turn it on."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from switchboard.api.app import create_app
from switchboard.control import tracing
from switchboard.runtime.agent import AgentRegistry
from tests.agents_fixture import AGENTS as TEST_AGENTS
from tests.webhook_backend import FakeBackend

from .conftest import make_settings
from .test_sessions_api import until
from .test_webhook_tools import SECRET, SECRET_ENV, agents_file

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
async def client(tmp_path: Path, exporter: InMemorySpanExporter) -> AsyncIterator[httpx.AsyncClient]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = create_app(make_settings(tmp_path), registry=AgentRegistry(TEST_AGENTS), tracer_provider=provider)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            yield c


def named(spans: tuple[ReadableSpan, ...], prefix: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name.startswith(prefix)]


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


async def test_command_speech_generation_and_tool_spans_are_linked(
    client: httpx.AsyncClient, exporter: InMemorySpanExporter
):
    turns = [
        {"text": "Working on it.", "tool_calls": [{"name": "progress", "arguments": {"steps": 2, "step_s": 0.01}}]}
    ]
    r = await client.post("/v1/sessions", json={"agent": "tester", "llm": {"provider": "scripted", "turns": turns}})
    sid = r.json()["id"]
    r = await client.post(f"/v1/sessions/{sid}/input", json={"text": "go"}, headers={"traceparent": TRACEPARENT})
    assert r.status_code == 202
    speech_id = r.json()["speech_id"]

    def finished() -> bool:
        spans = exporter.get_finished_spans()
        tools = named(spans, "tool progress")
        speeches = [s for s in named(spans, "speech") if s.attributes["switchboard.speech_id"] == speech_id]
        return bool(tools) and bool(speeches)  # the result lands before the tool reply, which answers it

    await until(finished)
    spans = exporter.get_finished_spans()
    command = next(s for s in spans if s.name == "POST /v1/sessions/{sid}/input")
    # the caller's trace continues: its traceparent is the command's parent
    assert command.context.trace_id == int(CALLER_TRACE, 16) and parent_of(command) == int(CALLER_SPAN, 16)
    assert command.attributes["switchboard.session_id"] == sid
    assert command.attributes["http.response.status_code"] == 202
    speech = next(s for s in named(spans, "speech") if s.attributes["switchboard.speech_id"] == speech_id)
    assert parent_of(speech) == command.context.span_id and speech.context.trace_id == int(CALLER_TRACE, 16)
    steps = [s for s in named(spans, "generation") if parent_of(s) == speech.context.span_id]
    assert [s.attributes["switchboard.step"] for s in steps] == [0, 1]  # the reply, then the tool reply
    tool = named(spans, "tool progress")[0]
    assert parent_of(tool) == speech.context.span_id
    assert tool.attributes["switchboard.status"] == "completed"
    assert [e.attributes["message"] for e in tool.events] == ["step 1/2", "step 2/2"]
    assert [e.attributes["progress"] for e in tool.events] == [0.5, 1.0]
    # a read is not a command
    assert not [s for s in spans if s.name.startswith("GET")]


async def test_a_failed_tool_is_an_error_span_and_reads_have_no_span(
    client: httpx.AsyncClient, exporter: InMemorySpanExporter
):
    turns = [{"text": "", "tool_calls": [{"name": "fail", "arguments": {}}]}]
    r = await client.post("/v1/sessions", json={"agent": "tester", "llm": {"provider": "scripted", "turns": turns}})
    sid = r.json()["id"]
    await client.post(f"/v1/sessions/{sid}/input", json={"text": "go"})
    tool = await until(lambda: named(exporter.get_finished_spans(), "tool fail"))
    assert tool[0].status.status_code == StatusCode.ERROR and tool[0].attributes["switchboard.status"] == "failed"
    await client.get(f"/v1/sessions/{sid}")
    command = next(s for s in exporter.get_finished_spans() if s.name == "POST /v1/sessions")
    assert parent_of(command) is None  # no traceparent: a new trace


async def test_webhook_deliveries_carry_the_tool_calls_traceparent(
    tmp_path: Path, exporter: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv(SECRET_ENV, SECRET)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with FakeBackend(SECRET) as backend:
        settings = make_settings(tmp_path, agents_file=agents_file(tmp_path, backend))
        app = create_app(settings, registry=AgentRegistry(TEST_AGENTS), tracer_provider=provider)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
                turns = [{"text": "", "tool_calls": [{"name": "lookup", "arguments": {"order_id": "A1"}}]}]
                body: dict[str, Any] = {"agent": "hooks", "llm": {"provider": "scripted", "turns": turns}}
                sid = (await c.post("/v1/sessions", json=body)).json()["id"]
                await c.post(f"/v1/sessions/{sid}/input", json={"text": "go"}, headers={"traceparent": TRACEPARENT})
                await backend.next("call")
                tool = await until(lambda: named(exporter.get_finished_spans(), "tool lookup"))
    version, trace_id, span_id, _ = backend.call_headers[0]["traceparent"].split("-")
    assert version == "00" and trace_id == CALLER_TRACE
    assert int(span_id, 16) == tool[0].context.span_id


async def test_a_deferred_reply_is_its_own_trace_linked_to_the_result_it_answers(
    client: httpx.AsyncClient, exporter: InMemorySpanExporter
):
    """Before: the deferred reply (and what it called) sat in the trace of POST /v1/sessions, long ended."""
    turns = [
        {"text": "Searching.", "tool_calls": [{"name": "search", "arguments": {"query": "q", "seconds": 0.05}}]},
        {"text": "Started."},
        {"text": "Found it."},  # the deferred reply to the background search's result
    ]
    r = await client.post("/v1/sessions", json={"agent": "tester", "llm": {"provider": "scripted", "turns": turns}})
    sid = r.json()["id"]
    await client.post(f"/v1/sessions/{sid}/input", json={"text": "search"})

    def deferred() -> list[ReadableSpan]:
        spans = named(exporter.get_finished_spans(), "speech")
        return [s for s in spans if s.attributes["switchboard.source"] == "deferred_reply"]

    speech = (await until(deferred))[0]
    spans = exporter.get_finished_spans()
    create = next(s for s in spans if s.name == "POST /v1/sessions")
    command = next(s for s in spans if s.name == "POST /v1/sessions/{sid}/input")
    tool = named(spans, "tool search")[0]
    assert tool.context.trace_id == command.context.trace_id  # the search belongs to the input's turn
    assert speech.parent is None and speech.context.trace_id not in (create.context.trace_id, tool.context.trace_id)
    assert [link.context.span_id for link in speech.links] == [tool.context.span_id]
    steps = [s for s in named(spans, "generation") if parent_of(s) == speech.context.span_id]
    assert steps and all(s.context.trace_id == speech.context.trace_id for s in steps)
    assert not [s for s in spans if s is not create and s.context.trace_id == create.context.trace_id]


async def test_a_cancelled_tool_is_not_an_error_and_the_cancel_links_to_it(
    client: httpx.AsyncClient, exporter: InMemorySpanExporter
):
    turns = [
        {"text": "Searching.", "tool_calls": [{"name": "search", "arguments": {"query": "q", "seconds": 30}}]},
        {"text": "Started."},
    ]
    r = await client.post("/v1/sessions", json={"agent": "tester", "llm": {"provider": "scripted", "turns": turns}})
    sid = r.json()["id"]
    await client.post(f"/v1/sessions/{sid}/input", json={"text": "search"})

    async def backgrounded() -> str | None:  # the search reported progress: its body is running
        calls = (await client.get(f"/v1/sessions/{sid}/tool-calls", params={"status": "running"})).json()["items"]
        return calls[0]["call_id"] if calls and calls[0]["progress"] else None

    call_id = await until(backgrounded)
    r = await client.post(f"/v1/sessions/{sid}/tool-calls/{call_id}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    spans = exporter.get_finished_spans()
    tool = named(spans, "tool search")[0]
    cancel = next(s for s in spans if s.name == "POST /v1/sessions/{sid}/tool-calls/{call_id}/cancel")
    assert tool.status.status_code != StatusCode.ERROR and tool.attributes["switchboard.status"] == "cancelled"
    events = {e.name: e.attributes for e in tool.events}
    assert "cancelled" in str(events["cancelled"]["reason"])
    assert events["cancel requested"]["span_id"] == f"{cancel.context.span_id:016x}"
    assert [link.context.span_id for link in cancel.links] == [tool.context.span_id]


async def test_generation_spans_carry_the_gen_ai_attributes(client: httpx.AsyncClient, exporter: InMemorySpanExporter):
    turns = [{"text": "Let me see.", "tool_calls": [{"name": "book", "arguments": {"what": "a table"}}]}]
    r = await client.post("/v1/sessions", json={"agent": "tester", "llm": {"provider": "scripted", "turns": turns}})
    sid = r.json()["id"]
    speech_id = (await client.post(f"/v1/sessions/{sid}/input", json={"text": "book"})).json()["speech_id"]

    def steps() -> list[ReadableSpan]:
        spans = exporter.get_finished_spans()
        speech = [s for s in named(spans, "speech") if s.attributes["switchboard.speech_id"] == speech_id]
        return [s for s in named(spans, "generation") if speech and parent_of(s) == speech[0].context.span_id]

    found = sorted(await until(steps), key=lambda s: s.attributes["switchboard.step"])
    for step in found:
        attributes = step.attributes
        assert attributes["gen_ai.operation.name"] == "chat"
        assert attributes["gen_ai.provider.name"] == attributes["gen_ai.system"] == "scripted"
        assert attributes["gen_ai.request.model"] == "scripted"
        assert attributes["gen_ai.usage.input_tokens"] > 0 and attributes["gen_ai.usage.output_tokens"] > 0
    assert [s.attributes["gen_ai.response.finish_reasons"] for s in found] == [("tool_calls",), ("stop",)]


def test_tracing_logs_where_it_exports_once_on_and_never_a_secret(caplog: pytest.LogCaptureFixture):
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "https://team:hunter2@collector.example:4318/",
        "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer s3cret",
    }
    with caplog.at_level(logging.INFO, logger="switchboard.tracing"):
        provider = tracing.configure(env)
        assert provider is not None
        provider.shutdown()
        tracing.configure({})
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["tracing on: exporter otlp_proto_http to https://collector.example:4318/v1/traces"]


def test_tracing_is_off_unless_the_otel_variables_ask_for_it():
    assert tracing.configure({}) is None
    assert tracing.configure({"OTEL_TRACES_EXPORTER": "none"}) is None
    assert tracing.configure({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}) is None
    for env in ({"OTEL_TRACES_EXPORTER": "console"}, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}):
        provider = tracing.configure(env)
        assert isinstance(provider, TracerProvider)
        provider.shutdown()
    with pytest.raises(ValueError, match="no exporter 'zipkin-ish'"):
        tracing.configure({"OTEL_TRACES_EXPORTER": "zipkin-ish"})
