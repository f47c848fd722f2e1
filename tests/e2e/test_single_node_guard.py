"""Two ``switchboard serve`` processes on one database, without cluster mode (SQLite file and PostgreSQL alike).

A second instance must not take over the sessions the first one is running: it waits for the first to stop, then
refuses to start with a message naming it. A first instance that stopped (SIGTERM) or died (SIGKILL) holds nothing.
And a process frozen past its lease, whose sessions another instance took over, never writes for them again: its
writes are refused in their own transaction, ``/readyz`` says it is fenced, and its commands answer 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import make_url

from tests.waiting import WAIT_S

from .server import Server
from .test_faults import PG_URL, pg_database

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]  # several server starts each, on a busy machine

REFUSAL = "another switchboard instance is running on this database"
CORRUPTION = ("UNIQUE constraint failed", "duplicate key value", "UniqueViolation")


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
async def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path}/shared.db"
        return
    async with pg_database() as name:
        yield make_url(PG_URL).set(database=name).render_as_string(hide_password=False)


def second_server(first: Server, **env: str) -> Server:
    """Another instance on ``first``'s database, with its own port and log."""
    return Server(first.tmp_path, database_url=first.database_url, **env)


async def create(client: httpx.AsyncClient, turns: list[dict[str, Any]]) -> str:
    body = {"agent": "tester", "llm": {"provider": "scripted", "turns": turns, "fallback": {"text": "Noted."}}}
    r = await client.post("/v1/sessions", json=body)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


async def say_and_settle(client: httpx.AsyncClient, sid: str, text: str) -> None:
    r = await client.post(f"/v1/sessions/{sid}/input", json={"text": text})
    assert r.status_code == 202, r.text
    async with asyncio.timeout(WAIT_S):
        while True:
            chat = (await client.get(f"/v1/sessions/{sid}/chat")).json()["items"]
            if any(i.get("role") == "assistant" for i in chat[-1:]):
                return
            await asyncio.sleep(0.02)


async def chat_texts(client: httpx.AsyncClient, sid: str) -> list[str]:
    r = await client.get(f"/v1/sessions/{sid}/chat")
    assert r.status_code == 200, r.text
    return [f"{i['role']}:{i['text']}" for i in r.json()["items"] if i["type"] == "message"]


def wait_exit(server: Server, timeout_s: float) -> int:
    assert server.proc is not None
    return server.proc.wait(timeout_s)


async def wait_ready(server: Server, timeout_s: float) -> None:
    async with asyncio.timeout(timeout_s), httpx.AsyncClient(base_url=server.url, timeout=1) as client:
        while True:
            assert server.proc is not None and server.proc.poll() is None, server.logs()
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get("/readyz")).status_code == 200:
                    return
            await asyncio.sleep(0.05)


async def test_a_second_instance_refuses_to_start_while_the_first_runs(tmp_path: Path, database_url: str) -> None:
    """The reported bug: the second instance recovered the first one's sessions and both wrote (a UNIQUE violation
    on chat_items, input answered 500, the session still read active, /readyz ok on both)."""
    first = Server(tmp_path, database_url=database_url).start(timeout=60)
    second = second_server(first, SWITCHBOARD_TAKEOVER_WAIT_S="1")
    try:
        async with httpx.AsyncClient(base_url=first.url, timeout=10) as client:
            sid = await create(client, [])
            await say_and_settle(client, sid, "one")
            second.launch()
            code = await asyncio.to_thread(wait_exit, second, WAIT_S)
            assert code != 0, second.logs()
            assert REFUSAL in second.logs() and "stop it first" in second.logs()
            # the first instance runs on, alone: its session answers, and nothing was written twice
            await say_and_settle(client, sid, "two")
            assert await chat_texts(client, sid) == ["user:one", "assistant:Noted.", "user:two", "assistant:Noted."]
            assert (await client.get("/readyz")).status_code == 200
            session = (await client.get(f"/v1/sessions/{sid}")).json()
            assert session["state"] == "active" and session["owner_node"] is not None
            nodes = (await client.get("/v1/cluster/nodes")).json()["items"]
            assert [(n["state"], n["mode"], n["sessions"]) for n in nodes] == [("live", "single", 1)]
        assert not any(marker in first.logs() for marker in CORRUPTION), first.logs()
    finally:
        second.kill()
        first.stop()


async def test_a_second_instance_waits_for_the_first_to_stop_then_takes_its_sessions_over(
    tmp_path: Path, database_url: str
) -> None:
    """An overlapping deploy: the new process starts while the old one still runs, and serves once it stopped."""
    first = Server(tmp_path, database_url=database_url).start(timeout=60)
    second = second_server(first, SWITCHBOARD_TAKEOVER_WAIT_S="30")
    try:
        async with httpx.AsyncClient(base_url=first.url, timeout=10) as client:
            sid = await create(client, [])
            await say_and_settle(client, sid, "before the deploy")
            first_node = (await client.get(f"/v1/sessions/{sid}")).json()["owner_node"]
        second.launch()
        await asyncio.sleep(1.0)
        assert second.proc is not None and second.proc.poll() is None
        async with httpx.AsyncClient(base_url=second.url, timeout=0.5) as probe:
            with pytest.raises(httpx.HTTPError):
                await probe.get("/readyz")  # still waiting: not serving
        first.stop()
        await wait_ready(second, 60)
        async with httpx.AsyncClient(base_url=second.url, timeout=10) as client:
            session = (await client.get(f"/v1/sessions/{sid}")).json()
            assert session["state"] == "active" and session["owner_node"] not in (None, first_node)
            await say_and_settle(client, sid, "after the deploy")
            assert await chat_texts(client, sid) == [
                "user:before the deploy",
                "assistant:Noted.",
                "user:after the deploy",
                "assistant:Noted.",
            ]
    finally:
        second.stop()
        first.kill()


async def test_an_instance_that_died_holds_nothing(tmp_path: Path, database_url: str) -> None:
    """SIGKILL leaves a lease behind; the process is gone, so the next instance on this host starts at once."""
    first = Server(tmp_path, database_url=database_url).start(timeout=60)
    async with httpx.AsyncClient(base_url=first.url, timeout=10) as client:
        sid = await create(client, [])
        await say_and_settle(client, sid, "hello")
    first.kill()
    # no wait allowed: it starts only if it sees at once that the lease left behind is held by nobody
    second = second_server(first, SWITCHBOARD_TAKEOVER_WAIT_S="0")
    try:
        second.start(timeout=60)
        async with httpx.AsyncClient(base_url=second.url, timeout=10) as client:
            await say_and_settle(client, sid, "again")
            assert await chat_texts(client, sid) == ["user:hello", "assistant:Noted.", "user:again", "assistant:Noted."]
    finally:
        second.stop()


async def test_a_frozen_instance_whose_sessions_moved_never_writes_for_them_again(
    tmp_path: Path, database_url: str
) -> None:
    """SIGSTOP the first instance past its lease (a paused VM, a partition); the second takes over; SIGCONT the
    first: its pending writes are refused, it says it is fenced, and the session is intact on the second."""
    lease = {"SWITCHBOARD_LEASE_S": "1"}
    first = Server(tmp_path, database_url=database_url, **lease).start(timeout=60)
    second = second_server(first, SWITCHBOARD_TAKEOVER_WAIT_S="30", **lease)
    stopped = False
    try:
        # PostgreSQL: a session that writes all the time (a background tool reporting progress every 50 ms). SQLite:
        # an idle one, as a process frozen inside a write transaction keeps the whole file locked until it resumes.
        busy = not database_url.startswith("sqlite")
        async with httpx.AsyncClient(base_url=first.url, timeout=10) as client:
            steps = [{"text": "Counting.", "tool_calls": [{"name": "progress", "arguments": {"steps": 400}}]}]
            sid = await create(client, steps if busy else [])
            if busy:
                assert (await client.post(f"/v1/sessions/{sid}/input", json={"text": "count"})).status_code == 202
                await asyncio.sleep(0.5)
            else:
                await say_and_settle(client, sid, "count")
                await asyncio.sleep(1.0)  # its last events written: not frozen inside a write transaction
            assert first.proc is not None
            os.kill(first.proc.pid, signal.SIGSTOP)
            stopped = True
            second.launch()
            await wait_ready(second, 60)
            async with httpx.AsyncClient(base_url=second.url, timeout=10) as other:
                moved = (await other.get(f"/v1/sessions/{sid}")).json()
                assert moved["state"] == "active" and moved["owner_node"] not in (None,)
                before = (await other.get(f"/v1/sessions/{sid}/chat")).json()["items"]
                os.kill(first.proc.pid, signal.SIGCONT)
                stopped = False
                # it finds out: on the way it may first say its database is unreachable (the connection it held
                # while frozen was ended by the server), never ready
                seen = []
                async with asyncio.timeout(WAIT_S):
                    while (r := await client.get("/readyz")).json()["status"] != "fenced":
                        seen.append(r.json()["status"])
                        await asyncio.sleep(0.05)
                assert r.status_code == 503, r.text
                assert set(seen) <= {"ok", "unavailable"}, seen
                r = await client.post(f"/v1/sessions/{sid}/input", json={"text": "to the old one"})
                assert r.status_code == 503 and r.json()["code"] in ("session_moved", "node_fenced"), r.text
                await asyncio.sleep(0.5)  # the old instance's tool would have reported many times by now
                after = (await other.get(f"/v1/sessions/{sid}/chat")).json()["items"]
                assert after[: len(before)] == before
                assert not any("to the old one" in str(i) for i in after)
                calls = (await other.get(f"/v1/sessions/{sid}/tool-calls")).json()["items"]
                # the call the old instance was running ended once, by the new owner's recovery
                assert [c["status"] for c in calls] == (["interrupted"] if busy else [])
                await say_and_settle(other, sid, "to the new one")
        logs = first.logs() + second.logs()
        assert not any(marker in logs for marker in CORRUPTION), logs
        assert "fenced" in first.logs()
    finally:
        if stopped and first.proc is not None:
            os.kill(first.proc.pid, signal.SIGCONT)
        second.stop()
        first.kill()
