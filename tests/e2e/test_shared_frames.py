"""Shared event frames (``api/streams/ws_protocol``): a message sent to many WebSockets is framed and compressed once
per encoding, and every client (compressing or not) reads it; a connection that cannot take it at once says so, and
the frame goes the usual way.

The server is a real uvicorn with the protocol ``switchboard serve`` uses, in this process (the encode counter is
read), serving a minimal app whose endpoint sends through ``shared_sender``.
"""

from __future__ import annotations

import asyncio
import contextlib
import zlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn
import websockets
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket
from websockets.extensions.permessage_deflate import PerMessageDeflate
from websockets.frames import Frame, Opcode

from switchboard.api.streams.ws_protocol import (
    FRAMES,
    SHARED_FRAMES,
    EventStreamProtocol,
    SharedFrames,
    encoding_key,
    shared_sender,
    text_sender,
)
from tests.waiting import WAIT_S

from .server import free_port

pytestmark = pytest.mark.e2e


def deflate(*, no_context_takeover: bool) -> PerMessageDeflate:
    return PerMessageDeflate(False, no_context_takeover, 12, 12, {"memLevel": 5})


def test_encoding_key_is_shared_only_without_context_takeover():
    assert encoding_key([]) == "plain"
    assert encoding_key([deflate(no_context_takeover=True)]) == ("deflate", 12, (("memLevel", 5),))
    assert encoding_key([deflate(no_context_takeover=False)]) is None  # its frames depend on the messages before


def test_a_message_is_encoded_once_per_encoding_and_reads_back():
    frames = SharedFrames(size=2)
    ext = [deflate(no_context_takeover=True)]
    key = encoding_key(ext)
    first = frames.wire('{"a": 1}', key, ext)
    assert frames.wire('{"a": 1}', key, ext) is first and frames.encoded == 1
    assert frames.wire('{"a": 1}', "plain", []) == b"\x81\x08" + b'{"a": 1}' and frames.encoded == 2
    # what a connection of its own would have sent, byte for byte
    assert first == Frame(Opcode.TEXT, b'{"a": 1}').serialize(
        mask=False, extensions=[deflate(no_context_takeover=True)]
    )
    assert first[0] & 0x40  # RSV1: compressed
    assert zlib.decompressobj(wbits=-12).decompress(first[2:] + b"\x00\x00\xff\xff") == b'{"a": 1}'
    frames.wire("b", "plain", [])
    frames.wire("c", "plain", [])  # the oldest message is forgotten: it would be encoded again
    frames.wire('{"a": 1}', "plain", [])
    assert frames.encoded == 5


@contextlib.asynccontextmanager
async def serving(app: Any) -> AsyncIterator[int]:
    port = free_port()
    server = uvicorn.Server(
        # log_config=None: the logging of the tests that follow is left as it is
        uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, ws=EventStreamProtocol)
    )
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(WAIT_S):
            while not server.started:
                await asyncio.sleep(0.02)
        yield port
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, WAIT_S)


async def test_every_client_reads_the_shared_frame_encoded_once_per_encoding():
    sent: list[bool] = []
    go = asyncio.Event()

    async def endpoint(ws: WebSocket) -> None:
        await ws.accept()
        await go.wait()
        send = shared_sender(ws)
        assert send is not None
        sent.append(send(TEXT, SECOND))  # two messages, one write
        await ws.send_text("done")  # the usual way, after them
        await ws.receive()

    TEXT = '{"type": "tool.progress", "data": {"message": "half way", "progress": 0.5}}'
    SECOND = '{"type": "tool.progress", "data": {"message": "done", "progress": 1.0}}'
    app = Starlette(routes=[WebSocketRoute("/ws", endpoint)])
    async with serving(app) as port:
        url = f"ws://127.0.0.1:{port}/ws"
        async with contextlib.AsyncExitStack() as stack:
            deflating = [await stack.enter_async_context(websockets.connect(url)) for _ in range(3)]
            plain = [await stack.enter_async_context(websockets.connect(url, compression=None)) for _ in range(2)]
            for ws in deflating:  # the server compresses each message on its own
                (ext,) = ws.protocol.extensions
                assert isinstance(ext, PerMessageDeflate) and ext.remote_no_context_takeover
            assert all(not ws.protocol.extensions for ws in plain)
            before = FRAMES.encoded
            go.set()
            for ws in deflating + plain:
                assert await asyncio.wait_for(ws.recv(), WAIT_S) == TEXT
                assert await asyncio.wait_for(ws.recv(), WAIT_S) == SECOND
                assert await asyncio.wait_for(ws.recv(), WAIT_S) == "done"
            assert sent == [True] * 5
            assert FRAMES.encoded - before == 4  # each once compressed, once plain: not once per connection


async def test_a_connection_that_cannot_take_a_frame_at_once_refuses_it():
    results: list[bool] = []
    closed = asyncio.Event()

    async def endpoint(ws: WebSocket) -> None:
        await ws.accept()
        send = shared_sender(ws)
        assert send is not None
        await ws.close(1000)
        results.append(send("after close"))  # closing: the usual send raises, this one says no
        closed.set()

    app = Starlette(routes=[WebSocketRoute("/ws", endpoint)])
    async with serving(app) as port:
        async with websockets.connect(f"ws://127.0.0.1:{port}/ws") as ws:
            await asyncio.wait_for(closed.wait(), WAIT_S)
            with pytest.raises(websockets.ConnectionClosedOK):
                await asyncio.wait_for(ws.recv(), WAIT_S)
    assert results == [False]


async def test_a_send_that_waits_for_a_full_socket_still_writes_the_shared_frame():
    # two clients that stop reading: the server's sockets fill and its sends wait; once the clients read again,
    # every message arrives, in order, and was still encoded once for both (not compressed per connection)
    texts = [f'{{"i": {i}, "pad": "{str(i) * 100_000}"}}' for i in range(50)]
    waited: list[bool] = []

    async def endpoint(ws: WebSocket) -> None:
        await ws.accept()
        send = text_sender(ws)
        protocol = ws.scope["extensions"][SHARED_FRAMES].__self__
        for text in texts:
            waited.append(not protocol.writable.is_set())
            await send(text)
        await ws.receive()

    app = Starlette(routes=[WebSocketRoute("/ws", endpoint)])
    async with serving(app) as port:
        url = f"ws://127.0.0.1:{port}/ws"
        before = FRAMES.encoded
        async with contextlib.AsyncExitStack() as stack:
            # max_queue=1: a client that does not call recv() stops reading its socket
            clients = [
                await stack.enter_async_context(websockets.connect(url, compression=None, max_queue=1, max_size=None))
                for _ in range(2)
            ]
            await asyncio.sleep(1.0)
            assert any(waited)  # the sockets did fill up
            for ws in clients:
                for text in texts:
                    assert await asyncio.wait_for(ws.recv(), WAIT_S) == text
            assert FRAMES.encoded - before == len(texts)  # each message encoded once, for both connections


async def test_a_handshake_in_progress_when_the_server_stops_is_answered_503():
    """A node stopping (a rolling deploy) with an edge's handshake not yet answered by the app (it was finding where
    the session runs): uvicorn answered 500, which the client library took for a failure and the reference edge
    stopped on. The answer is 503 with Retry-After: the client connects again, to another node."""
    arrived = asyncio.Event()

    async def endpoint(ws: WebSocket) -> None:
        await ws.receive()  # the handshake's request, never answered
        arrived.set()
        await ws.receive()  # until the connection is gone

    app = Starlette(routes=[WebSocketRoute("/ws", endpoint)])
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_config=None, ws=EventStreamProtocol, timeout_graceful_shutdown=WAIT_S
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(WAIT_S):
            while not server.started:
                await asyncio.sleep(0.02)

        async def connect() -> Any:
            return await websockets.connect(f"ws://127.0.0.1:{port}/ws", open_timeout=WAIT_S)

        client = asyncio.create_task(connect())
        async with asyncio.timeout(WAIT_S):
            await arrived.wait()
        server.should_exit = True
        with pytest.raises(websockets.InvalidStatus) as refused:
            await client
        assert refused.value.response.status_code == 503
        assert refused.value.response.headers["Retry-After"] == "1"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, WAIT_S)
