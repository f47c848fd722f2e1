"""Authentication on the WebSocket streams of a real server with API keys configured: every refusal is a close with
4401 or 4403 before any frame (never an open socket), keys work in the header and are refused in the URL (only
per-session tokens go in ?token=), per-session tokens read their own session only, and no credential ever reaches
the server's log."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import websockets

from switchboard.api.auth import issue_token
from switchboard.control.settings import ALL_SCOPES, Settings
from tests.waiting import WAIT_S

from .server import Server

pytestmark = pytest.mark.e2e

ADMIN = "admin-key-0123456789abcdef"
READER = "reader-key-0123456789abcdef"
NO_EVENTS = "noevents-key-0123456789abcdef"
SECRET = "token-secret-for-the-e2e-test-0123456789"
KEYS = [
    {"key": ADMIN, "scopes": list(ALL_SCOPES)},
    {"key": READER, "scopes": ["sessions:read", "events:read"]},
    {"key": NO_EVENTS, "scopes": ["sessions:read", "sessions:write", "sessions:control"]},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(
        tmp_path_factory.mktemp("auth_ws"),
        SWITCHBOARD_API_KEYS=json.dumps(KEYS),
        SWITCHBOARD_TOKEN_SECRET=SECRET,
        SWITCHBOARD_LOG_LEVEL="DEBUG",  # as verbose as it gets: the log must still hold no credential
    ).start()
    try:
        yield srv
    finally:
        srv.stop()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def new_session(server: Server) -> str:
    async with httpx.AsyncClient(base_url=server.url, headers=bearer(ADMIN), timeout=WAIT_S) as client:
        r = await client.post("/v1/sessions", json={"agent": "tester"})
        assert r.status_code == 201, r.text
        return str(r.json()["id"])


async def session_token(server: Server, sid: str, key: str = READER) -> str:
    async with httpx.AsyncClient(base_url=server.url, headers=bearer(key), timeout=WAIT_S) as client:
        r = await client.post(f"/v1/sessions/{sid}/tokens", json={"ttl_s": 60})
        assert r.status_code == 201, r.text
        return str(r.json()["token"])


async def refused(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    """The server must close the socket promptly, before sending any frame."""
    async with asyncio.timeout(WAIT_S):
        async with websockets.connect(url, additional_headers=headers) as ws:
            with pytest.raises(websockets.ConnectionClosed):
                frame = await ws.recv()
                raise AssertionError(f"an unauthorised client got a frame: {frame}")
            assert ws.close_code is not None
            return ws.close_code, ws.close_reason or ""


async def first_frame(url: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    async with asyncio.timeout(WAIT_S):
        async with websockets.connect(url, additional_headers=headers) as ws:
            return dict(json.loads(await ws.recv()))


async def assert_no_stream_left(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.url, headers=bearer(ADMIN), timeout=WAIT_S) as client:  # metrics:read
        async with asyncio.timeout(WAIT_S):
            while True:
                text = (await client.get("/metrics")).text
                lines = [
                    ln
                    for ln in text.splitlines()
                    if ln.startswith(("switchboard_ws_connections ", "switchboard_event_subscribers "))
                ]
                if all(ln.endswith(" 0.0") for ln in lines) and len(lines) == 2:
                    return
                await asyncio.sleep(0.02)


async def test_no_or_invalid_credential_is_closed_4401(server: Server):
    sid = await new_session(server)
    for url in (f"{server.ws_url}/v1/sessions/{sid}/events", f"{server.ws_url}/v1/events"):
        assert await refused(url) == (4401, "unauthenticated")
        assert await refused(url, bearer("wrong-key-0123456789abcdef")) == (4401, "invalid_key")
        assert await refused(url + "?token=wrong-key-0123456789abcdef") == (4401, "key_in_url")
        assert (await refused(url, {"Authorization": f"Basic {READER}"}))[0] == 4401  # not a bearer credential
    # an unknown session is not revealed to an unauthenticated client
    assert (await refused(f"{server.ws_url}/v1/sessions/nope/events"))[0] == 4401
    await assert_no_stream_left(server)


async def test_key_without_events_read_is_closed_4403(server: Server):
    sid = await new_session(server)
    for url in (f"{server.ws_url}/v1/sessions/{sid}/events", f"{server.ws_url}/v1/events"):
        assert await refused(url, bearer(NO_EVENTS)) == (4403, "forbidden")
        sep = "&" if "?" in url else "?"
        assert await refused(f"{url}{sep}token={NO_EVENTS}") == (4401, "key_in_url")
    await assert_no_stream_left(server)


async def test_key_with_events_read_works_in_the_header_not_the_url(server: Server):
    sid = await new_session(server)
    session_url = f"{server.ws_url}/v1/sessions/{sid}/events"
    for frame in (
        await first_frame(session_url, bearer(READER)),
        await first_frame(f"{session_url}?since=0", bearer(ADMIN)),
    ):
        assert frame["session_id"] == sid and frame["seq"] == 1 and frame["type"] == "session.started"
    multi_url = f"{server.ws_url}/v1/events?session_ids={sid}"
    frame = await first_frame(multi_url, bearer(READER))
    assert frame["session_id"] == sid and frame["type"] == "session.started" and isinstance(frame["cursor"], int)
    # keys in URLs end up in logs and histories: refused, however the parameter's name is spelled
    for url in (
        f"{session_url}?token={READER}",
        f"{session_url}?since=0&tok%65n={ADMIN}",
        f"{multi_url}&token={READER}",
    ):
        assert await refused(url) == (4401, "key_in_url")
    await assert_no_stream_left(server)


async def test_session_token_reads_its_own_session_only(server: Server):
    mine, other = await new_session(server), await new_session(server)
    token = await session_token(server, mine)
    frame = await first_frame(f"{server.ws_url}/v1/sessions/{mine}/events?token={token}")
    assert frame["session_id"] == mine and frame["type"] == "session.started"
    frame = await first_frame(f"{server.ws_url}/v1/sessions/{mine}/events", bearer(token))
    assert frame["session_id"] == mine
    assert await refused(f"{server.ws_url}/v1/sessions/{other}/events?token={token}") == (4403, "forbidden")
    assert await refused(f"{server.ws_url}/v1/sessions/{other}/events", bearer(token)) == (4403, "forbidden")
    assert await refused(f"{server.ws_url}/v1/events?token={token}") == (4403, "forbidden")
    assert await refused(f"{server.ws_url}/v1/events?session_ids={mine}", bearer(token)) == (4403, "forbidden")
    await assert_no_stream_left(server)


async def test_tampered_or_expired_token_is_closed_4401(server: Server):
    mine, other = await new_session(server), await new_session(server)
    token = await session_token(server, mine)
    other_token = await session_token(server, other)
    payload, _, sig = token.partition(".")
    other_payload = other_token.partition(".")[0]
    bad_sig = sig[:-2] + ("AA" if not sig.endswith("AA") else "BB")
    expired, _ = issue_token(Settings(token_secret=SECRET, api_keys=[]), mine, ttl_s=-5)
    forged, _ = issue_token(Settings(token_secret="not-the-server-secret-0123456789", api_keys=[]), mine, ttl_s=60)
    cases = {
        "bad signature": (f"{payload}.{bad_sig}", "invalid_token"),
        "payload of another session": (f"{other_payload}.{sig}", "invalid_token"),
        "no signature": (payload, "invalid_token"),
        "garbage": ("sbt_garbage", "invalid_token"),
        "wrong secret": (forged, "invalid_token"),
        "expired": (expired, "token_expired"),
    }
    for name, (credential, reason) in cases.items():
        for url, headers in (
            (f"{server.ws_url}/v1/sessions/{mine}/events?token={credential}", None),
            (f"{server.ws_url}/v1/sessions/{mine}/events", bearer(credential)),
        ):
            assert await refused(url, headers) == (4401, reason), name
    await assert_no_stream_left(server)


async def test_credentials_never_reach_the_server_log(server: Server):
    sid = await new_session(server)
    token = await session_token(server, sid)
    expired, _ = issue_token(Settings(token_secret=SECRET, api_keys=[]), sid, ttl_s=-5)
    await first_frame(f"{server.ws_url}/v1/sessions/{sid}/events?token={token}")
    await refused(f"{server.ws_url}/v1/sessions/{sid}/events?since=0&token={READER}&types=session.*")
    await refused(f"{server.ws_url}/v1/events?tok%65n={ADMIN}")  # the server decodes the name; so does redaction
    await first_frame(f"{server.ws_url}/v1/events", bearer(ADMIN))
    await refused(f"{server.ws_url}/v1/events?token={token}")
    await refused(f"{server.ws_url}/v1/sessions/{sid}/events?token={expired}")
    await refused(f"{server.ws_url}/v1/sessions/{sid}/events?token={NO_EVENTS}")
    # a key in the wrong place is still a key: beside a session token, under another name, in a path
    both = f"{server.ws_url}/v1/sessions/{sid}/events?token={READER}&token={token}"
    assert await refused(both) == (4401, "key_in_url")
    await refused(f"{server.ws_url}/v1/events?api_key={ADMIN}")
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        assert (await client.get(f"/v1/sessions?key={READER}")).status_code == 401
        assert (await client.get(f"/v1/sessions/{NO_EVENTS}", headers=bearer(ADMIN))).status_code == 404
        assert (await client.get(f"/v1/sessions/{sid}", headers=bearer(token))).status_code == 200
        assert (
            await client.get(f"/v1/sessions/{sid}", params={"token": ADMIN}, headers=bearer(READER))
        ).status_code == 200
        assert (
            await client.post(f"/v1/sessions/{sid}/input", json={"text": "hi"}, headers=bearer(READER))
        ).status_code == 403
        assert (await client.get("/v1/sessions", headers=bearer(expired))).status_code == 401
    await asyncio.sleep(0.2)  # let the server write its last lines
    log = server.logs()
    assert f"/v1/sessions/{sid}/events" in log, "the log does not show the requests: this test would prove nothing"
    for secret in (
        ADMIN,
        READER,
        NO_EVENTS,
        SECRET,
        token,
        expired,
        token.partition(".")[2],
        expired.partition(".")[2],
    ):
        assert secret not in log, f"a credential is in the server log: {secret[:12]}..."


async def test_ag_ui_stream_is_authenticated_like_the_event_streams(server: Server):
    mine, other = await new_session(server), await new_session(server)
    token = await session_token(server, mine)

    async def status(sid: str, headers: dict[str, str] | None = None, query: str = "") -> tuple[int, str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=5) as client:
            async with client.stream("GET", f"/v1/sessions/{sid}/ag-ui{query}", headers=headers) as r:
                if r.status_code != 200:
                    await r.aread()
                    return r.status_code, r.json()["code"]
                async for line in r.aiter_lines():  # the first frame: the run that session.started opens
                    assert '"RUN_STARTED"' in line and f'"threadId":"{sid}"' in line
                    return 200, ""
        raise AssertionError("no frame")

    assert await status(mine) == (401, "unauthenticated")
    assert await status(mine, bearer("wrong-key-0123456789abcdef")) == (401, "invalid_key")
    assert await status(mine, query=f"?token={READER}") == (401, "key_in_url")
    assert await status("nope") == (401, "unauthenticated")  # an unknown session is not revealed
    assert await status(mine, bearer(NO_EVENTS)) == (403, "forbidden")
    assert await status(mine, bearer(READER)) == (200, "")
    assert await status(mine, query=f"?token={token}") == (200, "")
    assert await status(other, query=f"?token={token}") == (403, "forbidden")
    assert await status(other, bearer(token)) == (403, "forbidden")
    await assert_no_stream_left(server)
