"""WebSocket connections in the simulated cluster, and the media edge's route as the nodes run it.

A ``Link`` is one WebSocket connection: a client (a media edge, or a node relaying one) and the node that serves it.
The serving side is the product's: the routing seam's WebSocket path (``api.cluster.routing.OwnerRouting``: where
the session runs, by the real ``locate``; 4410 while it moves) in front of the media route itself
(``api.media.routes``: ``MediaEdge`` attached to the session's ``EdgePlayout``, its pumps, its watch, its closes), on
a Starlette ``WebSocket`` whose ASGI ``receive`` and ``send`` are the link's. Only the relay to the owner
(``api.cluster.relay``, a ``websockets`` client over TCP) is modelled: ``relay`` below opens a link from this node to
the owner and copies frames both ways, closing the edge as the real one does.

Frames reach the other side's buffer a millisecond later, in order, and are handled when that side's process runs (a
paused node's tasks are held); a connection the network drops loses what was on its way. A process that dies closes
its sockets: the other side sees the connection drop (1006) after what was already on its way. A paused one answers
nothing, and only a keepalive ping tells (``ping``: answered when the peer's process runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
from collections import deque
from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from starlette.types import Message, Receive, Scope, Send
from starlette.websockets import WebSocket

from switchboard.api.cluster.forward import FORWARDED_HEADER
from switchboard.api.cluster.routing import OwnerRouting
from switchboard.api.deps import Services
from switchboard.api.media import routes as media_routes
from switchboard.api.media.budget import TranscriptBudget
from switchboard.api.media.codes import CLOSE_NORMAL, CLOSE_NOT_ACTIVE
from switchboard.api.problems import UNAVAILABLE_CLOSE, UNEXPECTED_CLOSE
from switchboard.api.rate_limit import RateLimiter
from switchboard.api.streams.events import _close
from switchboard.control.metrics import Metrics
from switchboard.runtime.aio import cancel_and_wait
from switchboard.store import is_transient

from .loop import run_in_node

if TYPE_CHECKING:
    from .node import Node
    from .world import ClusterWorld

ABNORMAL = 1006  # the connection dropped without a close frame (the peer's process died)
CONNECT_TIMEOUT_S = 3.0  # the relay's connect to the owner (``api.cluster.relay``)
RELAY_PING_S = 5.0  # the relay's keepalive to the owner: an owner silent for twice this is gone
MEDIA_PATH = "/v1/sessions/{sid}/media"
LATENCY_S = 0.001  # one hop of the network, each way
_NETWORK = contextvars.Context()  # deliveries run in no node's context: the network does not pause with a node

_metrics: list[Metrics] = []


def metrics() -> Metrics:
    """One registry for every node of every run (what the routes count is not looked at)."""
    if not _metrics:
        _metrics.append(Metrics())
    return _metrics[0]


def app(node: Node) -> Any:
    """What the routes find as ``app`` on ``node``: its state (``services``, and what a route keeps there)."""
    return SimpleNamespace(state=SimpleNamespace(services=services(node)))


def services(node: Node) -> Services:
    """What the routes find as ``app.state.services`` on ``node``."""
    return Services(
        settings=node.settings,
        store=node.store,  # type: ignore[arg-type]
        hub=node.host.hub,
        host=node.host,
        webhooks=node.webhooks,
        metrics=metrics(),
        streams=None,  # type: ignore[arg-type]
        writes=None,  # type: ignore[arg-type]
        reads=None,  # type: ignore[arg-type]
        exports=None,  # type: ignore[arg-type]
        transcripts=TranscriptBudget(RateLimiter(rate_per_s=0, burst=1)),  # budgets are not simulated
        forwarder=None,  # type: ignore[arg-type]
    )


class _Pipe:
    """One direction of a connection: what is sent arrives ``LATENCY_S`` later, in order, in the receiver's buffer
    (read when its process runs); a dropped connection loses what is still on its way."""

    def __init__(self, buffer: asyncio.Queue[Any]) -> None:
        self.buffer = buffer
        self.flight: deque[Any] = deque()

    def put(self, item: Any) -> None:
        self.flight.append(item)
        asyncio.get_running_loop().call_later(LATENCY_S, self._arrive, context=_NETWORK)

    def _arrive(self) -> None:
        if self.flight:
            self.buffer.put_nowait(self.flight.popleft())

    def cut(self) -> None:
        self.flight.clear()


class Link:
    """One WebSocket connection from ``client`` (a node's tag, or None for an edge) to ``server``."""

    def __init__(
        self, world: ClusterWorld, client: str | None, server: Node, sid: str, *, forwarded: bool, query: str = ""
    ) -> None:
        self.world = world
        self.client = client
        self.server = server
        self.sid = sid
        self.forwarded = forwarded
        self.query = query  # the URL's query string (a relay passes the edge's on)
        loop = asyncio.get_running_loop()
        self.accepted: asyncio.Future[None] = loop.create_future()
        self._to_server: asyncio.Queue[Message] = asyncio.Queue()
        self._to_client: asyncio.Queue[tuple[int | None, str]] = asyncio.Queue()  # (None, text) or (code, reason)
        self._up = _Pipe(self._to_server)
        self._down = _Pipe(self._to_client)
        self._connected = False
        self.client_gone = False
        self.server_closed: tuple[int, str] | None = None
        self.route_runs = False  # the media route serves it (not the relay): frames read are the session's
        self.on_read: Callable[[Link, str], None] | None = None

    @property
    def up(self) -> bool:
        return not self.client_gone and self.server_closed is None

    # -- the server's side (ASGI) -------------------------------------------------------------------------------

    async def receive(self) -> Message:
        if not self._connected:
            self._connected = True
            return {"type": "websocket.connect"}
        message = await self._to_server.get()
        if self.route_runs and message.get("text") is not None and self.on_read is not None:
            self.on_read(self, message["text"])
        return message

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "websocket.accept":
            if not self.accepted.done():
                self.accepted.set_result(None)
            return
        if self.client_gone or self.server_closed is not None:
            raise OSError("the connection is closed")  # Starlette makes it a disconnect (1006)
        if kind == "websocket.send":
            self._down.put((None, message["text"]))
        elif kind == "websocket.close":
            self._closed_by_server(message.get("code") or CLOSE_NORMAL, message.get("reason") or "")

    def _closed_by_server(self, code: int, reason: str) -> None:
        if self.server_closed is None and not self.client_gone:
            self.server_closed = (code, reason)
            self._down.put((code, reason))

    # -- the client's side --------------------------------------------------------------------------------------

    async def opened(self, timeout_s: float) -> bool:
        """The server accepted the connection within ``timeout_s`` (else the client gives up on it)."""
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(self.accepted)
        except TimeoutError:
            self.close(ABNORMAL)
            return False
        return self.up

    def send_text(self, text: str) -> None:
        if self.up:
            self._up.put({"type": "websocket.receive", "text": text})

    async def recv(self) -> tuple[int | None, str]:
        """The next frame, ``(None, text)``, or the close, ``(code, reason)``."""
        return await self._to_client.get()

    def close(self, code: int = CLOSE_NORMAL) -> None:
        """The client leaves (its side of the socket is closed)."""
        if not self.client_gone:
            self.client_gone = True
            self._up.put({"type": "websocket.disconnect", "code": code})

    async def ping(self, timeout_s: float) -> bool:
        """A keepalive ping: answered once the server's process runs (never by a dead one)."""
        if not self.up:
            return False
        pong: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        run_in_node(self.server.tag, asyncio.get_running_loop().call_soon, _answer, pong)
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(pong)
        except TimeoutError:
            return False
        finally:
            if not pong.done():
                pong.cancel()
        return True

    def drop(self) -> None:
        """The network between the two drops the connection: what was on its way is lost, and each side sees the
        connection gone (1006)."""
        if self.up:
            self._up.cut()
            self._down.cut()
            self.server_closed = (ABNORMAL, "")
            self._to_client.put_nowait((ABNORMAL, ""))
            self.client_gone = True
            self._to_server.put_nowait({"type": "websocket.disconnect", "code": ABNORMAL})

    # -- a process dies -----------------------------------------------------------------------------------------

    def process_died(self, tag: str) -> None:
        """The process ``tag`` died: its sockets are closed by the system, and the other side sees the drop after
        what was already on its way to it."""
        if tag == self.server.tag:
            if self.server_closed is None and not self.client_gone:
                self.server_closed = (ABNORMAL, "")
                self._down.put((ABNORMAL, ""))
        elif tag == self.client and not self.client_gone:
            self.client_gone = True
            self._up.put({"type": "websocket.disconnect", "code": ABNORMAL})


def _answer(pong: asyncio.Future[None]) -> None:
    if not pong.done():
        pong.set_result(None)


def open_link(
    world: ClusterWorld, client: str | None, node: Node | None, sid: str, *, forwarded: bool, query: str = ""
) -> Link | None:
    """Connect to ``node``'s media route for ``sid`` (None: refused, the node is not serving)."""
    if node is None or node.gone or not node.up:
        return None
    link = Link(world, client, node, sid, forwarded=forwarded, query=query)
    link.on_read = world.media.read
    world.media.links.append(link)
    node.spawn(_serve(node, link), "media")
    return link


async def _serve(node: Node, link: Link) -> None:
    """The node's HTTP server with one WebSocket: the routing seam, then the route (uvicorn closes 1011 when the
    application raises, and 1000 when it returns with the connection open)."""
    path = MEDIA_PATH.format(sid=link.sid)
    headers = [(FORWARDED_HEADER.lower().encode(), b"loopback")] if link.forwarded else []
    scope: Scope = {
        "type": "websocket",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": link.query.encode(),
        "headers": headers,
        "scheme": "ws",
        "client": ("10.0.0.1", 40000),
        "server": (f"{node.id}.sim", 8000),
        "subprotocols": [],
        "app": node.app,
        "sim.link": link,
    }
    seam = OwnerRouting(_route, router=media_routes.router, enabled=True)
    try:
        await seam(scope, link.receive, link.send)
    except Exception as err:  # as the app's handlers close it: the database away (retry later), or a failure
        node.world.note(f"{node.tag}: the media route raised {err!r}")
        link._closed_by_server(UNAVAILABLE_CLOSE if is_transient(err) else UNEXPECTED_CLOSE, "")
        return
    link._closed_by_server(CLOSE_NORMAL, "")


async def _route(scope: Scope, receive: Receive, send: Send) -> None:
    """The app behind the seam: the media route, for a session live here (or a connection relayed here)."""
    scope["sim.link"].route_runs = True
    await media_routes.router(scope, receive, send)


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
    """``api.cluster.relay.relay`` on the simulated network: connect to the owner (4410 when it does not answer),
    then copy text frames both ways until either side closes; the owner's close reaches the edge as it was sent, an
    owner that went away (dropped, or silent past its keepalive) closes the edge with 4410."""
    here: Link = ws.scope["sim.link"]
    world = here.world
    upstream = open_link(world, here.server.tag, world.slots.get(node_id), session_id, forwarded=True, query=here.query)
    if upstream is None or not await upstream.opened(CONNECT_TIMEOUT_S):
        metrics.on_media_relay("unreachable")
        await _close(ws, CLOSE_NOT_ACTIVE, f"node {node_id} runs this session and did not answer; connect again")
        return
    metrics.on_media_relay("connected")
    gone = (CLOSE_NOT_ACTIVE, f"node {node_id} went away; connect again")

    async def to_owner() -> tuple[int, str] | None:
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                upstream.close(message.get("code") or CLOSE_NORMAL)
                return None
            upstream.send_text(message["text"])

    async def to_edge() -> tuple[int, str] | None:
        while True:
            code, text = await upstream.recv()
            if code is not None:
                return gone if code == ABNORMAL else (code, text)
            try:
                await ws.send_text(text)
            except Exception:  # the edge left: its receive says how
                upstream.close(1001)
                return None

    async def keepalive() -> tuple[int, str] | None:
        while True:
            await asyncio.sleep(RELAY_PING_S)
            if not await upstream.ping(RELAY_PING_S):
                upstream.close(1001)
                return gone

    tasks = [asyncio.ensure_future(to_owner()), asyncio.ensure_future(to_edge()), asyncio.ensure_future(keepalive())]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_and_wait(*tasks)
    end = next(t for t in tasks if t in done).result()
    if end is not None:
        await _close(ws, *end)
    upstream.close()


def frame(kind: str, **fields: Any) -> str:
    return json.dumps({"type": kind, **fields})


@contextlib.contextmanager
def relayed_in_simulation() -> Any:
    """The routing seam relays through ``relay`` above (the network is the simulation's)."""
    from switchboard.api.cluster import routing

    real = routing.relay
    routing.relay = relay  # type: ignore[assignment]
    try:
        yield
    finally:
        routing.relay = real
