"""The connection gate's bookkeeping (``api.connections``), with transports that record what is written to them: what
counts as one client, who is closed first when too many connections wait for their headers, and that every count
returns to zero. The same rules against a real server: ``tests/e2e/test_slow_clients.py``."""

from __future__ import annotations

import asyncio

from switchboard.api.connections import ConnectionGate, ConnectionLimits, client_key
from tests.waiting import until


class Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def test_a_client_is_its_ipv4_address_or_its_ipv6_64():
    assert client_key(("192.0.2.7", 5000)) == "192.0.2.7"
    assert client_key(("2001:db8:1:2:aaaa::1", 5000)) == client_key(("2001:db8:1:2:ffff::9", 1)) == "2001:db8:1:2::/64"
    assert client_key(("2001:db8:1:3::1", 5000)) != client_key(("2001:db8:1:2::1", 5000))
    assert client_key(("::ffff:192.0.2.7", 5000)) == "192.0.2.7"
    assert client_key(("fe80::1%eth0", 5000)) == "fe80::/64"
    assert client_key(None) is None
    assert client_key(("not an address", 0)) is None


async def test_over_the_per_client_cap_a_connection_is_refused_429_and_a_close_frees_a_place():
    closes: list[str] = []
    gate = ConnectionGate(ConnectionLimits(per_client=2), on_close=closes.append)
    first, second, third = Transport(), Transport(), Transport()
    tickets = [gate.open(t, ("192.0.2.7", port)) for port, t in enumerate((first, second, third))]
    assert third.closed and third.written.startswith(b"HTTP/1.1 429 ") and b"retry-after: 1\r\n" in third.written
    assert tickets[2].refused and not first.closed and closes == ["per_client"]
    assert not gate.open(Transport(), ("192.0.2.8", 1)).refused  # another address
    tickets[0].close()
    tickets[0].close()  # idempotent
    assert not gate.open(Transport(), ("192.0.2.7", 9)).refused
    for ticket in gate.pending.copy():
        ticket.close()
    tickets[1].close()
    assert gate.clients == {} and not gate.pending


async def test_past_the_pending_cap_the_longest_waiting_are_closed_503():
    closes: list[str] = []
    gate = ConnectionGate(ConnectionLimits(pending=2, per_client=0), on_close=closes.append)
    transports = [Transport() for _ in range(4)]
    tickets = [gate.open(t, ("192.0.2.7", port)) for port, t in enumerate(transports)]
    tickets[1].headers_arrived()  # its request is in: it no longer waits
    assert len(gate.pending) == 3
    await until(lambda: len(gate.pending) == 2)
    assert [t.closed for t in transports] == [True, False, False, False]
    assert transports[0].written.startswith(b"HTTP/1.1 503 ") and b'"code":"server_busy"' in transports[0].written
    assert closes == ["pending_full"]
    # a later request on the connection that was served waits again, at the end of the line
    tickets[1].await_headers()
    await until(lambda: len(gate.pending) == 2)
    assert [t.closed for t in transports] == [True, False, True, False]
    for ticket in tickets:
        ticket.close()
    assert not gate.pending and gate.clients == {}


async def test_headers_not_in_by_the_deadline_are_answered_408():
    gate = ConnectionGate(ConnectionLimits(header_timeout_s=0.05))
    transport = Transport()
    ticket = gate.open(transport, ("192.0.2.7", 1))
    await until(lambda: transport.closed)
    assert transport.written.startswith(b"HTTP/1.1 408 ") and b"connection: close\r\n" in transport.written
    assert ticket.refused and not gate.pending
    ticket.close()
    assert gate.clients == {}


def test_the_per_client_cap_is_off_by_default_in_cluster_mode():
    """A node relays the media edges of sessions another node runs, all from its one address: at 256 of them the
    next relay was refused (429), and the edge sent round again and again."""
    from switchboard.control.settings import Settings

    assert Settings().connections_per_client == 256
    assert Settings(redis_url="redis://127.0.0.1:6379/0").connections_per_client == 0
    assert Settings(redis_url="redis://127.0.0.1:6379/0", max_connections_per_client=64).connections_per_client == 64
