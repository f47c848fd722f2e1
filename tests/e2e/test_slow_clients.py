"""A real server against slow and many connections (docs/security.md, "The network edge"): a request whose headers
never finish is answered 408 and closed by the header deadline, one client address holds at most
``MAX_CONNECTIONS_PER_CLIENT`` connections (its WebSockets included) while other addresses are served, and
connections still waiting for their headers never take the descriptors an authenticated caller needs. Each runs
against both of uvicorn's HTTP implementations: httptools (what the server picks when it is installed) and h11 (what
it picks otherwise)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import websockets

from switchboard.control.settings import ALL_SCOPES
from tests.waiting import WAIT_S, until

from .server import Server

pytestmark = pytest.mark.e2e

KEY = "slow-clients-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
HEADER_TIMEOUT_S = 2.0
PER_CLIENT = 4
DRIP_S = 1.0  # the attack's pace: one header byte a second
IMPLEMENTATIONS = ("httptools", "h11")


def serve_command(implementation: str, *, nofile: int | None = None) -> list[str]:
    """``python -m switchboard.cli``, but with httptools hidden (``h11``: uvicorn then serves with h11) or with a
    descriptor limit (``nofile``), as a small machine's."""
    lines = ["import resource, sys"]
    if implementation == "h11":
        lines.append("sys.modules['httptools'] = None")
    if nofile is not None:
        lines.append(f"resource.setrlimit(resource.RLIMIT_NOFILE, ({nofile}, resource.getrlimit(7)[1]))")
    lines.append("from switchboard.cli.main import main; sys.exit(main())")
    return [sys.executable, "-c", "; ".join(lines)]


def start_server(tmp_path: Path, implementation: str, *, nofile: int | None = None, **env: str) -> Server:
    env = {
        "SWITCHBOARD_API_KEYS": json.dumps([{"key": KEY, "scopes": list(ALL_SCOPES)}]),
        "SWITCHBOARD_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
        **env,
    }
    return Server(tmp_path, command=serve_command(implementation, nofile=nofile), **env).start()


@pytest.fixture(scope="module", params=IMPLEMENTATIONS)
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(
        tmp_path_factory.mktemp(f"slow-{request.param}"),
        request.param,
        SWITCHBOARD_MAX_CONNECTIONS_PER_CLIENT=str(PER_CLIENT),
    )
    try:
        yield srv
    finally:
        srv.stop()


async def closes(reader: asyncio.StreamReader) -> bytes:
    """Everything the server writes until it closes the connection (a reset ends it too)."""
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := await reader.read(65536):
            data += chunk
    return data


async def drip(writer: asyncio.StreamWriter, data: bytes) -> None:
    """Send ``data`` one byte every ``DRIP_S``, until the server closes the connection."""
    with contextlib.suppress(ConnectionError):
        for byte in data:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(DRIP_S)


@contextlib.asynccontextmanager
async def dripping(writer: asyncio.StreamWriter, data: bytes) -> AsyncIterator[None]:
    """``drip`` in the background while the body runs; the connection closed after it."""
    task = asyncio.create_task(drip(writer, data))
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        writer.close()


NEVER_ENDING_HEADERS = b"GET /v1/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 4096


async def closed_before_request(server: Server, reason: str, address: str = "127.0.0.5") -> float:
    """A count of ``switchboard_connections_closed_before_request``, read from an address no test caps."""
    transport = httpx.AsyncHTTPTransport(local_address=address)
    async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=WAIT_S, transport=transport) as client:
        text = (await client.get("/metrics")).text
    found = re.search(rf'^switchboard_connections_closed_before_request_total{{reason="{reason}"}} (\S+)$', text, re.M)
    assert found, text
    return float(found[1])


async def test_headers_sent_a_byte_a_second_are_cut_off_by_the_deadline(server: Server):
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    loop = asyncio.get_running_loop()
    opened = loop.time()
    async with dripping(writer, NEVER_ENDING_HEADERS), asyncio.timeout(WAIT_S):
        answer = await closes(reader)
    held_s = loop.time() - opened
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert b'"code":"header_timeout"' in answer and b"connection: close" in answer.lower()
    # each byte did not restart the wait: the connection was closed once its first deadline passed
    assert HEADER_TIMEOUT_S - 0.1 <= held_s < WAIT_S


async def test_a_connection_that_sends_nothing_is_closed_by_the_deadline(server: Server):
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        async with asyncio.timeout(WAIT_S):
            answer = await closes(reader)
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 408 "), answer


async def test_a_later_request_on_a_kept_alive_connection_has_the_same_deadline(server: Server):
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    first = await asyncio.wait_for(reader.readuntil(b'"ok"}'), WAIT_S)
    assert first.startswith(b"HTTP/1.1 200 "), first
    # uvicorn's keep-alive timer stops at the first byte of the next request
    async with dripping(writer, NEVER_ENDING_HEADERS), asyncio.timeout(WAIT_S):
        answer = await closes(reader)
    assert answer.startswith(b"HTTP/1.1 408 "), answer


async def test_one_address_holds_at_most_its_cap_of_connections_while_others_are_served(server: Server):
    # an address of its own (the other tests' connections from 127.0.0.1 may still be closing)
    capped, other = "127.0.0.3", "127.0.0.4"
    streams = [
        await websockets.connect(f"{server.ws_url}/v1/events", additional_headers=AUTH, local_addr=(capped, 0))
        for _ in range(PER_CLIENT)
    ]
    try:
        await over_the_cap(server, streams, capped, other)
    finally:
        for stream in streams:
            await stream.close()


async def over_the_cap(server: Server, streams: list[websockets.ClientConnection], capped: str, other: str) -> None:
    refused_before = await closed_before_request(server, "per_client")
    # one more from the same address, a WebSocket's or not: answered 429 at once, before any byte of a request
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port, local_addr=(capped, 0))
    try:
        async with asyncio.timeout(WAIT_S):
            answer = await closes(reader)
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 429 "), answer
    assert b"retry-after: 1" in answer.lower() and b'"code":"too_many_connections"' in answer
    assert await closed_before_request(server, "per_client") == refused_before + 1

    transport = httpx.AsyncHTTPTransport(local_address=other)
    async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=WAIT_S, transport=transport) as client:
        assert (await client.get("/v1/sessions")).status_code == 200

    # a stream closed gives its place back (the WebSocket protocol held it since the upgrade)
    await streams.pop().close()

    async def served_again() -> bool:
        transport = httpx.AsyncHTTPTransport(local_address=capped)
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=WAIT_S, transport=transport) as c:
            try:
                return (await c.get("/v1/sessions")).status_code == 200
            except httpx.TransportError:  # refused (still counted): try again
                return False

    await until(served_again)


@contextlib.asynccontextmanager
async def slow_connections(port: int, count: int) -> AsyncIterator[list[asyncio.Task[bytes]]]:
    """``count`` connections each dripping never-ending headers; each task ends with what the server wrote before
    it closed the connection (b"" if it was never accepted and dropped)."""

    async def one() -> bytes:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            return b""
        async with dripping(writer, NEVER_ENDING_HEADERS):
            return await closes(reader)

    tasks = [asyncio.create_task(one()) for _ in range(count)]
    try:
        yield tasks
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
async def test_slow_connections_never_take_the_descriptors_an_authenticated_caller_needs(
    tmp_path: Path, implementation: str
):
    """The finding at a small scale: a process with 128 descriptors (about 100 free for connections), 160
    connections from one address dripping their headers. Before, they held every descriptor until they stopped and
    an authenticated request waited for them; now at most ``MAX_PENDING_CONNECTIONS`` of them wait, the request is
    served at once, and the deadline closes the rest."""
    pending_cap, attackers = 32, 160
    srv = start_server(
        tmp_path,
        implementation,
        nofile=128,
        # long enough that the caller below is served before any deadline however loaded the machine (the deadline
        # itself has its own tests above); the slow connections left then wait it out
        SWITCHBOARD_HEADER_TIMEOUT_S="15",
        SWITCHBOARD_MAX_PENDING_CONNECTIONS=str(pending_cap),
        SWITCHBOARD_MAX_CONNECTIONS_PER_CLIENT="0",  # one attacking address; the per-client cap has its own test
    )
    try:
        async with slow_connections(srv.port, attackers) as attacks:
            # past the cap, the connections that waited longest are answered 503 and closed
            await until(lambda: sum(task.done() for task in attacks) >= attackers - pending_cap)
            async with httpx.AsyncClient(base_url=srv.url, headers=AUTH, timeout=WAIT_S) as client:
                r = await client.get("/v1/sessions")
                assert r.status_code == 200, r.text
                metrics = (await client.get("/metrics")).text
            # served while the slow connections still waited: none had reached its deadline
            assert 'switchboard_connections_closed_before_request_total{reason="header_timeout"} 0.0' in metrics
            assert not all(task.done() for task in attacks)
            async with asyncio.timeout(WAIT_S):
                answers = await asyncio.gather(*attacks)

            async def none_pending() -> bool:
                async with httpx.AsyncClient(base_url=srv.url, headers=AUTH, timeout=WAIT_S) as client:
                    return "\nswitchboard_connections_pending 0.0\n" in (await client.get("/metrics")).text

            await until(none_pending, every_s=0.2)  # each one closed left the count
        statuses = {answer[:12] for answer in answers}
        assert statuses <= {b"HTTP/1.1 503", b"HTTP/1.1 408", b""}, statuses
        assert sum(answer.startswith(b"HTTP/1.1 408 ") for answer in answers) <= pending_cap
        assert any(answer.startswith(b"HTTP/1.1 503 ") for answer in answers)
    finally:
        srv.stop()
