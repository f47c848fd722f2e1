"""Cluster mode with real processes on loopback and PostgreSQL: any node takes every command (forwarded to the owner,
idempotency included), and a node killed with SIGKILL has its sessions adopted by the others through recovery."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import make_url

from .server import EventStream, Server, free_port
from .test_faults import PG_URL, pg_database

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.timeout(240)]

LEASE_S = 8.0  # long enough for a loaded test machine (production default: 2 s)


@pytest.fixture
async def database_url() -> AsyncIterator[str]:
    async with pg_database() as name:
        yield make_url(PG_URL).set(database=name).render_as_string(hide_password=False)


class RedisServer:
    """A redis-server of this test's own on a free loopback port, to stop and start again."""

    def __init__(self, tmp_path: Path) -> None:
        self.port = free_port()
        self.dir = tmp_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen([*args, "--dir", str(self.dir)], stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def cluster_node(tmp_path: Path, database_url: str, node_id: str, redis_url: str) -> Server:
    return Server(
        tmp_path,
        database_url=database_url,
        SWITCHBOARD_REDIS_URL=redis_url,
        SWITCHBOARD_NODE_ID=node_id,
        SWITCHBOARD_LEASE_S=str(LEASE_S),
    )


async def create(client: httpx.AsyncClient, turns: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    llm = {"provider": "scripted", "turns": turns or [], "fallback": {"text": "Noted."}}
    r = await client.post("/v1/sessions", json={"agent": "tester", "llm": llm})
    assert r.status_code == 201, r.text
    return dict(r.json())


async def messages(client: httpx.AsyncClient, sid: str) -> list[str]:
    r = await client.get(f"/v1/sessions/{sid}/chat")
    assert r.status_code == 200, r.text
    return [f"{i['role']}:{i['text']}" for i in r.json()["items"] if i["type"] == "message"]


async def until(check: Any, timeout_s: float = 15.0) -> Any:
    async with asyncio.timeout(timeout_s):
        while not (found := await check()):
            await asyncio.sleep(0.05)
    return found


async def test_any_node_takes_commands_and_a_killed_nodes_sessions_are_adopted(
    tmp_path: Path, database_url: str, redis: RedisServer
):
    a = cluster_node(tmp_path, database_url, "node-a", redis.url).start(timeout=60)
    b = cluster_node(tmp_path, database_url, "node-b", redis.url).start(timeout=60)
    try:
        async with (
            httpx.AsyncClient(base_url=a.url, timeout=20) as on_a,
            httpx.AsyncClient(base_url=b.url, timeout=20) as on_b,
        ):
            nodes = (await on_b.get("/v1/cluster/nodes")).json()["items"]
            assert {(n["id"], n["state"], n["mode"]) for n in nodes} == {
                ("node-a", "live", "cluster"),
                ("node-b", "live", "cluster"),
            }
            session = await create(on_a)
            sid = session["id"]
            assert session["owner_node"] == "node-a"

            # a new session goes to the least-loaded node, wherever it is created
            placed = await create(on_a)
            assert placed["owner_node"] == "node-b", placed
            assert (await on_b.delete(f"/v1/sessions/{placed['id']}")).status_code == 204

            # a command sent to the other node is forwarded to the owner; a stream on the other node carries the
            # session's events live (through Redis), gap-free
            stream = await EventStream.open(b, sid)
            r = await on_b.post(f"/v1/sessions/{sid}/input", json={"text": "via b"})
            assert r.status_code == 202, r.text
            await until(lambda: _has(on_b, sid, "assistant:Noted.", 1))
            await stream.wait_for("speech.done", timeout=15)
            await stream.wait_for("user.input", lambda d: d["text"] == "via b")
            seqs = [f["seq"] for f in stream.frames]
            assert seqs == list(range(1, len(seqs) + 1)), seqs

            # Redis down: commands still work (forwarding needs no Redis); once it is back, the stream on the other
            # node repairs what it missed from the database, gap-free
            redis.stop()
            r = await on_b.post(f"/v1/sessions/{sid}/input", json={"text": "redis down"})
            assert r.status_code == 202, r.text
            ready = await until(lambda: _redis_reported_down(on_b))
            assert ready.status_code == 200 and "redis unavailable" in ready.json()["detail"]
            await until(lambda: _has(on_b, sid, "assistant:Noted.", 2))
            redis.start()
            await asyncio.sleep(3.0)  # the nodes reconnect (backoff at most 2 s)
            r = await on_b.post(f"/v1/sessions/{sid}/input", json={"text": "redis back"})
            assert r.status_code == 202, r.text
            await stream.wait_for("user.input", lambda d: d["text"] == "redis back", timeout=15)
            await stream.wait_for("user.input", lambda d: d["text"] == "redis down")
            seqs = [f["seq"] for f in stream.frames]
            assert seqs == list(range(1, len(seqs) + 1)), seqs
            await until(lambda: _has(on_b, sid, "assistant:Noted.", 3))
            await stream.close()

            # the same Idempotency-Key on both nodes: applied once, the same answer from both
            key = {"Idempotency-Key": f"k-{uuid.uuid4().hex}"}
            first = await on_a.post(f"/v1/sessions/{sid}/input", json={"text": "once"}, headers=key)
            second = await on_b.post(f"/v1/sessions/{sid}/input", json={"text": "once"}, headers=key)
            assert first.status_code == second.status_code == 202, (first.text, second.text)
            assert first.json() == second.json()
            assert second.headers.get("idempotent-replayed") == "true"
            await until(lambda: _has(on_a, sid, "assistant:Noted.", 4))
            assert (await messages(on_a, sid)).count("user:once") == 1

            # SIGKILL the owner: the other node adopts the session through recovery, with its context
            a.kill()
            killed = time.monotonic()
            moved = await until(lambda: _owner_is(on_b, sid, "node-b"), timeout_s=LEASE_S + 20)
            adopted_s = time.monotonic() - killed
            assert moved["state"] == "active"
            assert adopted_s < LEASE_S + 8.0, adopted_s
            r = await until(lambda: _accepted(on_b, sid, "after the kill"))  # 503 (retry) while being recovered
            await until(lambda: _has(on_b, sid, "assistant:Noted.", 5))
            assert await messages(on_b, sid) == [
                "user:via b",
                "assistant:Noted.",
                "user:redis down",
                "assistant:Noted.",
                "user:redis back",
                "assistant:Noted.",
                "user:once",
                "assistant:Noted.",
                "user:after the kill",
                "assistant:Noted.",
            ]
            nodes = {n["id"]: n for n in (await on_b.get("/v1/cluster/nodes")).json()["items"]}
            assert nodes["node-a"]["state"] == "dead" and nodes["node-b"]["sessions"] == 1
    finally:
        a.kill()
        b.stop()


async def _has(client: httpx.AsyncClient, sid: str, text: str, count: int) -> bool:
    return (await messages(client, sid)).count(text) >= count


async def _owner_is(client: httpx.AsyncClient, sid: str, node: str) -> dict[str, Any] | None:
    r = await client.get(f"/v1/sessions/{sid}")
    found = dict(r.json())
    return found if found.get("owner_node") == node else None


async def _accepted(client: httpx.AsyncClient, sid: str, text: str) -> httpx.Response | None:
    r = await client.post(f"/v1/sessions/{sid}/input", json={"text": text})
    if r.status_code == 503:
        assert r.json()["code"] == "session_recovering", r.text
        return None
    assert r.status_code == 202, r.text
    return r


async def _redis_reported_down(client: httpx.AsyncClient) -> httpx.Response | None:
    r = await client.get("/readyz")
    return r if "redis" in str(r.json().get("detail")) else None


async def test_a_media_edge_is_sent_to_the_node_that_runs_its_session(
    tmp_path: Path, database_url: str, redis: RedisServer
):
    from .edge_client import Edge

    a = cluster_node(tmp_path, database_url, "node-a", redis.url).start(timeout=60)
    b = cluster_node(tmp_path, database_url, "node-b", redis.url).start(timeout=60)
    try:
        async with httpx.AsyncClient(base_url=a.url, timeout=20) as on_a:
            session = await create(on_a)
            sid = session["id"]
            assert session["owner_node"] == "node-a"
            elsewhere = await Edge.connect(b.ws_url, sid)
            code, reason = await elsewhere.wait_closed()
            assert code == 4421 and "node-a" in reason and a.url in reason, (code, reason)
            edge = await Edge.connect(a.ws_url, sid)
            await edge.send({"type": "user.transcript", "text": "hello from the edge"})
            start = await edge.wait_for("speech.start", timeout=15)
            await edge.wait_for("speech.end", timeout=15)
            assert edge.texts[start["speech_id"]] == "Noted."
            await edge.close()
    finally:
        b.stop()
        a.stop()
