"""A server span per API command (every HTTP request but reads), continuing the caller's W3C trace context.

The span is current while the command runs, so what the command starts (a speech, and through it its generation
steps and tool calls: ``control.tracing``) becomes its child.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..control import tracing

READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class CommandSpans:
    def __init__(self, app: ASGIApp, *, tracer: trace.Tracer) -> None:
        self.app = app
        self.tracer = tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in READ_METHODS:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        parent = tracing.extract(headers)
        method = scope["method"]
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        with self.tracer.start_as_current_span(
            method,
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": str(scope["path"])},
        ) as span:
            try:
                await self.app(scope, receive, send_status)
            finally:
                route = scope.get("route")
                template = getattr(route, "path", None)
                if template:
                    span.update_name(f"{method} {template}")
                    span.set_attribute("http.route", template)
                sid = scope.get("path_params", {}).get("sid")
                if sid:
                    span.set_attribute("switchboard.session_id", str(sid))
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR))


def note_cancel(conn: HTTPConnection, session_id: str, call_id: str) -> None:
    """The command being served cancels the tool call: its span and the call's name each other (tracing on)."""
    traces: tracing.Tracing | None = getattr(conn.app.state, "tracing", None)
    if traces is not None:
        traces.cancel_requested(session_id, call_id)
