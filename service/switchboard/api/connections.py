"""The server's connections before their request arrives: a deadline for the request's headers, a cap per client
address, and a cap on the connections still waiting for their headers.

A request whose headers never finish would otherwise hold its connection (and a file descriptor) for good: uvicorn's
keep-alive timeout covers only a connection idle after a response, and the app's own limits (``BodyLimit``,
``RequestDeadline``) start once the headers are in. Here:

- A connection whose request line and headers have not all arrived ``header_timeout_s`` after it opened, or after the
  first byte of a later request on it, is answered 408 and closed (``header_timeout``).
- One client address holds at most ``per_client`` connections, whatever they are doing (a WebSocket's included); one
  more is answered 429 with ``Retry-After`` and closed at once (``per_client``). The address is the TCP peer's: behind
  a proxy, the proxy's (headers such as ``X-Forwarded-For`` arrive too late, and anyone could write them). An IPv6
  client is counted by its /64, which one host usually holds whole.
- At most ``pending`` connections wait for their headers at once. Past that the ones that have waited longest are
  answered 503 with ``Retry-After`` and closed (``pending_full``), so slow or idle clients can never take the
  descriptors that the clients being served need. The check runs ``PENDING_GRACE_S`` after the cap is passed, not at
  once: a burst of connections is accepted before any of them is read, and their requests, already sent, are read
  in that time and leave the count; the newest connection, the likeliest to be a client about to send, is the last
  one closed.

``ConnectionGate`` keeps the counts for the process; each connection holds a ``GateTicket`` (``http_protocol``
wires them into uvicorn's protocols). Each close is counted by reason
(``switchboard_connections_closed_before_request``) and logged at debug; the first of each reason is logged at info,
then one a minute at most.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus

from .headers import problem_headers
from .problems import PROBLEM_JSON, problem_document

logger = logging.getLogger("switchboard.api")

PENDING_GRACE_S = 0.1
RETRY_AFTER_S = 1
CLOSE_LOG_S = 60.0  # a close is logged at info once per reason in this time (each one at debug)
IPV6_CLIENT_PREFIX = 64


def client_key(client: tuple[str, int] | None) -> str | None:
    """What the per-client cap counts a peer as: its IPv4 address, or its IPv6 /64 (an IPv4-mapped IPv6 address is
    its IPv4 address). None (a Unix socket, an address that is not IP): not counted."""
    if client is None:
        return None
    try:
        address = ipaddress.ip_address(client[0].split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, IPV6_CLIENT_PREFIX), strict=False))
    return str(address)


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float = 5.0
    per_client: int = 256  # 0: no cap
    pending: int = 256  # 0: no cap


def refusal(status: int, code: str, detail: str, default_headers: Sequence[tuple[bytes, bytes]]) -> bytes:
    """A whole HTTP/1.1 answer (a problem document) ending the connection: written outside the app, so it carries the
    headers the app's answers carry itself."""
    body = json.dumps(problem_document(status, code, detail), separators=(",", ":")).encode()
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}".encode()]
    headers = [
        *default_headers,
        (b"content-type", PROBLEM_JSON.encode()),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        *((k.encode(), v.encode()) for k, v in problem_headers().items()),
    ]
    if status in (429, 503):
        headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
    lines += [name + b": " + value for name, value in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


class ConnectionGate:
    """The counts of one process: connections per client address, and those waiting for their request headers
    (oldest first)."""

    def __init__(self, limits: ConnectionLimits, *, on_close: Callable[[str], None] = lambda reason: None) -> None:
        self.limits = limits
        self.on_close = on_close
        self.clients: dict[str, int] = {}
        self.pending: OrderedDict[GateTicket, None] = OrderedDict()
        self._enforce_at: asyncio.TimerHandle | None = None
        self._logged: dict[str, float] = {}

    def open(
        self,
        transport: asyncio.BaseTransport,
        client: tuple[str, int] | None,
        default_headers: Callable[[], Sequence[tuple[bytes, bytes]]] = tuple,
    ) -> GateTicket:
        """A ticket for a connection that just opened, waiting for its headers; a connection over its client's cap
        is answered 429 and closed, and gets a ticket that holds nothing (``refused``)."""
        ticket = GateTicket(self, transport, client, default_headers)
        key = client_key(client)
        cap = self.limits.per_client
        if key is not None and cap and self.clients.get(key, 0) >= cap:
            ticket.refuse("per_client", 429, "too_many_connections", f"This address already holds {cap} connections.")
            return ticket
        if key is not None:
            self.clients[key] = self.clients.get(key, 0) + 1
            ticket.key = key
        ticket.await_headers()
        return ticket

    def _release(self, key: str) -> None:
        left = self.clients[key] - 1
        if left:
            self.clients[key] = left
        else:
            del self.clients[key]

    def _waiting(self, ticket: GateTicket) -> None:
        self.pending[ticket] = None
        cap = self.limits.pending
        if cap and len(self.pending) > cap and self._enforce_at is None:
            self._enforce_at = asyncio.get_running_loop().call_later(PENDING_GRACE_S, self._enforce)

    def _enforce(self) -> None:
        """Close the connections that have waited longest for their headers until no more than the cap wait."""
        self._enforce_at = None
        while len(self.pending) > self.limits.pending:
            oldest, _ = self.pending.popitem(last=False)
            oldest.refuse("pending_full", 503, "server_busy", "Too many connections are waiting to send their request.")

    def closed(self, reason: str, client: tuple[str, int] | None, detail: str) -> None:
        self.on_close(reason)
        peer = f"{client[0]}:{client[1]}" if client else "?"
        now = time.monotonic()
        last = self._logged.get(reason)
        if last is None or now - last >= CLOSE_LOG_S:
            self._logged[reason] = now
            logger.info(
                "closed a connection from %s before its request (%s: %s); more are counted in "
                "switchboard_connections_closed_before_request and logged again after %.0f s",
                peer,
                reason,
                detail,
                CLOSE_LOG_S,
            )
        else:
            logger.debug("closed a connection from %s before its request (%s: %s)", peer, reason, detail)


class GateTicket:
    """One connection's place at the gate: its client's count, whether it waits for request headers (and until
    when), and how it is refused. ``close`` when the connection is lost, whoever holds it then."""

    def __init__(
        self,
        gate: ConnectionGate,
        transport: asyncio.BaseTransport,
        client: tuple[str, int] | None,
        default_headers: Callable[[], Sequence[tuple[bytes, bytes]]],
    ) -> None:
        self.gate = gate
        self.transport = transport
        self.client = client
        self.default_headers = default_headers  # the server's current ones (its Date changes)
        self.key: str | None = None
        self.refused = False
        self._deadline: asyncio.TimerHandle | None = None

    def await_headers(self) -> None:
        """A request begins (the connection opened, or a later request's first byte arrived): its headers must all
        arrive within the header timeout."""
        if self._deadline is not None or self.refused:
            return
        timeout_s = self.gate.limits.header_timeout_s
        self._deadline = asyncio.get_running_loop().call_later(timeout_s, self._timed_out)
        self.gate._waiting(self)

    def headers_arrived(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self.gate.pending.pop(self, None)

    def close(self) -> None:
        """The connection is gone: nothing of it counts any more (idempotent)."""
        self.headers_arrived()
        if self.key is not None:
            self.gate._release(self.key)
            self.key = None

    def _timed_out(self) -> None:
        self._deadline = None  # the handle has run: nothing to cancel
        timeout_s = self.gate.limits.header_timeout_s
        self.refuse(
            "header_timeout", 408, "header_timeout", f"The request headers did not arrive within {timeout_s:g} s."
        )

    def refuse(self, reason: str, status: int, code: str, detail: str) -> None:
        """Answer ``status`` and close the connection (once), counting and logging why."""
        if self.refused:
            return
        self.refused = True
        self.headers_arrived()
        self.gate.closed(reason, self.client, detail)
        if not self.transport.is_closing():
            write = getattr(self.transport, "write", None)
            if write is not None:
                write(refusal(status, code, detail, self.default_headers()))
            self.transport.close()
