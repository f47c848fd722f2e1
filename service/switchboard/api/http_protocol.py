"""uvicorn's HTTP protocols, each connection holding a ticket at the connection gate (``connections``).

The seams, the same in both of uvicorn's HTTP/1.1 implementations (httptools, its default when installed, and h11):
a request is in the app's hands from its headers (a new ``cycle``) until its response is complete. Bytes that
arrive while no request is (the connection just opened, or a later request begins on a keep-alive connection) start
the header deadline, and a new cycle, or a WebSocket upgrade, ends it. An upgraded connection belongs to the
WebSocket protocol from then on, which releases the ticket when it is lost (``adopt_ticket``).
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .connections import ConnectionGate, GateTicket

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is not installed: uvicorn serves with h11
    HttpToolsProtocol = None  # type: ignore[assignment,misc]


class _GatedConnection(asyncio.Protocol):
    gate: ClassVar[ConnectionGate]
    ticket: GateTicket
    # set by uvicorn's protocol
    transport: Any
    client: Any
    cycle: Any
    server_state: Any

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        server_state = self.server_state
        self.ticket = self.gate.open(transport, self.client, lambda: server_state.default_headers)

    def data_received(self, data: bytes) -> None:
        if self.ticket.refused:  # answered and closing: nothing more is read
            return
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            self.ticket.await_headers()
        super().data_received(data)
        if self.cycle is not cycle:
            self.ticket.headers_arrived()

    def connection_lost(self, exc: Exception | None) -> None:
        self.ticket.close()
        super().connection_lost(exc)

    def _upgraded(self) -> None:
        """The headers of a WebSocket handshake arrived and the connection now has the WebSocket protocol."""
        self.ticket.headers_arrived()
        adopt = getattr(self.transport.get_protocol(), "adopt_ticket", None)
        if callable(adopt):
            adopt(self.ticket)
        else:  # a protocol that cannot release it: the connection stops counting now rather than forever
            self.ticket.close()


class GatedH11Protocol(_GatedConnection, H11Protocol):
    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        super().handle_websocket_upgrade(event)
        self._upgraded()


if HttpToolsProtocol is not None:

    class GatedHttpToolsProtocol(_GatedConnection, HttpToolsProtocol):
        def handle_websocket_upgrade(self) -> None:
            super().handle_websocket_upgrade()
            self._upgraded()


def gated_http_protocol(gate: ConnectionGate) -> type[asyncio.Protocol]:
    """The HTTP protocol uvicorn would pick (httptools when installed, else h11), its connections passing ``gate``."""
    base: type[_GatedConnection] = GatedH11Protocol if HttpToolsProtocol is None else GatedHttpToolsProtocol
    return type(base.__name__, (base,), {"gate": gate})
