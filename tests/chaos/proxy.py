"""TCP forwarders of the chaos harness, on loopback.

``FaultProxy`` stands between the nodes and one backing service (PostgreSQL, Redis) and can hang every connection
(no byte moves either way until it is released), reset them all, or refuse new ones for a while. ``Balancer`` is the
non-sticky load balancer in front of the nodes: each new client connection (an HTTP request without keep-alive, a
WebSocket) goes to a random node that is up, and a failed connect is the client's failure: it never retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
from collections.abc import Callable

CHUNK = 64 * 1024


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a crashed peer or a middlebox would."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class _Forwarder:
    """Accepts on a free loopback port and splices each connection to the upstream ``_target()`` picks."""

    def __init__(self) -> None:
        self.port = 0
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._refusing = False

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        self.reset()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _target(self) -> tuple[str, int] | None:
        raise NotImplementedError

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._serve(reader, writer)
        finally:
            self._tasks.discard(task)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        target = None if self._refusing else self._target()
        if target is None:
            _abort(writer)
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(*target), 5
            )  # bound: the proxy gives up on a node that does not accept, as a client would
        except (OSError, TimeoutError):
            _abort(writer)  # the client sees its connection fail, as behind a real balancer without retries
            return
        self.connections += 1
        pair = (writer, up_writer)
        self._pairs.add(pair)
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        finally:
            self._pairs.discard(pair)
            for w in pair:
                with contextlib.suppress(Exception):
                    w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(CHUNK):
                await self._flowing.wait()  # a hang: bytes wait here, and TCP's back-pressure does the rest
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
        except (OSError, ConnectionError, asyncio.IncompleteReadError):
            _abort(writer)

    def stall(self) -> None:
        """Every connection hangs: nothing moves either way until ``release()``."""
        self._flowing.clear()

    def release(self) -> None:
        self._flowing.set()

    def reset(self) -> None:
        """Reset every open connection (both sides see a TCP reset)."""
        for client, upstream in list(self._pairs):
            _abort(client)
            _abort(upstream)
        self._pairs.clear()

    def refuse(self, on: bool) -> None:
        """While on, a new connection is reset as soon as it is accepted."""
        self._refusing = on


class FaultProxy(_Forwarder):
    """Between the nodes and one backing service at ``host:port``."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__()
        self.upstream = (host, port)

    def _target(self) -> tuple[str, int] | None:
        return self.upstream


class Balancer(_Forwarder):
    """A non-sticky balancer: ``ports()`` names the nodes that are up now; each connection picks one at random."""

    def __init__(self, ports: Callable[[], list[int]], rng: random.Random) -> None:
        super().__init__()
        self._ports = ports
        self._rng = rng

    def _target(self) -> tuple[str, int] | None:
        ports = self._ports()
        return ("127.0.0.1", self._rng.choice(ports)) if ports else None
