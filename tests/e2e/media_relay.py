"""A WebSocket relay of the test's own between a media edge and the real server's media endpoint, that can lose a
connection at the worst moment: after the server took a final transcript and before its ``transcript.taken`` reached
the edge (a node dying, a load balancer resetting the connection). It records every connection's URL and the frames
that crossed it each way, for the test to read."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.client import connect
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from tests.waiting import WAIT_S


@dataclass
class RelayedConnection:
    path: str  #: with its query
    up: list[dict[str, Any]] = field(default_factory=list)  #: the edge's frames, in order
    down: list[dict[str, Any]] = field(default_factory=list)  #: the server's frames that reached the edge
    withheld: list[dict[str, Any]] = field(default_factory=list)  #: the server's frames the edge never got


class MediaRelay:
    """Listens on a loopback port (``url``) and relays each connection to ``upstream`` (a ``ws://`` base URL) with
    the edge's Authorization header. ``lose_next_taken()``: the next ``transcript.taken`` is withheld and the edge's
    connection aborted (no close frame); ``drop()``: the edge's current connection is aborted now."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.connections: list[RelayedConnection] = []
        self._lose_taken = False
        self._current: ServerConnection | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="media-relay", daemon=True)
        self._server: Server | None = None
        self.url = ""

    def start(self) -> MediaRelay:
        self._thread.start()
        self._server = self._call(self._listen())
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._call(self._server.wait_closed())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(WAIT_S)

    async def _listen(self) -> Server:
        return await serve(self._relay, "127.0.0.1", 0)

    def lose_next_taken(self) -> None:
        self._loop.call_soon_threadsafe(setattr, self, "_lose_taken", True)

    def drop(self) -> None:
        self._loop.call_soon_threadsafe(self._abort)

    def _call(self, work: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(work, self._loop).result(10)

    def _abort(self) -> None:
        if self._current is not None:
            self._current.transport.abort()

    async def _relay(self, edge: ServerConnection) -> None:
        assert edge.request is not None
        record = RelayedConnection(edge.request.path)
        self.connections.append(record)
        self._current = edge
        auth = edge.request.headers.get("Authorization")
        headers = {"Authorization": auth} if auth else {}
        async with connect(self.upstream + edge.request.path, additional_headers=headers) as server:
            pumps = [
                asyncio.create_task(self._up(edge, server, record)),
                asyncio.create_task(self._down(edge, server, record)),
            ]
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            if server.close_code is not None and edge.close_code is None:
                await edge.close(server.close_code, server.close_reason or "")

    async def _up(self, edge: ServerConnection, server: Any, record: RelayedConnection) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for raw in edge:
                record.up.append(json.loads(raw))
                await server.send(raw)

    async def _down(self, edge: ServerConnection, server: Any, record: RelayedConnection) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for raw in server:
                frame = json.loads(raw)
                if frame.get("type") == "transcript.taken" and self._lose_taken:
                    self._lose_taken = False
                    record.withheld.append(frame)
                    edge.transport.abort()
                    return
                record.down.append(frame)
                await edge.send(raw)
