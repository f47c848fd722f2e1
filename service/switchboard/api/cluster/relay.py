"""Cluster mode: a media edge connected to a node that does not run its session is relayed to the node that does.

Behind a load balancer an edge cannot choose its node, so the node it reached (having checked its credential) opens
the same ``WS /v1/sessions/{sid}/media`` on the owner, the way a forwarded command is sent on (``forward``): with the
edge's credential, which the owner checks again, and ``X-Switchboard-Forwarded`` carrying the cluster secret, which
the owner requires (``ForwardedGuard`` refuses a connection that claims to be forwarded without it) and which stops
it from relaying the connection any further. Two pumps then copy text frames, in order, each way; whichever side
closes, the other is closed with the same code and reason, so the owner's 4409, 4410, 4008 or 1000 reach the edge
as they are. An owner that cannot be reached, or goes away mid-stream (killed, partitioned: a failover), closes the
edge with 4410: connect again in a moment, to any node, and the session's new owner is found then.

Nothing is buffered without bound: the owner's frames wait in the client connection's queue (``RELAY_QUEUE_FRAMES``,
past which it stops reading and the owner's own outbox limit applies), and a send either way that stalls for
``SEND_TIMEOUT_S`` ends the relay (4008 to a slow edge, 4410 when the owner stopped reading).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import websockets
from fastapi import WebSocket
from websockets.asyncio.client import ClientConnection, connect
from websockets.frames import Close

from ...control.metrics import Metrics
from ...runtime.aio import cancel_and_wait
from ..media.codes import (
    CLOSE_BAD_REQUEST,
    CLOSE_INTERNAL_ERROR,
    CLOSE_MESSAGE_TOO_BIG,
    CLOSE_NORMAL,
    CLOSE_NOT_ACTIVE,
    CLOSE_SLOW_CONSUMER,
    CLOSE_UNSUPPORTED_DATA,
    SEND_TIMEOUT_S,
)
from ..streams.events import _close
from .forward import FORWARDED_HEADER, BadTarget, forwarded_secret, owner_target

logger = logging.getLogger("switchboard.api.media")

CONNECT_TIMEOUT_S = 3.0  # the owner's TCP connect and WebSocket handshake
RELAY_QUEUE_FRAMES = 64  # the owner's frames read ahead of the edge before the relay stops reading
RELAY_MAX_FRAME_BYTES = 1 << 20
PING_INTERVAL_S = 5.0  # an owner that stops answering (frozen, partitioned) is given up after twice this
CLOSE_TIMEOUT_S = 2.0
GOING_AWAY = 1001
_UNSENDABLE = frozenset({1004, 1005, 1006, 1015})  # reserved: never sent in a close frame

Ending = tuple[int, str]


@dataclass(frozen=True, slots=True)
class _End:
    """How a relay ends: the close for the edge, and for the owner (None: that side closed already)."""

    edge: Ending | None
    owner: Ending | None
    lost: bool = False  # the owner went away without a close (killed, frozen, partitioned)


def owner_media_url(node_url: str, ws: WebSocket) -> str:
    """The owner's media URL for the path and query (a session token) the edge connected with, as it sent them
    (``BadTarget``: they cannot be sent on)."""
    base = node_url.rstrip("/")
    base = "wss://" + base[len("https://") :] if base.startswith("https://") else base
    base = "ws://" + base[len("http://") :] if base.startswith("http://") else base
    return base + owner_target(ws.scope)


def _sendable(code: int | None) -> int:
    if code is None or code in _UNSENDABLE or not 1000 <= code <= 4999:
        return CLOSE_NORMAL
    return code


async def relay(
    ws: WebSocket,
    session_id: str,
    node_id: str,
    node_url: str,
    *,
    secret: str | None,
    max_frame_chars: int,
    metrics: Metrics,
) -> None:
    """Relay the accepted edge ``ws`` to the node that runs the session (``node_id`` at ``node_url``), until either
    side closes."""
    try:
        url = owner_media_url(node_url, ws)
    except BadTarget:
        await _close(ws, CLOSE_BAD_REQUEST, "invalid_path")
        return
    headers = {FORWARDED_HEADER: forwarded_secret(secret)}
    if (authorization := ws.headers.get("authorization")) is not None:
        headers["Authorization"] = authorization
    try:
        upstream = await connect(
            url,
            additional_headers=headers,
            user_agent_header=None,
            compression=None,  # node to node: latency over bytes
            proxy=None,
            open_timeout=CONNECT_TIMEOUT_S,
            ping_interval=PING_INTERVAL_S,
            ping_timeout=PING_INTERVAL_S,
            close_timeout=CLOSE_TIMEOUT_S,
            max_size=RELAY_MAX_FRAME_BYTES,
            max_queue=RELAY_QUEUE_FRAMES,
        )
    except (OSError, TimeoutError, websockets.InvalidHandshake) as exc:
        logger.warning("session %s: node %s did not take its media edge (%r)", session_id, node_id, exc)
        metrics.on_media_relay("unreachable")
        await _close(ws, CLOSE_NOT_ACTIVE, f"node {node_id} runs this session and did not answer; connect again")
        return
    metrics.on_media_relay("connected")
    metrics.media_relays_open.inc()
    end: _End | None = None
    try:
        end = await _Relay(ws, upstream, node_id, max_frame_chars).run()
    finally:
        metrics.media_relays_open.dec()
        if end is None:  # cancelled (this node stopping): the owner sees its edge leave at once
            upstream.transport.abort()
    if end.lost:
        logger.warning("session %s: node %s went away under its media edge", session_id, node_id)
        metrics.on_media_relay("lost")
    if end.edge is not None:
        await _close(ws, *end.edge)
    code, reason = end.owner or (CLOSE_NORMAL, "")
    with contextlib.suppress(Exception):  # bounded by the connection's close timeout; a no-op once it is closed
        await upstream.close(_sendable(code), _short(reason))


def _short(reason: str) -> str:
    """A close reason that fits a close frame (123 bytes of UTF-8)."""
    return reason.encode()[:120].decode("utf-8", "ignore")


class _Relay:
    def __init__(self, ws: WebSocket, upstream: ClientConnection, node_id: str, max_frame_chars: int) -> None:
        self.ws = ws
        self.upstream = upstream
        self.node_id = node_id
        self.max_frame_chars = max_frame_chars

    async def run(self) -> _End:
        tasks = [
            asyncio.create_task(self._to_owner(), name="media-relay-in"),
            asyncio.create_task(self._to_edge(), name="media-relay-out"),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_and_wait(*tasks)
        task = next(t for t in tasks if t in done)
        if (exc := task.exception()) is not None:
            logger.error("media relay to node %s failed", self.node_id, exc_info=exc)
            return _End((CLOSE_INTERNAL_ERROR, "internal error"), (GOING_AWAY, "the relay failed"))
        return task.result()

    def _owner_gone(self) -> _End:
        return _End((CLOSE_NOT_ACTIVE, f"node {self.node_id} went away; connect again"), None, lost=True)

    async def _to_owner(self) -> _End:
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return _End(None, (_sendable(message.get("code")), message.get("reason") or "the edge left"))
            text = message.get("text")
            if text is None:
                why = (CLOSE_UNSUPPORTED_DATA, "binary frames are not supported")
                return _End(why, why)
            if len(text) > self.max_frame_chars:
                why = (CLOSE_MESSAGE_TOO_BIG, f"a frame has at most {self.max_frame_chars} characters")
                return _End(why, why)
            try:
                async with asyncio.timeout(SEND_TIMEOUT_S):
                    await self.upstream.send(text)
            except websockets.ConnectionClosed:
                return await self._owner_closed()
            except TimeoutError:
                stalled = f"node {self.node_id} stopped reading; connect again"
                return _End((CLOSE_NOT_ACTIVE, stalled), (GOING_AWAY, "the relay gave up"), lost=True)

    async def _owner_closed(self) -> _End:
        """The owner's close (its frame as it was sent), or that it went away without one."""
        if self.upstream.protocol.close_rcvd is None:  # a send failed first: the connection may still be closing
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await self.upstream.wait_closed()
        rcvd: Close | None = self.upstream.protocol.close_rcvd
        if rcvd is None:
            return self._owner_gone()
        return _End((_sendable(rcvd.code), rcvd.reason), None)

    async def _to_edge(self) -> _End:
        while True:
            try:
                message = await self.upstream.recv()
            except websockets.ConnectionClosed:
                return await self._owner_closed()
            text = message if isinstance(message, str) else message.decode("utf-8", "replace")
            try:
                async with asyncio.timeout(SEND_TIMEOUT_S):
                    await self.ws.send_text(text)
            except TimeoutError:
                why = (CLOSE_SLOW_CONSUMER, "too slow: frames waited too long")
                return _End(why, why)
            except Exception:  # the edge left: its receive says how
                return _End(None, (GOING_AWAY, "the edge left"))
