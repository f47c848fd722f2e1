"""OpenTelemetry traces: a span per API command, per speech (a child span per generation step) and per tool call
(progress as span events), the speech a child of the command that caused it and the tool call a child of its speech.

Off unless the standard ``OTEL_*`` variables ask for it (``configure``): ``OTEL_TRACES_EXPORTER`` names an exporter
(``otlp``, over HTTP/protobuf unless ``OTEL_EXPORTER_OTLP_PROTOCOL=grpc`` and
the gRPC exporter is installed; ``console``), or an ``OTEL_EXPORTER_OTLP_*ENDPOINT`` is set;
``OTEL_SDK_DISABLED=true`` turns it off. Sampling, resource (``OTEL_SERVICE_NAME``) and batching read their own
``OTEL_*`` variables through the SDK.

Spans are made from the session's events as they are emitted (``TracingSink`` wraps the store's sink): the runtime
stays free of tracing, and ``speech.created`` is emitted in the command's own context, which is how a speech finds
its parent.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from importlib.metadata import entry_points
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from ..runtime.events import Event, EventSink

logger = logging.getLogger("switchboard.tracing")

TRACER_NAME = "switchboard"
_OTLP_ENDPOINTS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def configure(env: dict[str, str] | None = None) -> TracerProvider | None:
    """A tracer provider as the ``OTEL_*`` variables configure it, or None when they do not ask for traces."""
    env = dict(os.environ) if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    names = [n.strip() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if not names and any(env.get(k) for k in _OTLP_ENDPOINTS):
        names = ["otlp"]
    names = [n for n in names if n != "none"]
    if not names:
        return None
    provider = TracerProvider(resource=Resource.create())
    for name in names:
        if name == "otlp":
            protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            name = "otlp_proto_grpc" if protocol == "grpc" else "otlp_proto_http"
        found = entry_points(group="opentelemetry_traces_exporter", name=name)
        if not found:
            raise ValueError(f"OTEL_TRACES_EXPORTER: no exporter {name!r} is installed")
        exporter_class: Callable[[], SpanExporter] = next(iter(found)).load()
        provider.add_span_processor(BatchSpanProcessor(exporter_class()))
    return provider


class Tracing:
    """The service's spans, on ``provider``; one per process (built by the app)."""

    def __init__(self, provider: trace.TracerProvider) -> None:
        self.tracer = provider.get_tracer(TRACER_NAME)
        self._speeches: dict[tuple[str, str], Span] = {}
        self._steps: dict[tuple[str, str], Span] = {}
        self._calls: dict[tuple[str, str], Span] = {}

    def sink(self, inner: EventSink) -> EventSink:
        return TracingSink(inner, self)

    def call_headers(self, session_id: str, call_id: str) -> dict[str, str]:
        """W3C trace context headers (``traceparent``) naming the tool call's span, for its webhook deliveries."""
        span = self._calls.get((session_id, call_id))
        headers: dict[str, str] = {}
        if span is not None:
            propagate.inject(headers, context=trace.set_span_in_context(span))
        return headers

    def observe(self, event: Event) -> None:
        """Start, annotate or end spans for ``event`` (called in the emitter's context, before it is durable)."""
        handler = _HANDLERS.get(event.type)
        if handler is None:
            return
        try:
            handler(self, event.session_id, event.data)
        except Exception:  # tracing never breaks a session
            logger.exception("tracing failed on %s", event.type, extra={"session_id": event.session_id})

    # -- speeches -------------------------------------------------------------------------------------------------

    def _speech_created(self, sid: str, data: dict[str, Any]) -> None:
        speech_id = str(data["speech_id"])
        # the current context: the command's span when a command made the speech
        span = self.tracer.start_span(
            "speech",
            attributes={
                "switchboard.session_id": sid,
                "switchboard.speech_id": speech_id,
                "switchboard.source": str(data.get("source")),
            },
        )
        self._speeches[(sid, speech_id)] = span

    def _generation_started(self, sid: str, data: dict[str, Any]) -> None:
        key = (sid, str(data["speech_id"]))
        self._end_step(key)
        parent = self._speeches.get(key)
        ctx = trace.set_span_in_context(parent) if parent is not None else None
        self._steps[key] = self.tracer.start_span(
            "generation",
            context=ctx,
            attributes={
                "switchboard.step": int(data.get("step", 0)),
                "switchboard.preemptive": bool(data.get("preemptive")),
            },
        )

    def _generation_failed(self, sid: str, data: dict[str, Any]) -> None:
        step = self._steps.get((sid, str(data["speech_id"])))
        if step is not None:
            step.set_status(Status(StatusCode.ERROR, str(data.get("error", ""))))

    def _speech_interrupted(self, sid: str, data: dict[str, Any]) -> None:
        span = self._speeches.get((sid, str(data["speech_id"])))
        if span is not None:
            span.add_event("interrupted", {"played_text_chars": len(str(data.get("played_text", "")))})

    def _speech_done(self, sid: str, data: dict[str, Any]) -> None:
        key = (sid, str(data["speech_id"]))
        self._end_step(key)
        span = self._speeches.pop(key, None)
        if span is not None:
            span.set_attribute("switchboard.interrupted", bool(data.get("interrupted")))
            span.end()

    def _end_step(self, key: tuple[str, str]) -> None:
        step = self._steps.pop(key, None)
        if step is not None:
            step.end()

    # -- tool calls -----------------------------------------------------------------------------------------------

    def _tool_started(self, sid: str, data: dict[str, Any]) -> None:
        call_id, speech_id = str(data["call_id"]), data.get("speech_id")
        parent = self._speeches.get((sid, str(speech_id))) if speech_id else None
        ctx = trace.set_span_in_context(parent) if parent is not None else None
        self._end_call((sid, call_id), None)  # run again after a restart: the first attempt's span ends here
        self._calls[(sid, call_id)] = self.tracer.start_span(
            f"tool {data.get('name')}",
            context=ctx,
            kind=SpanKind.INTERNAL,
            attributes={
                "switchboard.session_id": sid,
                "switchboard.call_id": call_id,
                "switchboard.tool": str(data.get("name")),
                "switchboard.cancellable": bool(data.get("cancellable")),
            },
        )

    def _tool_progress(self, sid: str, data: dict[str, Any]) -> None:
        span = self._calls.get((sid, str(data["call_id"])))
        if span is not None:
            attributes: dict[str, Any] = {"message": str(data.get("message", ""))}
            if data.get("progress") is not None:
                attributes["progress"] = float(data["progress"])
            span.add_event("progress", attributes)

    def _tool_ended(self, sid: str, data: dict[str, Any]) -> None:
        self._end_call((sid, str(data["call_id"])), data)

    def _end_call(self, key: tuple[str, str], data: dict[str, Any] | None) -> None:
        span = self._calls.pop(key, None)
        if span is None:
            return
        if data is not None:
            status = str(data.get("status"))
            span.set_attribute("switchboard.status", status)
            if data.get("is_error") or status == "failed":
                span.set_status(Status(StatusCode.ERROR, status))
        span.end()

    def _session_ended(self, sid: str, data: dict[str, Any]) -> None:
        """Whatever the session left open ends with it (spans are bounded by their session)."""
        for table in (self._steps, self._speeches, self._calls):
            for key in [k for k in table if k[0] == sid]:
                table.pop(key).end()


_HANDLERS: dict[str, Callable[[Tracing, str, dict[str, Any]], None]] = {
    "speech.created": Tracing._speech_created,
    "generation.started": Tracing._generation_started,
    "generation.failed": Tracing._generation_failed,
    "speech.interrupted": Tracing._speech_interrupted,
    "speech.done": Tracing._speech_done,
    "tool.started": Tracing._tool_started,
    "tool.progress": Tracing._tool_progress,
    "tool.ended": Tracing._tool_ended,
    "session.closed": Tracing._session_ended,
    "session.failed": Tracing._session_ended,
}


class TracingSink(EventSink):
    """An ``EventSink`` that makes spans from the events it passes on (in the emitter's context)."""

    def __init__(self, inner: EventSink, tracing: Tracing) -> None:
        self._inner = inner
        self._tracing = tracing

    def publish(self, event: Event) -> Awaitable[None]:
        self._tracing.observe(event)
        return self._inner.publish(event)


def extract(headers: dict[str, str]) -> otel_context.Context:
    """The caller's trace context from W3C ``traceparent``/``tracestate`` headers (an empty one when absent)."""
    return propagate.extract(headers)
