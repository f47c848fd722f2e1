"""A TCP proxy of the test's own in front of the machine's PostgreSQL that resets connections, as a network or a
server restart does, without touching the real server.

``resetting``: every connection is reset (a TCP RST both ways) once, as it is used: an open one as soon as the client
sends it a request (a query, a statement, a ping), a new one in the middle of its start-up handshake (the server's
answer forwarded but for its closing ReadyForQuery), until ``resetting`` is off again. A pooled connection dies on its
next use, and so does each one opened to replace it. ``refusing``: a new connection is reset as it is accepted.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct

from sqlalchemy.engine import make_url

CHUNK = 64 * 1024


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0), as a peer that crashed or a middlebox that dropped the connection."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


# the server's ReadyForQuery message (type, length 5, transaction status): the end of the start-up handshake
_READY = b"Z\x00\x00\x00\x05"


def _is_request(data: bytes) -> bool:
    # after the handshake every frontend message starts with its type letter; the handshake's (SSLRequest,
    # StartupMessage) start with their length
    return data[:1].isalpha()


class ResettingProxy:
    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.port = 0
        self.resetting = False
        self.refusing = False
        self.accepted = 0
        self.resets = 0  # connections reset (refused ones included)
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    def before(cls, url: str) -> ResettingProxy:
        u = make_url(url)
        return cls(u.host or "127.0.0.1", u.port or 5432)

    def url_through(self, url: str) -> str:
        """``url`` with its host and port replaced by this proxy's."""
        return make_url(url).set(host="127.0.0.1", port=self.port).render_as_string(hide_password=False)

    async def start(self) -> ResettingProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._open):
            writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self.refusing:
            self.resets += 1
            _reset(client_w)
            return
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
        except OSError:
            _reset(client_w)
            return
        pair = (client_w, server_w)
        self._open |= set(pair)
        for task in (self._requests(client_r, server_w, pair), self._answers(server_r, client_w, pair)):
            started = asyncio.create_task(task)
            self._tasks.add(started)
            started.add_done_callback(self._tasks.discard)

    async def _requests(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, pair: tuple[asyncio.StreamWriter, ...]
    ) -> None:
        try:
            while data := await src.read(CHUNK):
                if self.resetting and _is_request(data):
                    self.resets += 1
                    for writer in pair:
                        _reset(writer)
                    return
                dst.write(data)
                await dst.drain()
        except OSError:
            pass
        finally:
            self._open.discard(dst)
            dst.close()

    async def _answers(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, pair: tuple[asyncio.StreamWriter, ...]
    ) -> None:
        handshake = True
        try:
            while data := await src.read(CHUNK):
                ready = data.find(_READY) if handshake else -1
                if ready >= 0 and self.resetting:
                    dst.write(data[:ready])  # the client has begun, and never hears that it may go on
                    await dst.drain()
                    self.resets += 1
                    for writer in pair:
                        _reset(writer)
                    return
                handshake = handshake and ready < 0
                dst.write(data)
                await dst.drain()
        except OSError:
            pass
        finally:
            self._open.discard(dst)
            dst.close()
