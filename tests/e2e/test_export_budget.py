"""Exports on a real server: at most so many at once (per API key, its tokens included, and per process), a slot given
back when the client goes away mid-export and when the export ends, and a key's exports paced to its bytes a second
(the document slower, never cut)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager

import httpx
import pytest

from tests.waiting import WAIT_S, until

from .server import Server

pytestmark = pytest.mark.e2e

ADMIN = "admin-key-0123456789abcdef"
VIEWER = "viewer-key-0123456789abcdef"  # mints read-only tokens for a dashboard
KEYS = [
    {"key": ADMIN, "scopes": ["sessions:read", "sessions:write", "sessions:control"]},
    {"key": VIEWER, "scopes": ["sessions:read"]},
]
BYTES_PER_S = 10_000
BURST_S = 1.0  # a key's exports may send a second of their budget at once (``export_budget.BYTES_BURST_S``)
TEXT = "x" * 20_000  # each input logs its text several times (the input, the chat item, the chat)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(
        tmp_path_factory.mktemp("exports"),
        SWITCHBOARD_API_KEYS=json.dumps(KEYS),
        SWITCHBOARD_MAX_TEXT_CHARS=str(len(TEXT)),
        SWITCHBOARD_EXPORT_MAX="3",
        SWITCHBOARD_EXPORT_MAX_PER_KEY="2",
        SWITCHBOARD_EXPORT_BYTES_PER_S=str(BYTES_PER_S),
    ).start()
    try:
        yield srv
    finally:
        srv.stop()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def session(server: Server, inputs: int) -> str:
    """A session whose log holds ``inputs`` long inputs."""
    async with httpx.AsyncClient(base_url=server.url, headers=bearer(ADMIN), timeout=WAIT_S) as client:
        r = await client.post("/v1/sessions", json={"agent": "tester", "llm": {"provider": "scripted", "turns": []}})
        assert r.status_code == 201, r.text
        sid = str(r.json()["id"])
        for _ in range(inputs):
            assert (await client.post(f"/v1/sessions/{sid}/input", json={"text": TEXT})).status_code == 202

        async def logged() -> bool:
            r = await client.get(f"/v1/sessions/{sid}/chat")
            return len(r.json()["items"]) >= inputs

        await until(logged)
        return sid


async def token(server: Server, sid: str) -> str:
    async with httpx.AsyncClient(base_url=server.url, headers=bearer(VIEWER), timeout=WAIT_S) as client:
        r = await client.post(f"/v1/sessions/{sid}/tokens", json={})
        assert r.status_code == 201, r.text
        return str(r.json()["token"])


@asynccontextmanager
async def exporting(client: httpx.AsyncClient, sid: str, credential: str) -> AsyncIterator[httpx.Response]:
    """An export under way: its answer has started (200), its document not read yet."""
    async with client.stream("GET", f"/v1/sessions/{sid}/export", headers=bearer(credential)) as r:
        assert r.status_code == 200, await r.aread()
        yield r


async def test_exports_beyond_the_caps_are_refused_and_slots_come_back(server: Server) -> None:
    """Thirty exports of one session by one read-only token held another session's interrupt up for seconds."""
    big = await session(server, inputs=8)  # a document of many times BYTES_PER_S: exported for a minute
    small = await session(server, inputs=0)
    one, two = await token(server, big), await token(server, big)  # two tokens of one key: one caller
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        async with AsyncExitStack() as running:
            first = await running.enter_async_context(exporting(client, big, one))
            await running.enter_async_context(exporting(client, big, two))
            refused = await client.get(f"/v1/sessions/{small}/export", headers=bearer(VIEWER))  # its tokens' two
            assert refused.status_code == 429, refused.text
            assert refused.headers["content-type"].startswith("application/problem+json")
            assert refused.json()["code"] == "too_many_exports" and int(refused.headers["Retry-After"]) >= 1
            # another key has slots of its own, up to the process's three
            await running.enter_async_context(exporting(client, big, ADMIN))
            full = await client.get(f"/v1/sessions/{small}/export", headers=bearer(ADMIN))
            assert full.status_code == 429 and full.json()["code"] == "too_many_exports", full.text
            assert "server" in full.json()["detail"]

            await first.aclose()  # the client goes away mid-export: its slot comes back

            async def started() -> bool:
                async with client.stream("GET", f"/v1/sessions/{small}/export", headers=bearer(VIEWER)) as r:
                    return r.status_code == 200

            await until(started, every_s=0.1)
        # an export that ends gives its slot back: one after another, never refused
        for _ in range(4):
            r = await client.get(f"/v1/sessions/{small}/export", headers=bearer(VIEWER))
            assert r.status_code == 200, r.text
            assert json.loads(r.content)["session"]["id"] == small


async def test_a_keys_exports_are_paced_to_its_bytes_a_second(server: Server) -> None:
    sid = await session(server, inputs=1)
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S * 2) as client:
        sent_at = time.monotonic()
        received: list[tuple[float, int]] = []
        body = bytearray()
        async with client.stream("GET", f"/v1/sessions/{sid}/export", headers=bearer(VIEWER)) as r:
            assert r.status_code == 200
            async for chunk in r.aiter_raw():
                body += chunk
                received.append((time.monotonic() - sent_at, len(body)))
    doc = json.loads(body)  # whole: paced, never cut
    assert doc["session"]["id"] == sid and doc["chat"][0]["text"] == TEXT
    assert len(body) > 4 * BYTES_PER_S * BURST_S
    # every byte the client had by then was paid for: what a key's exports send by t seconds is bounded
    for elapsed_s, count in received:
        assert count <= BYTES_PER_S * (elapsed_s + BURST_S), (elapsed_s, count)
    assert received[-1][0] >= len(body) / BYTES_PER_S - BURST_S
