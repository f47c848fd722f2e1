"""PostgreSQL connections reset under a real ``switchboard serve`` (a proxy of the test's own between it and the
machine's PostgreSQL): requests answer 503 with ``Retry-After``, never 500, and succeed once the proxy forwards again;
a start that overlaps the resets waits for the database, and gives up with its own exit status only when the database
stays unavailable."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import make_url

from switchboard.control.settings import ALL_SCOPES

from ..pg_proxy import ResettingProxy
from ..waiting import WAIT_S
from .server import Server
from .test_faults import PG_URL, pg_database

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.timeout(180)]

KEY = "reset-test-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
# what a client retries after Retry-After: the database is unavailable, or the request ran out of time waiting for it
RETRYABLE = {"database_unavailable", "unavailable", "deadline_exceeded"}
BOUND_S = 60.0  # generous, for a loaded machine


@contextlib.asynccontextmanager
async def database_behind_proxy() -> AsyncIterator[tuple[str, ResettingProxy]]:
    """A database of its own, and the URL that reaches it through a ``ResettingProxy``."""
    async with pg_database() as name:
        url = make_url(PG_URL)
        proxy = await ResettingProxy(url.host or "127.0.0.1", url.port or 5432).start()
        try:
            yield proxy.url_through(url.set(database=name).render_as_string(hide_password=False)), proxy
        finally:
            await proxy.aclose()


def node(tmp_path: Path, database_url: str, **env: str) -> Server:
    return Server(
        tmp_path,
        database_url=database_url,
        SWITCHBOARD_API_KEYS=json.dumps([{"key": KEY, "scopes": list(ALL_SCOPES)}]),
        SWITCHBOARD_REQUEST_TIMEOUT_S="2",
        **env,
    )


async def until(predicate: Callable[[], bool], what: str) -> None:
    async with asyncio.timeout(BOUND_S):
        while not predicate():
            await asyncio.sleep(0.02)
    assert predicate(), what


def assert_retryable(r: httpx.Response) -> None:
    assert r.status_code == 503, (r.request.method, r.request.url.path, r.status_code, r.text)
    assert r.json()["code"] in RETRYABLE, r.text
    assert int(r.headers["retry-after"]) >= 1, r.headers


async def test_requests_on_reset_connections_answer_503_and_succeed_once_the_database_is_back(tmp_path: Path) -> None:
    async with database_behind_proxy() as (url, proxy):
        server = node(tmp_path, url)
        await asyncio.to_thread(server.start)  # the proxy runs in this loop: never block it
        try:
            async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=30) as client:
                llm = {
                    "provider": "scripted",
                    "turns": [{"tool_calls": [{"name": "search", "arguments": {"query": "x", "seconds": 120}}]}],
                }
                # the requests before and after the resets are sent as a client sends them, again under their key
                # while the answer is a retryable 503: the 2 s deadline is overrun now and then on a loaded machine
                body = {"agent": "tester", "llm": {**llm, "fallback": {}}}
                r = await settled(lambda h=keyed(): client.post("/v1/sessions", json=body, headers=h))
                assert r.status_code == 201, r.text
                sid = r.json()["id"]
                r = await settled(
                    lambda h=keyed(): client.post(f"/v1/sessions/{sid}/input", json={"text": "search"}, headers=h)
                )
                assert r.status_code == 202, r.text
                call_id = await running_call(client, sid)
                r = await settled(lambda h=keyed(): client.post("/v1/sessions", json={"agent": "tester"}, headers=h))
                assert r.status_code == 201, r.text
                closed = r.json()["id"]
                assert (
                    await settled(lambda h=keyed(): client.delete(f"/v1/sessions/{closed}", headers=h))
                ).status_code == 204
                for _ in range(4):  # connections in the pool, each to be reset on its next use
                    assert (await settled(lambda: client.get(f"/v1/sessions/{closed}/chat"))).status_code == 200

                proxy.resetting = True
                key = {"Idempotency-Key": f"input-{uuid.uuid4()}"}
                requests: dict[str, Callable[[], Any]] = {
                    "read": lambda: client.get(f"/v1/sessions/{closed}/chat"),  # an ended session's: the database's
                    "list": lambda: client.get("/v1/sessions"),
                    "command": lambda: client.post(f"/v1/sessions/{sid}/input", json={"text": "again"}, headers=key),
                    "create": lambda: client.post("/v1/sessions", json={"agent": "tester"}),
                    "cancel": lambda: client.post(f"/v1/sessions/{sid}/tool-calls/{call_id}/cancel"),
                }
                for call in requests.values():
                    assert_retryable(await call())
                assert proxy.resets >= 2

                proxy.resetting = False
                # the database is back; as a client does, the input is sent again under its key
                r = await settled(lambda: client.post(f"/v1/sessions/{sid}/input", json={"text": "again"}, headers=key))
                assert r.status_code == 202, r.text
                assert (await settled(lambda: client.get(f"/v1/sessions/{closed}/chat"))).status_code == 200
                assert (await settled(lambda: client.get("/v1/sessions"))).status_code == 200
                r = await settled(lambda h=keyed(): client.post("/v1/sessions", json={"agent": "tester"}, headers=h))
                assert r.status_code == 201, r.text
                call = await ended(client, sid, call_id)
                assert call["status"] == "cancelled", call
                users = [i["text"] for i in await chat(client, sid) if i.get("role") == "user"]
                assert users.count("again") == 1, users  # the retry under its key: applied once
        finally:
            await asyncio.to_thread(server.stop)
        assert "internal_error" not in server.logs() and "unhandled error" not in server.logs(), server.logs()[-4000:]


def keyed() -> dict[str, str]:
    return {"Idempotency-Key": f"k-{uuid.uuid4()}"}


async def settled(request: Callable[[], Awaitable[httpx.Response]]) -> httpx.Response:
    """``request`` sent again while its answer is a retryable 503 (bounded by the shared ceiling), as a client does;
    one that changes anything carries an Idempotency-Key, the same on each try (``lambda h=keyed(): ...``)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while True:
        r = await request()
        if r.status_code != 503 or loop.time() > deadline:
            return r
        assert_retryable(r)
        await asyncio.sleep(0.2)


async def running_call(client: httpx.AsyncClient, sid: str) -> str:
    async with asyncio.timeout(BOUND_S):
        while True:
            r = await client.get(f"/v1/sessions/{sid}/tool-calls", params={"status": "running"})
            items = r.json()["items"] if r.status_code == 200 else []
            if items:
                return str(items[0]["call_id"])
            await asyncio.sleep(0.05)


async def ended(client: httpx.AsyncClient, sid: str, call_id: str) -> dict[str, Any]:
    async with asyncio.timeout(BOUND_S):
        while True:
            r = await client.get(f"/v1/sessions/{sid}/tool-calls/{call_id}")
            if r.status_code == 200 and r.json()["status"] != "running":
                return dict(r.json())
            await asyncio.sleep(0.05)


async def chat(client: httpx.AsyncClient, sid: str) -> list[dict[str, Any]]:
    r = await client.get(f"/v1/sessions/{sid}/chat")
    assert r.status_code == 200, r.text
    return list(r.json()["items"])


async def test_a_start_while_the_database_refuses_and_resets_connections_waits_for_it(tmp_path: Path) -> None:
    async with database_behind_proxy() as (url, proxy):
        server = node(tmp_path, url)
        proxy.refusing = True  # connections reset as they are accepted
        server.launch()
        try:
            await until(lambda: proxy.resets >= 2, "the node tried to reach its database again")
            proxy.refusing, proxy.resetting = False, True  # then reset in the middle of each handshake
            await until(lambda: proxy.resets >= 4, "the node tried to reach its database again")
            assert server.proc is not None and server.proc.poll() is None, server.logs()  # waiting, not exited (3)
            proxy.resetting = False
            async with asyncio.timeout(BOUND_S), httpx.AsyncClient(base_url=server.url, timeout=2) as client:
                while True:
                    assert server.proc.poll() is None, server.logs()
                    with contextlib.suppress(httpx.HTTPError):
                        if (await client.get("/readyz")).status_code == 200:
                            break
                    await asyncio.sleep(0.05)
            assert "the database is unavailable" in server.logs() and "retrying" in server.logs(), server.logs()
        finally:
            await asyncio.to_thread(server.stop)


async def test_a_start_whose_database_stays_unavailable_exits_with_its_own_status(tmp_path: Path) -> None:
    async with database_behind_proxy() as (url, proxy):
        server = node(tmp_path, url, SWITCHBOARD_DATABASE_WAIT_S="2")
        proxy.refusing = True
        server.launch()
        try:
            assert server.proc is not None
            status = await asyncio.to_thread(server.proc.wait, BOUND_S)
        finally:
            await asyncio.to_thread(server.stop)
        assert status == 4, (status, server.logs())  # 3 says another instance is running: not the case
        assert "not starting: the database is unavailable" in server.logs(), server.logs()
        assert proxy.resets >= 2  # it did try again
