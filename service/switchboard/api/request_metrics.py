"""Every HTTP request counted, timed and written to the access log by its route template; every WebSocket connection
accepted counted by its route.

Labels are bounded: the route is the template a request matched (``/v1/sessions/{sid}``, never the session id), a path
that matches no route is ``unmatched``, a method outside HTTP's own is ``other``.

The access log (logger ``switchboard.access``) is written here rather than by uvicorn, with the time to answer: a read
that succeeded (GET, HEAD or OPTIONS answered below 400, such as the console's polls) is logged at DEBUG; a write, an
error (4xx, 5xx) and a request slower than ``SLOW_REQUEST_S`` at INFO.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.routing import Mount, Route, Router, WebSocketRoute, compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from ..control.metrics import Metrics

access_log = logging.getLogger("switchboard.access")

SLOW_REQUEST_S = 1.0  # an answer that takes longer is logged at INFO, a read too
READS = frozenset({"GET", "HEAD", "OPTIONS"})
METHODS = READS | {"POST", "PUT", "PATCH", "DELETE"}
UNMATCHED = "unmatched"


def access_level(method: str, status: int, seconds: float) -> int:
    """DEBUG for a read that succeeded in time, INFO for anything else."""
    if method in READS and status < 400 and seconds < SLOW_REQUEST_S:
        return logging.DEBUG
    return logging.INFO


@dataclass(frozen=True)
class Template:
    template: str
    pattern: re.Pattern[str]
    kind: str  #: the ASGI scope type it answers: http or websocket
    methods: frozenset[str] | None  #: None: any


def templates(router: Router, prefix: str = "") -> Iterator[Template]:
    """Every route of ``router``, the routers included in it walked; a mounted app (the console) as one."""
    for route in router.routes:
        included = getattr(route, "original_router", None)  # a router included in another
        if isinstance(included, Router):
            context = getattr(route, "include_context", None)
            yield from templates(included, prefix + str(getattr(context, "prefix", "") or ""))
        elif isinstance(route, Mount):
            path = prefix + route.path
            yield Template(path + "/{path:path}", re.compile(re.escape(path) + "(/.*)?"), "http", None)
        elif isinstance(route, WebSocketRoute):
            path = prefix + route.path
            yield Template(path, compile_path(path)[0], "websocket", None)
        elif isinstance(route, Route):
            path = prefix + route.path
            yield Template(path, compile_path(path)[0], "http", frozenset(route.methods or ()) or None)


def route_template(table: list[Template], scope: Scope) -> str:
    """The template of the route ``scope`` goes to (one that has its path but another method, if none has both)."""
    path, kind, method = str(scope.get("path", "")), scope["type"], scope.get("method")
    other_method = None
    for route in table:
        if route.kind != kind or route.pattern.fullmatch(path) is None:
            continue
        if route.methods is None or method in route.methods:
            return route.template
        other_method = other_method or route.template
    return other_method or UNMATCHED


class RequestMetrics:
    """Pure ASGI (no body buffering): the status and the time are read from the response's start."""

    def __init__(self, app: ASGIApp, *, metrics: Metrics, router: Router) -> None:
        self.app = app
        self.metrics = metrics
        self.router = router
        self._table: list[Template] | None = None  # built on the first request, every route added by then

    def _route(self, scope: Scope) -> str:
        if self._table is None:
            self._table = list(templates(self.router))
        return route_template(self._table, scope)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await self.app(scope, receive, self._counting_accept(scope, send))
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = self._route(scope)
        start = time.perf_counter()
        answered: list[tuple[int, float]] = []  # the status and the time to the response's start

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                answered.append((int(message["status"]), time.perf_counter() - start))
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            # no response started: the request failed, or its client went away before the answer
            status, seconds = answered[0] if answered else (500, time.perf_counter() - start)
            self._record(scope, route, status, seconds)

    def _counting_accept(self, scope: Scope, send: Send) -> Send:
        route = self._route(scope)

        async def sending(message: Message) -> None:
            if message["type"] == "websocket.accept":
                self.metrics.websocket_accepted(route)
            await send(message)

        return sending

    def _record(self, scope: Scope, route: str, status: int, seconds: float) -> None:
        method = scope["method"] if scope["method"] in METHODS else "other"
        self.metrics.http_request(method, route, status, seconds)
        level = access_level(method, status, seconds)
        if access_log.isEnabledFor(level):
            client = scope.get("client")
            query = scope.get("query_string", b"").decode("latin-1")
            path = scope.get("path", "") + (f"?{query}" if query else "")
            address = f"{client[0]}:{client[1]}" if client else "-"
            version = scope.get("http_version", "1.1")
            line = '%s - "%s %s HTTP/%s" %d %.1f ms'
            access_log.log(level, line, address, scope["method"], path, version, status, seconds * 1000)
