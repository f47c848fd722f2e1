"""The routing seam: in cluster mode every request about one session (``/v1/sessions/{sid}/...``, HTTP and WebSocket)
reaches the node that runs the session through here, before any route runs, so that no route can forget it.

Each route has a placement (``PLACEMENTS``; any route not listed needs the live session):

- ``OWNER``: commands, webhook reports, the media edge, and anything a new route adds: run where the session runs.
  Another node's session is forwarded there (``forward.forward_to``), or relayed for a WebSocket
  (``relay``); one that is moving answers 503 with ``Retry-After`` (4410 for a WebSocket).
- ``OWNER_READ``: what only the live session knows (its agent state, the speech under way): asked of the node that runs
  it, answered here from the database when that node does not answer in time or the session is moving.
- ``ANYWHERE``: served from the database or the cluster's event fan-out by whichever node the request reached (the
  chat, tool calls, exports, event streams, token minting). An AG-UI run too: it streams the session's log from here
  and asks the owner, node to node, to apply its input (``streams.agui_relay``).

Before forwarding, the caller's credential is checked here (401 / 4401 without a valid one: nobody without a credential
makes a node read the database or call another node), and a command or a read is charged to its rate limit where
it arrives (a forwarded request is not charged again, its header being trusted only with the cluster secret). The
owner checks the credential's scopes and applies the ``Idempotency-Key`` against the shared database. A request that
arrives forwarded is never forwarded again: the route answers it (503 ``session_moved`` if this node is no longer the
owner).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, Router, WebSocketRoute, compile_path
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from ...control.cluster.routing import Elsewhere, Location, Retry, Unavailable, locate
from ...control.host import SessionHost
from ...store import DATABASE_ERRORS, is_transient
from ..auth import (
    AuthError,
    Principal,
    Require,
    authenticate,
    bearer,
    charge,
    check,
    refuse_session_token,
    url_token,
)
from ..deps import services
from ..media.codes import CLOSE_FORBIDDEN, CLOSE_NOT_ACTIVE, CLOSE_UNAUTHENTICATED
from ..media.routes import max_frame_chars
from ..problems import UNAVAILABLE_CLOSE, UNAVAILABLE_RETRY_AFTER_S, problem_response
from ..streams.events import _close
from .forward import FORWARDED_HEADER, forward_to, read_from_owner
from .relay import relay

logger = logging.getLogger("switchboard.api.cluster.routing")

SESSION_PREFIX = "/v1/sessions/"
SESSION_ROUTE = "/v1/sessions/{sid}"


class Placement(StrEnum):
    OWNER = "owner"
    OWNER_READ = "owner_read"
    ANYWHERE = "anywhere"


WS = "WEBSOCKET"

#: (method, route path) -> where it is served; every other route under /v1/sessions/{sid} is ``OWNER``
# the scope a WebSocket route needs (its handler checks it itself, not as a dependency)
WS_SCOPES = {"/v1/sessions/{sid}/media": "media:connect", "/v1/sessions/{sid}/events": "events:read"}

PLACEMENTS: dict[tuple[str, str], Placement] = {
    ("GET", "/v1/sessions/{sid}"): Placement.OWNER_READ,
    ("GET", "/v1/sessions/{sid}/speeches/{speech_id}"): Placement.OWNER_READ,
    ("GET", "/v1/sessions/{sid}/chat"): Placement.ANYWHERE,
    ("GET", "/v1/sessions/{sid}/tool-calls"): Placement.ANYWHERE,
    ("GET", "/v1/sessions/{sid}/tool-calls/{call_id}"): Placement.ANYWHERE,
    ("GET", "/v1/sessions/{sid}/export"): Placement.ANYWHERE,
    ("GET", "/v1/sessions/{sid}/scheduled"): Placement.ANYWHERE,
    ("GET", "/v1/sessions/{sid}/scheduled/{scheduled_id}"): Placement.ANYWHERE,
    ("GET", "/v1/sessions/{sid}/ag-ui"): Placement.ANYWHERE,
    ("POST", "/v1/sessions/{sid}/ag-ui"): Placement.ANYWHERE,
    ("POST", "/v1/sessions/{sid}/tokens"): Placement.ANYWHERE,
    (WS, "/v1/sessions/{sid}/events"): Placement.ANYWHERE,
}


def placement_of(method: str, path: str) -> Placement:
    """The placement of the route ``path`` (its template) for ``method`` (``WEBSOCKET`` for a WebSocket)."""
    return PLACEMENTS.get((method, path), Placement.OWNER)


@dataclass(frozen=True, slots=True)
class SessionRoute:
    """A route about one session: its path template, its methods (``WEBSOCKET`` for a WebSocket), the pattern its
    paths match, and the credential it needs (checked here too before a request is sent on: a caller without it
    makes no node call another)."""

    template: str
    methods: frozenset[str]
    pattern: re.Pattern[str]
    needs: Require | None


def session_routes(router: Router) -> list[SessionRoute]:
    """Every route about one session (its path starts with ``/v1/sessions/{sid}``), the routers included in
    ``router`` walked."""
    found: list[SessionRoute] = []
    for template, methods, needs in _walk(router, ""):
        if template == SESSION_ROUTE or template.startswith(SESSION_ROUTE + "/"):
            found.append(SessionRoute(template, methods, compile_path(template)[0], needs))
    return found


def _walk(router: Router, prefix: str) -> Iterator[tuple[str, frozenset[str], Require | None]]:
    for route in router.routes:
        included = getattr(route, "original_router", None)  # a router included in another
        if isinstance(included, Router):
            context = getattr(route, "include_context", None)
            yield from _walk(included, prefix + str(getattr(context, "prefix", "") or ""))
        elif isinstance(route, WebSocketRoute):
            path = prefix + route.path
            scope = WS_SCOPES.get(path)
            yield path, frozenset({WS}), Require(scope) if scope else None
        elif isinstance(route, Route):
            needs = [d.dependency for d in getattr(route, "dependencies", ()) if isinstance(d.dependency, Require)]
            yield prefix + route.path, frozenset(route.methods or ()), needs[0] if needs else None


def _allowed(principal: Principal, needs: Require | None, sid: str) -> bool:
    """``principal`` may make this request of session ``sid`` (its route checks the same, and answers why not)."""
    try:
        if needs is not None:
            check(principal, needs.scope, sid)
            if needs.keys_only:
                refuse_session_token(principal)
        elif principal.session_id is not None and principal.session_id != sid:
            return False
    except AuthError:
        return False
    return True


class OwnerRouting:
    """Pure ASGI middleware: sends each session-scoped request to the node that runs its session (cluster mode)."""

    def __init__(self, app: ASGIApp, *, router: Router, enabled: bool) -> None:
        self.app = app
        self.router = router
        self.enabled = enabled
        self._table: list[SessionRoute] | None = None  # built on the first request

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        routed = self.enabled and scope["type"] in ("http", "websocket")
        if not routed or not str(scope.get("path", "")).startswith(SESSION_PREFIX):
            await self.app(scope, receive, send)
            return
        found = self._route(scope)
        if found is None or any(k == FORWARDED_HEADER.encode() for k, _ in scope.get("headers") or ()):
            await self.app(scope, receive, send)  # unknown path (a 404 follows), or forwarded here already
            return
        placement, sid, needs = found
        if placement == Placement.ANYWHERE:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send, sid, needs)
        else:
            await self._http(scope, receive, send, sid, placement, needs)

    def _route(self, scope: Scope) -> tuple[Placement, str, Require | None] | None:
        """The placement of the route ``scope`` reaches, its session id and what credential it needs (None: no
        session route matches it)."""
        if self._table is None:
            self._table = session_routes(self.router)
        method = WS if scope["type"] == "websocket" else str(scope.get("method", "GET"))
        path = str(scope.get("path", ""))
        for route in self._table:
            found = route.pattern.fullmatch(path)
            if found is not None and method in route.methods:
                return placement_of(method, route.template), found.group("sid"), route.needs
        return None

    async def _http(
        self, scope: Scope, receive: Receive, send: Send, sid: str, placement: Placement, needs: Require | None
    ) -> None:
        request = Request(scope, receive)
        found = services(request)
        try:
            principal = authenticate(found.settings, bearer(None, request.headers.get("authorization")))
        except AuthError:
            principal = None
        if principal is None or not _allowed(principal, needs, sid):
            await self.app(scope, receive, send)  # the route refuses it, the way it refuses any bad credential
            return
        where = await _locate(found.host, sid)
        if where is None:
            await unavailable()(scope, receive, send)
            return
        if isinstance(where, Unavailable):
            if placement == Placement.OWNER_READ:  # what the database knows, answered here
                await self.app(scope, receive, send)
                return
            moving = problem_response(503, where.retry.value, where.detail, headers={"Retry-After": "1"})
            await moving(scope, receive, send)
            return
        if not isinstance(where, Elsewhere):
            await self.app(scope, receive, send)
            return
        limited = await _charge(request, principal)
        if limited is not None:
            await limited(scope, receive, send)
            return
        if placement == Placement.OWNER_READ:
            settings = found.settings
            owner_answer = await read_from_owner(
                request, where.node_id, where.url, found.forwarder, settings.cluster_secret
            )
            if owner_answer is None:
                await self.app(scope, receive, send)  # the owner did not answer: from the database
            else:
                await owner_answer(scope, receive, send)
            return
        answer = await forward_to(
            request,
            where.node_id,
            where.url,
            found.forwarder,
            found.settings.cluster_secret,
            count=found.metrics.on_forward,
            session_id=sid,
        )
        await answer(scope, receive, send)

    async def _websocket(self, scope: Scope, receive: Receive, send: Send, sid: str, needs: Require | None) -> None:
        ws = WebSocket(scope, receive, send)
        found = services(ws)
        try:
            credential = url_token(ws.query_params.getlist("token")) or bearer(None, ws.headers.get("authorization"))
            principal = authenticate(found.settings, credential)
        except AuthError as err:
            await ws.accept()
            await _close(ws, CLOSE_UNAUTHENTICATED if err.status == 401 else CLOSE_FORBIDDEN, err.code)
            return
        if not _allowed(principal, needs, sid):  # refused here, as its route refuses it: nothing is sent on
            await ws.accept()
            await _close(ws, CLOSE_FORBIDDEN, "forbidden")
            return
        where = await _locate(found.host, sid)
        if where is None:
            await ws.accept()
            await _close(ws, UNAVAILABLE_CLOSE, "the database is unavailable; connect again")
            return
        if isinstance(where, Unavailable):
            if where.retry == Retry.MOVED:
                found.metrics.on_media_relay("not_live")
            await ws.accept()
            await _close(ws, CLOSE_NOT_ACTIVE, f"{where.retry.value}: connect again in a moment")
            return
        if not isinstance(where, Elsewhere):
            await self.app(scope, receive, send)
            return
        settings = found.settings
        await ws.accept()
        await relay(
            ws,
            sid,
            where.node_id,
            where.url,
            secret=settings.cluster_secret,
            max_frame_chars=max_frame_chars(settings.max_text_chars),
            metrics=found.metrics,
        )


async def _locate(host: SessionHost, sid: str) -> Location | None:
    """Where ``sid`` runs; None while the database cannot say (it is unavailable: the caller answers 503). Here,
    outside the routes, a database error would otherwise reach the client as a 500."""
    try:
        return await locate(host, sid)
    except DATABASE_ERRORS as err:
        if not is_transient(err):
            raise
        logger.warning("session %s: cannot find where it runs (%r); the database is unavailable", sid, err)
        return None


def unavailable() -> Response:
    return problem_response(
        503,
        "database_unavailable",
        "The database is unreachable; retry.",
        headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)},
    )


async def _charge(request: Request, principal: Principal) -> Response | None:
    """A request sent to another node is charged to its credential here, where it arrives (and not again if this
    node answers it after all); the answer when its limit is reached, else None."""
    limited = await charge(request, principal)
    if limited is None:
        return None
    return problem_response(limited.status, limited.code, limited.detail, headers=limited.headers)


__all__ = ["PLACEMENTS", "OwnerRouting", "Placement", "placement_of"]
