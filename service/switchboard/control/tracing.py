"""OpenTelemetry traces: a span per API command, per speech (a child span per generation step, with the
``gen_ai.*`` attributes trace viewers read) and per tool call (progress as span events), the speech a child of the
command that caused it and the tool call a child of its speech.

Each turn is its own trace or part of the command that caused it, never of the request that created the session: work
that starts after its cause's span has ended (a deferred reply, a tool outliving its speech) starts a new trace with a
span link to the cause (a deferred reply links to the tool call whose result it answers). A cancelled tool call is not
an error (``switchboard.status`` and a ``cancelled`` event say so and why); the cancel command links to it.

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
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib.metadata import entry_points
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Status, StatusCode

from ..runtime.events import Event, EventSink
from ..runtime.llm import LLM, LLMRequest, ToolCallChunk, Usage
from ..runtime.llm.base import LLMChunk, WrappedLLM

logger = logging.getLogger("switchboard.tracing")

TRACER_NAME = "switchboard"
_OTLP_ENDPOINTS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
_OTLP_DEFAULT_ENDPOINTS = {"otlp_proto_http": "http://localhost:4318/v1/traces", "otlp_proto_grpc": "localhost:4317"}


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
        logger.info("tracing on: exporter %s to %s", name, _destination(name, env))
    return provider


def _destination(exporter: str, env: dict[str, str]) -> str:
    """Where ``exporter`` sends spans, as a log may show it: the endpoint without credentials, query or headers."""
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if not endpoint and env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        base = env["OTEL_EXPORTER_OTLP_ENDPOINT"]
        endpoint = base.rstrip("/") + "/v1/traces" if exporter == "otlp_proto_http" else base
    endpoint = endpoint or _OTLP_DEFAULT_ENDPOINTS.get(exporter)
    if endpoint is None:
        return "standard output" if exporter == "console" else "its default endpoint"
    parts = urlsplit(endpoint)
    if not parts.hostname:
        return endpoint.split("@")[-1]  # host:port, as the gRPC exporter takes it
    host = f"{parts.hostname}:{parts.port}" if parts.port else parts.hostname
    return f"{parts.scheme}://{host}{parts.path}"


class Tracing:
    """The service's spans, on ``provider``; one per process (built by the app)."""

    def __init__(self, provider: trace.TracerProvider) -> None:
        self.tracer = provider.get_tracer(TRACER_NAME)
        self._speeches: dict[tuple[str, str], Span] = {}
        self._steps: dict[tuple[str, str], Span] = {}
        self._calls: dict[tuple[str, str], Span] = {}
        # the latest ended tool call of each session: the result a deferred reply answers
        self._last_results: dict[str, SpanContext] = {}
        self._models: dict[str, dict[str, str]] = {}  # each session's model, as its generation spans name it

    def sink(self, inner: EventSink) -> EventSink:
        return TracingSink(inner, self)

    def call_headers(self, session_id: str, call_id: str) -> dict[str, str]:
        """W3C trace context headers (``traceparent``) naming the tool call's span, for its webhook deliveries."""
        span = self._calls.get((session_id, call_id))
        headers: dict[str, str] = {}
        if span is not None:
            propagate.inject(headers, context=trace.set_span_in_context(span))
        return headers

    def wrap_llm(self, session_id: str, llm: LLM, config: dict[str, Any] | None) -> LLM:
        """``llm`` with its model named on the session's ``generation`` spans, and its token usage and finish reasons
        reported on them (``config``: the provider configuration it was built from; never a URL or a key)."""
        config = config or {"provider": "stand-in"}  # nothing configured: the stand-in for a model
        if config.get("provider") == "fallback" and config.get("models"):
            config = config["models"][0]  # the model it tries first
        provider = str(config.get("provider", "scripted"))
        model = config.get("model")
        self._models[session_id] = {
            "gen_ai.provider.name": provider,
            "gen_ai.system": provider,  # the name before semantic conventions 1.37, which many viewers still read
            "gen_ai.request.model": model if isinstance(model, str) else provider,
        }
        return TracedLLM(llm, self, session_id)

    def cancel_requested(self, session_id: str, call_id: str) -> None:
        """The current span (a cancel command) asks to cancel the call: each span names the other."""
        call = self._calls.get((session_id, call_id))
        if call is None:
            return
        command = trace.get_current_span()
        command.add_link(call.get_span_context(), {"switchboard.link": "cancels"})
        ctx = command.get_span_context()
        attributes = {"trace_id": trace.format_trace_id(ctx.trace_id), "span_id": trace.format_span_id(ctx.span_id)}
        call.add_event("cancel requested", attributes if ctx.is_valid else {})

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
        cause = self._last_results.get(sid) if data.get("source") == "deferred_reply" else None
        context, links = _origin(cause)
        span = self.tracer.start_span(
            "speech",
            context=context,
            links=links,
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
        context, links = (trace.set_span_in_context(parent), []) if parent is not None else _origin(None)
        self._steps[key] = self.tracer.start_span(
            "generation",
            context=context,
            links=links,
            attributes={
                "gen_ai.operation.name": "chat",
                **self._models.get(sid, {}),
                "switchboard.step": int(data.get("step", 0)),
                "switchboard.preemptive": bool(data.get("preemptive")),
            },
        )

    def generation_reported(self, sid: str, speech_id: str | None, attributes: dict[str, Any]) -> None:
        """What a model said of a generation of ``speech_id`` (``TracedLLM``), on its current step's span."""
        step = self._steps.get((sid, speech_id)) if speech_id is not None else None
        if step is not None:
            step.set_attributes(attributes)

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
        context, links = (trace.set_span_in_context(parent), []) if parent is not None else _origin(None)
        self._end_call((sid, call_id), None)  # run again after a restart: the first attempt's span ends here
        self._calls[(sid, call_id)] = self.tracer.start_span(
            f"tool {data.get('name')}",
            context=context,
            links=links,
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
        span = self._calls.get((sid, str(data["call_id"])))
        if span is not None:
            self._last_results[sid] = span.get_span_context()
        self._end_call((sid, str(data["call_id"])), data)

    def _end_call(self, key: tuple[str, str], data: dict[str, Any] | None) -> None:
        span = self._calls.pop(key, None)
        if span is None:
            return
        if data is not None:
            status = str(data.get("status"))
            span.set_attribute("switchboard.status", status)
            if status == "failed":  # a cancelled, rejected or interrupted call did not fail: its status stays unset
                span.set_status(Status(StatusCode.ERROR, str(data.get("error") or status)))
            elif status == "cancelled":
                span.add_event("cancelled", {"reason": str(data.get("output", ""))})
        span.end()

    def _session_ended(self, sid: str, data: dict[str, Any]) -> None:
        """Whatever the session left open ends with it (spans are bounded by their session)."""
        for table in (self._steps, self._speeches, self._calls):
            for key in [k for k in table if k[0] == sid]:
                table.pop(key).end()
        self._last_results.pop(sid, None)
        self._models.pop(sid, None)


def _origin(cause: SpanContext | None) -> tuple[otel_context.Context | None, list[Link]]:
    """Where a span made now starts: under the current span while it is still open (the command that caused it),
    else in a new trace linked to its cause (``cause``, or the ended span it was started under)."""
    current = trace.get_current_span()
    if cause is None and current.is_recording():
        return None, []
    cause = cause or current.get_span_context()
    return otel_context.Context(), [Link(cause)] if cause.is_valid else []


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


class TracedLLM(WrappedLLM):
    """An ``LLM`` whose generations report their token usage and finish reasons on their ``generation`` spans."""

    def __init__(self, llm: LLM, tracing: Tracing, session_id: str) -> None:
        super().__init__(llm)
        self._tracing = tracing
        self._session_id = session_id

    def stream(self, request: LLMRequest) -> AsyncIterator[LLMChunk]:
        return self._stream(request, self.llm.stream(request))

    async def _stream(self, request: LLMRequest, stream: AsyncIterator[LLMChunk]) -> AsyncIterator[LLMChunk]:
        report: dict[str, Any] = {}
        finish = "stop"
        try:
            async for chunk in stream:
                if isinstance(chunk, Usage):
                    report["gen_ai.usage.input_tokens"] = chunk.prompt_tokens
                    report["gen_ai.usage.output_tokens"] = chunk.completion_tokens
                elif isinstance(chunk, ToolCallChunk):
                    finish = "tool_calls"
                yield chunk
            report["gen_ai.response.finish_reasons"] = [finish]  # known only for a generation that ran to its end
        finally:
            # on the step's span when it has one (a speculative generation that ended before it was used has none)
            self._tracing.generation_reported(self._session_id, request.speech_id, report)
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()


def extract(headers: dict[str, str]) -> otel_context.Context:
    """The caller's trace context from W3C ``traceparent``/``tracestate`` headers (an empty one when absent)."""
    return propagate.extract(headers)
