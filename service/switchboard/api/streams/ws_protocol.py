"""The server's WebSocket connections, with event frames encoded once for every subscriber.

A live event goes out to each of its subscribers as the same text message. Through ASGI each connection would frame
it and, with permessage-deflate, compress it on its own, a thousand times for a thousand dashboards. Here the server
compresses each message on its own (``server_no_context_takeover``, as RFC 7692 lets a server decide), so its bytes
on the wire depend only on the message and the negotiated parameters: ``SharedFrames`` encodes a message once per
encoding, and a connection that can take it at once writes those bytes to its socket (``EventStreamProtocol
.send_shared``, offered to the app as the ASGI scope extension ``SHARED_FRAMES``). Compressing each message on its own
also frees a connection's compressor between messages (~32 KB per idle stream).

Everything else is uvicorn's websockets (sans-I/O) protocol: the handshake, keepalive pings, receiving, closing; but a
handshake still in progress when the server stops is answered 503, not 500 (the client connects again), and the
connection keeps counting against its client's connection cap (``api.connections``) until it is lost.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Hashable, Sequence
from http import HTTPStatus
from typing import Any

from starlette.websockets import WebSocket
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.extensions.base import Extension
from websockets.extensions.permessage_deflate import PerMessageDeflate, ServerPerMessageDeflateFactory
from websockets.frames import Frame, Opcode
from websockets.http11 import Request
from websockets.protocol import State
from websockets.server import ServerProtocol

from ..connections import GateTicket

#: The ASGI scope extension of a connection that can write shared frames: ``send_shared(*texts) -> bool``.
SHARED_FRAMES = "switchboard.shared_frames"
#: ... and ``await send_shared_when_writable(text) -> bool``, which first waits as a send does for the socket to take
#: more.
SHARED_FRAMES_WHEN_WRITABLE = "switchboard.shared_frames_when_writable"
SHARED_CACHE_SIZE = 64  # messages whose wire bytes are kept (one event may make a few AG-UI messages)
WINDOW_BITS = 12  # uvicorn's (and the websockets library's) defaults
COMPRESS_SETTINGS = {"memLevel": 5}
SHUTDOWN_RETRY_AFTER_S = "1"

SendShared = Callable[..., bool]  # (*texts: str) -> bool
SendText = Callable[[str], Coroutine[Any, Any, None]]


def encoding_key(extensions: Sequence[Extension]) -> Hashable | None:
    """What a connection's frames depend on besides the message, or None when they depend on its history (an
    extension that keeps context across messages, or one this module does not know)."""
    if not extensions:
        return "plain"
    if len(extensions) != 1 or not isinstance(ext := extensions[0], PerMessageDeflate):
        return None
    if not ext.local_no_context_takeover:
        return None
    return ("deflate", ext.local_max_window_bits, tuple(sorted(ext.compress_settings.items())))


class SharedFrames:
    """The wire bytes of recent text messages, per encoding: each is framed (and compressed) once."""

    def __init__(self, size: int = SHARED_CACHE_SIZE) -> None:
        self._size = size
        self._wire: OrderedDict[str, dict[Hashable, bytes]] = OrderedDict()
        self.encoded = 0  # messages framed so far (a test and a benchmark read it)

    def wire(self, text: str, key: Hashable, extensions: Sequence[Extension]) -> bytes:
        """``text`` as one unmasked text frame, for a connection whose ``encoding_key`` is ``key``."""
        by_key = self._wire.get(text)
        if by_key is None:
            by_key = self._wire[text] = {}
            if len(self._wire) > self._size:
                self._wire.popitem(last=False)
        data = by_key.get(key)
        if data is None:
            # with no context kept across messages, the extension compresses this one with a fresh compressor
            data = by_key[key] = Frame(Opcode.TEXT, text.encode()).serialize(mask=False, extensions=extensions)
            self.encoded += 1
        return data


FRAMES = SharedFrames()


class EventStreamProtocol(WebSocketsSansIOProtocol):
    """uvicorn's websockets protocol, compressing each message on its own and offering ``send_shared``."""

    def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any], _loop: Any = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        if self.config.ws_per_message_deflate:
            deflate = ServerPerMessageDeflateFactory(
                server_no_context_takeover=True,
                server_max_window_bits=WINDOW_BITS,
                client_max_window_bits=WINDOW_BITS,
                compress_settings=dict(COMPRESS_SETTINGS),
            )
            self.conn = ServerProtocol(
                extensions=[deflate], max_size=self.config.ws_max_size, logger=logging.getLogger("uvicorn.error")
            )
        self._encoding: Hashable | None = None
        self._ticket: GateTicket | None = None

    def adopt_ticket(self, ticket: GateTicket) -> None:
        """The connection's place at the connection gate, taken over from the HTTP protocol that upgraded it: this
        connection counts against its client's cap until it is lost."""
        self._ticket = ticket

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self._ticket is not None:
            self._ticket.close()

    def handle_connect(self, event: Request) -> None:
        super().handle_connect(event)
        if self.response.status_code == 101:  # the scope exists; the app's task has not run yet
            self._encoding = encoding_key(self.conn.extensions)
            if self._encoding is not None:
                extensions: dict[str, Any] = self.scope["extensions"]
                extensions[SHARED_FRAMES] = self.send_shared
                extensions[SHARED_FRAMES_WHEN_WRITABLE] = self.send_shared_when_writable

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self.handshake_initiated and self.conn.handshake_exc is not None:
            self._refuse_unreadable_request()

    def _refuse_unreadable_request(self) -> None:
        """Answer and close a handshake the websockets library could not read (a request line or headers over its
        limits): it wrote its 414 / 431, but uvicorn sends only what follows a request it was given, so the
        connection would stay open for good, and a shutdown would fail on it trying to answer a second time."""
        self.handshake_complete = True
        self.close_sent = True
        self.transport.write(b"".join(self.conn.data_to_send()))
        self.transport.close()

    def shutdown(self) -> None:
        """The server stops: a connection whose handshake the app has not answered yet is answered 503 with
        ``Retry-After`` (uvicorn answers 500, which a client takes for a failure rather than a node going away)."""
        if self.handshake_complete or self.close_sent or self.initial_response is not None:
            super().shutdown()
            return
        self.stop_keepalive()
        response = self.conn.reject(HTTPStatus.SERVICE_UNAVAILABLE, "The server is shutting down; connect again.\n")
        response.headers["Retry-After"] = SHUTDOWN_RETRY_AFTER_S
        self.conn.send_response(response)
        self.transport.write(b"".join(self.conn.data_to_send()))
        self.transport.close()

    def send_shared(self, *texts: str) -> bool:
        """Write each of ``texts`` as a text message, their bytes shared with every connection that encodes them
        alike, in one write. False when this connection cannot take them at once (not open, or its socket buffer
        full): nothing was written; send them the usual way, which waits or raises as a send does."""
        if (
            self._encoding is None
            or not self.handshake_complete
            or self.close_sent
            or self.disconnected
            or not self.writable.is_set()
            or self.conn.state is not State.OPEN
            or self.transport.is_closing()
        ):
            return False
        encoding, extensions = self._encoding, self.conn.extensions
        if len(texts) == 1:
            self.transport.write(FRAMES.wire(texts[0], encoding, extensions))
        else:
            self.transport.write(b"".join([FRAMES.wire(text, encoding, extensions) for text in texts]))
        return True

    async def send_shared_when_writable(self, text: str) -> bool:
        """``send_shared`` once the socket takes more data (as uvicorn's own send waits first): a stream that fell
        behind for a moment still sends the shared bytes rather than compressing each message for itself."""
        await self.writable.wait()  # set again when the connection is lost: ``send_shared`` then says False
        return self.send_shared(text)


def shared_sender(ws: WebSocket) -> SendShared | None:
    """The connection's ``send_shared``, when its server offers it."""
    extensions = ws.scope.get("extensions") or {}
    sender = extensions.get(SHARED_FRAMES)
    return sender if callable(sender) else None


def text_sender(ws: WebSocket) -> SendText:
    """How a stream sends a text message: as shared bytes when its server offers them (waiting, as a send does, for
    the socket to take more), else (or once the connection is no longer open) the usual way, which raises as a send
    does."""
    extensions = ws.scope.get("extensions") or {}
    when_writable = extensions.get(SHARED_FRAMES_WHEN_WRITABLE)
    if not callable(when_writable):
        return ws.send_text

    async def send(text: str) -> None:
        if not await when_writable(text):
            await ws.send_text(text)

    return send
