"""One budget per caller at the stream doors, on a real server with small caps: the streams a key's session tokens
open count against that key, and readers together never take the slots kept for operators.

The finding it replays: a key that may only read minted tokens, each token's session was a bucket of its own, so ten
sessions times the per-credential cap filled the server's stream cap, and every other credential, operators
included, was refused on both WebSockets and on AG-UI.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import websockets
from websockets.asyncio.client import ClientConnection

from switchboard.control.settings import ALL_SCOPES
from tests.waiting import WAIT_S

from .server import Server

pytestmark = pytest.mark.e2e

ADMIN = "admin-key-0123456789abcdef"  # an operator: holds sessions:control
READER = "reader-key-0123456789abcdef"
OTHER = "other-reader-0123456789abcdef"
THIRD = "third-reader-0123456789abcdef"
KEYS = [
    {"key": ADMIN, "scopes": list(ALL_SCOPES)},
    *({"key": key, "scopes": ["sessions:read", "events:read"]} for key in (READER, OTHER, THIRD)),
]
MAX_STREAMS, PER_CREDENTIAL, RESERVE = 8, 3, 2


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(
        tmp_path_factory.mktemp("stream_budgets"),
        SWITCHBOARD_API_KEYS=json.dumps(KEYS),
        SWITCHBOARD_WS_MAX_STREAMS=str(MAX_STREAMS),
        SWITCHBOARD_WS_MAX_STREAMS_PER_CREDENTIAL=str(PER_CREDENTIAL),
        SWITCHBOARD_WS_OPERATOR_RESERVE=str(RESERVE),
    ).start()
    try:
        yield srv
    finally:
        srv.stop()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class Streams:
    """The streams a test holds open, closed at its end."""

    def __init__(self, server: Server, stack: contextlib.AsyncExitStack) -> None:
        self.server = server
        self.stack = stack

    async def ws(self, path: str, *, key: str | None = None, token: str | None = None) -> ClientConnection | int:
        """The open stream (its first frame read), or the code it was closed with before any frame."""
        url = f"{self.server.ws_url}{path}" + (f"?token={token}" if token else "")
        headers = bearer(key) if key else None
        ws = await self.stack.enter_async_context(websockets.connect(url, additional_headers=headers))
        try:
            async with asyncio.timeout(WAIT_S):
                json.loads(await ws.recv())
        except websockets.ConnectionClosed:
            assert ws.close_code is not None
            return ws.close_code
        return ws

    async def agui(self, sid: str, *, key: str | None = None, token: str | None = None) -> tuple[int, str]:
        """The AG-UI stream's status (200: held open) and, when refused, its problem's code and detail."""
        client = await self.stack.enter_async_context(httpx.AsyncClient(base_url=self.server.url, timeout=WAIT_S))
        params = {"token": token} if token else None
        response = await self.stack.enter_async_context(
            client.stream("GET", f"/v1/sessions/{sid}/ag-ui", params=params, headers=bearer(key) if key else None)
        )
        if response.status_code != 200:
            await response.aread()
            body = response.json()
            return response.status_code, f"{body['code']}: {body['detail']}"
        return 200, ""


@pytest.fixture
async def streams(server: Server) -> AsyncIterator[Streams]:
    async with contextlib.AsyncExitStack() as stack:
        yield Streams(server, stack)


async def test_a_readers_tokens_share_its_budget_and_operators_keep_a_reserve(server: Server, streams: Streams):
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        sids = []
        for _ in range(PER_CREDENTIAL + 1):
            r = await client.post("/v1/sessions", json={"agent": "tester"}, headers=bearer(ADMIN))
            assert r.status_code == 201, r.text
            sids.append(str(r.json()["id"]))
        tokens = []
        for sid in sids:  # one token per session, as a dashboard's server mints them for its pages
            r = await client.post(f"/v1/sessions/{sid}/tokens", json={}, headers=bearer(READER))
            assert r.status_code == 201 and "events:read" in r.json()["scopes"], r.text
            tokens.append(str(r.json()["token"]))

    # each token on its own session: together they hold the one key's share, no more
    for i in range(PER_CREDENTIAL):
        assert not isinstance(await streams.ws(f"/v1/sessions/{sids[i]}/events", token=tokens[i]), int)
    last_sid, last_token = sids[PER_CREDENTIAL], tokens[PER_CREDENTIAL]
    assert await streams.ws(f"/v1/sessions/{last_sid}/events", token=last_token) == 4429
    status, why = await streams.agui(last_sid, token=last_token)
    assert status == 429 and why.startswith("too_many_streams") and "credential" in why, why
    assert await streams.ws("/v1/events", key=READER) == 4429  # the key itself too: the same budget

    # another reader fills the server up to the reserve; a third reader then finds nothing left for it
    for _ in range(MAX_STREAMS - RESERVE - PER_CREDENTIAL):
        assert not isinstance(await streams.ws("/v1/events", key=OTHER), int)
    assert await streams.ws("/v1/events", key=THIRD) == 4429
    assert await streams.ws(f"/v1/sessions/{sids[0]}/events", key=THIRD) == 4429
    status, why = await streams.agui(sids[0], key=THIRD)
    assert status == 429 and "operators" in why, why

    # the operator still gets in, on a WebSocket and on AG-UI, until the server is full
    assert not isinstance(await streams.ws(f"/v1/sessions/{sids[0]}/events", key=ADMIN), int)
    assert await streams.agui(sids[0], key=ADMIN) == (200, "")
    assert await streams.ws("/v1/events", key=ADMIN) == 4429
    status, why = await streams.agui(sids[1], key=ADMIN)
    assert status == 429 and "server" in why, why


def test_the_reserve_is_below_the_cap() -> None:
    from pydantic import ValidationError

    from switchboard.control.settings import Settings

    assert Settings(ws_max_streams=1000).operator_stream_reserve == 100
    assert Settings(ws_max_streams=5, ws_operator_reserve=4).operator_stream_reserve == 4
    with pytest.raises(ValidationError, match="WS_OPERATOR_RESERVE"):
        Settings(ws_max_streams=5, ws_operator_reserve=5)
