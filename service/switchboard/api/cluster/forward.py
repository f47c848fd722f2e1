"""Forwarding: in cluster mode a command for a session that another node runs is sent on to that node, and its answer
(status, body, the headers that matter) returned as it is, so any node serves every route.

The owner answers it exactly as if the client had called it: it authenticates the caller's credential itself and
applies the ``Idempotency-Key`` against the shared database, so the same key sent to two nodes is applied once. A
forwarded request carries ``X-Switchboard-Forwarded`` (the cluster secret): a node that receives one for a session it
does not own answers 503 (retry) instead of forwarding it again, so a request never loops between nodes.

The header is a privilege (a new session is placed where it arrives, a command is not forwarded again, an AG-UI run
asks for a part of one: ``streams.agui_relay``), so every node checks it (``ForwardedGuard``): a request that carries
it with anything but this cluster's secret (or, on a cluster without one, which runs on loopback only, the loopback
marker) is refused with 403 ``forward_unauthenticated``, as is any forwarded request to a node that is not in
cluster mode. A WebSocket (a media edge relayed by another node, ``relay``) is held to the same rule: accepted and
closed with 4403.
"""

from __future__ import annotations

import hmac
import logging
import re
import time
from collections.abc import Callable
from urllib.parse import quote, unquote

import httpx
from fastapi import Request, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from ..problems import problem_response

logger = logging.getLogger("switchboard.api.cluster.forward")

FORWARDED_HEADER = "x-switchboard-forwarded"
# what is passed on to the owner, and back from it
# Every header travels both ways (a route's own header, a report credential, cannot be forgotten), but those of the
# hop itself: the connection's, and what the client sending the forwarded request sets anew.
_HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "content-encoding",
        "accept-encoding",
        "date",
        "server",
        FORWARDED_HEADER,
    }
)
READ_TIMEOUT_S = 2.0  # a read the owner does not answer by then is answered from the database
LOOPBACK_SECRET = "loopback"  # the header's value when no secret is set (cluster mode on loopback only)
CLOSE_FORBIDDEN = 4403  # a WebSocket that claims to be relayed by another node without the secret


class SessionElsewhere(Exception):
    """The session is run by another node (``url``), or a new one is placed there: the request is forwarded there."""

    def __init__(self, session_id: str, node_id: str, url: str | None) -> None:
        super().__init__(f"session {session_id} is run by node {node_id}")
        self.session_id = session_id
        self.node_id = node_id
        self.url = url


def _moved(session_id: str, node_id: str, why: str) -> Response:
    return problem_response(
        503,
        "session_moved",
        f"Session {session_id!r} is run by node {node_id}; {why}; retry.",
        headers={"Retry-After": "1"},
    )


class BadTarget(ValueError):
    """A request's path or query that cannot be sent on to another node as it is."""


# what a request target sent on holds: visible ASCII, and a percent sign only as an escape
_SENDABLE = re.compile(r"(?:[!-$&-~]|%[0-9A-Fa-f]{2})*")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def owner_target(scope: Scope) -> str:
    """The path and query of ``scope`` as the client sent them (percent-escapes kept: ``a%2Fb`` stays one path
    segment on the owner), or ``BadTarget``: one that is no URL (a raw control or space, an invalid escape), or a
    path that decodes to a control (no session, speech or call id holds one; ``%00`` would be forwarded into an
    error)."""
    raw_path = scope.get("raw_path")
    path = bytes(raw_path).decode("latin-1") if raw_path is not None else quote(str(scope.get("path", "")))
    query = bytes(scope.get("query_string") or b"").decode("latin-1")
    if not (_SENDABLE.fullmatch(path) and _SENDABLE.fullmatch(query)) or _CONTROL.search(unquote(path)):
        raise BadTarget(f"{path}?{query}" if query else path)
    return f"{path}?{query}" if query else path


def bad_target() -> Response:
    return problem_response(400, "invalid_path", "The request's path or query holds a control or an invalid escape.")


def _outgoing(request: Request, node_url: str, secret: str | None) -> tuple[str, dict[str, str]]:
    """The URL and headers of ``request`` sent on to the node at ``node_url`` (``BadTarget``: it cannot be)."""
    headers = {name: value for name, value in request.headers.items() if name.lower() not in _HOP_HEADERS}
    headers[FORWARDED_HEADER] = forwarded_secret(secret)
    return node_url.rstrip("/") + owner_target(request.scope), headers


def _answer(answer: httpx.Response) -> Response:
    kept = {name: value for name, value in answer.headers.items() if name.lower() not in _HOP_HEADERS}
    return Response(answer.content, status_code=answer.status_code, headers=kept)


def _uncounted(outcome: str, seconds: float | None = None) -> None:
    return None


async def forward(
    request: Request,
    err: SessionElsewhere,
    client: httpx.AsyncClient,
    secret: str | None,
    *,
    count: Callable[[str, float | None], None] = _uncounted,
) -> Response:
    """Send ``request`` to the node ``err`` names (a new session placed there) and answer with its answer."""
    if err.url is None:
        count("not_live", None)
        return _moved(err.session_id, err.node_id, "that node is not live")
    if FORWARDED_HEADER in request.headers:
        count("loop", None)
        return _moved(err.session_id, err.node_id, "this node received it forwarded and does not forward again")
    return await forward_to(request, err.node_id, err.url, client, secret, count=count, session_id=err.session_id)


async def forward_to(
    request: Request,
    node_id: str,
    node_url: str,
    client: httpx.AsyncClient,
    secret: str | None,
    *,
    count: Callable[[str, float | None], None] = _uncounted,
    session_id: str | None = None,
) -> Response:
    """Send ``request`` to the node at ``node_url`` and answer with its answer (503 ``session_moved`` when it does
    not answer). ``count(outcome, seconds)`` records what happened (``Metrics.on_forward``)."""
    try:
        url, headers = _outgoing(request, node_url, secret)
    except BadTarget:
        return bad_target()
    body = await request.body()
    sent = time.perf_counter()
    try:
        answer = await client.request(request.method, url, content=body, headers=headers)
    except httpx.InvalidURL:  # what owner_target let through and httpx does not take: still the request's fault
        return bad_target()
    except httpx.HTTPError as exc:
        logger.warning("forwarding %s %s to node %s failed: %r", request.method, request.url.path, node_id, exc)
        count("unreachable", None)
        return _moved(session_id or "(new)", node_id, "that node did not answer")
    count("answered", time.perf_counter() - sent)
    return _answer(answer)


def _as_sent(scope: Scope) -> str:
    """The request's path and query as the client sent them (still percent-escaped), for a log line."""
    raw = bytes(scope.get("raw_path") or str(scope.get("path", "")).encode()).decode("latin-1")
    query = bytes(scope.get("query_string") or b"").decode("latin-1")
    return f"{raw}?{query}" if query else raw


def forwarded_secret(secret: str | None) -> str:
    """The header's value this node sends, and expects from the others."""
    return secret or LOOPBACK_SECRET


class ForwardedGuard:
    """Refuse a request that claims to be forwarded by another node without this cluster's secret (pure ASGI)."""

    def __init__(self, app: ASGIApp, *, cluster_mode: bool, secret: str | None) -> None:
        self.app = app
        self.expected = forwarded_secret(secret).encode() if cluster_mode else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            given = next((v for k, v in scope.get("headers") or () if k == FORWARDED_HEADER.encode()), None)
            if given is not None and (self.expected is None or not hmac.compare_digest(bytes(given), self.expected)):
                logger.warning(
                    "refused a forwarded %s %s from %s: wrong or missing cluster secret",
                    scope.get("method", "WebSocket"),
                    _as_sent(scope),  # percent-escapes kept: a decoded %0A would end the log line
                    (scope.get("client") or ("?",))[0],
                )
                await self._refuse(scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        why = "this node is not in cluster mode" if self.expected is None else "wrong cluster secret"
        if scope["type"] == "http":
            answer = problem_response(403, "forward_unauthenticated", f"Forwarded request refused: {why}.")
            await answer(scope, receive, send)
        elif (await receive())["type"] == "websocket.connect":  # a relayed media edge: accepted, closed like a refusal
            await send({"type": "websocket.accept"})
            await send({"type": "websocket.close", "code": CLOSE_FORBIDDEN, "reason": "forward_unauthenticated"})


async def read_from_owner(
    request: Request, node_id: str, url: str, client: httpx.AsyncClient, secret: str | None
) -> Response | None:
    """A read of a session another node runs, answered by that node (what only the live session knows: its agent
    state, the speech under way); None when it did not answer, and the caller answers from the database."""
    try:
        target, headers = _outgoing(request, url, secret)
        answer = await client.get(target, headers=headers, timeout=READ_TIMEOUT_S)
    except (BadTarget, httpx.InvalidURL):
        return bad_target()
    except httpx.HTTPError as exc:
        logger.warning("read of %s from node %s failed (%r); from the database", request.url.path, node_id, exc)
        return None
    if answer.status_code >= 500:
        return None
    return _answer(answer)
