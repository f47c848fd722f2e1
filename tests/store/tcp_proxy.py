"""A TCP proxy of the test's own in front of the machine's PostgreSQL, that can stop forwarding: a database that hangs
(a stalled server, a network dropping everything) without stopping or touching the real one."""

from __future__ import annotations

import asyncio
import contextlib

from sqlalchemy.engine import make_url


class PausableProxy:
    """Forwards 127.0.0.1:<port> to the target. ``pause()``: nothing more goes either way (connections stay open, new
    ones are accepted and then hear nothing); ``resume()``: everything held back goes on, in order."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.port = 0
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @classmethod
    def before(cls, url: str) -> PausableProxy:
        u = make_url(url)
        return cls(u.host or "127.0.0.1", u.port or 5432)

    def url_through(self, url: str) -> str:
        """``url`` with its host and port replaced by this proxy's."""
        return make_url(url).set(host="127.0.0.1", port=self.port).render_as_string(hide_password=False)

    async def start(self) -> PausableProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    def pause(self) -> None:
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    async def aclose(self) -> None:
        self._flowing.set()
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            return
        self._writers |= {client_w, server_w}
        for src, dst in ((client_r, server_w), (server_r, client_w)):
            task = asyncio.create_task(self._pump(src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                await self._flowing.wait()
                dst.write(data)
                await dst.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            with contextlib.suppress(Exception):
                dst.close()
