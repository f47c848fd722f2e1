"""Idempotency is the cluster's (I7): two real nodes on one PostgreSQL. The same create sent to both at once (a client
retrying after its load balancer timed out) makes one session and both answers name it; the same explicit id and
body sent to both at once is no conflict, with or without an Idempotency-Key."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .cluster_support import SECRET, RedisServer, cluster_node, start_all
from .server import Server

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.timeout(240)]

ROUNDS = 6


@pytest.fixture
async def two(tmp_path: Path, database_url: str, redis: RedisServer) -> AsyncIterator[tuple[Server, Server]]:
    nodes = [
        cluster_node(tmp_path, database_url, f"node-{x}", redis.url, SWITCHBOARD_CLUSTER_SECRET=SECRET) for x in "ab"
    ]
    try:
        await start_all(nodes)
        yield nodes[0], nodes[1]
    finally:
        for node in nodes:
            node.stop()


async def _both(http: httpx.AsyncClient, nodes: tuple[Server, ...], body: dict[str, Any], **headers: str) -> Any:
    """``body`` POSTed to /v1/sessions on every node at the same moment."""
    return await asyncio.gather(*(http.post(f"{n.url}/v1/sessions", json=body, headers=headers) for n in nodes))


async def _session_ids(http: httpx.AsyncClient, node: Server) -> set[str]:
    r = await http.get(f"{node.url}/v1/sessions", params={"limit": 200})
    assert r.status_code == 200, r.text
    return {s["id"] for s in r.json()["items"]}


async def test_one_key_sent_to_two_nodes_at_once_creates_one_session(two: tuple[Server, Server]):
    a, b = two
    async with httpx.AsyncClient(timeout=60) as http:
        for _ in range(ROUNDS):
            before = await _session_ids(http, a)
            answers = await _both(http, two, {"agent": "tester"}, **{"Idempotency-Key": uuid.uuid4().hex})
            assert [r.status_code for r in answers] == [201, 201], [r.text for r in answers]
            created = await _session_ids(http, b) - before
            assert len(created) == 1, f"one key made {len(created)} sessions: {created}"
            assert {r.json()["id"] for r in answers} == created
            assert sorted(r.headers.get("idempotent-replayed", "") for r in answers) == ["", "true"]


async def test_the_same_id_and_body_sent_to_two_nodes_at_once_is_no_conflict(two: tuple[Server, Server]):
    a, _ = two
    async with httpx.AsyncClient(timeout=60) as http:
        for round_ in range(ROUNDS):
            sid = f"twin-{round_}-{uuid.uuid4().hex[:8]}"
            keyed = {"Idempotency-Key": uuid.uuid4().hex} if round_ % 2 else {}
            answers = await _both(http, two, {"id": sid, "agent": "tester"}, **keyed)
            statuses = sorted(r.status_code for r in answers)
            assert all(r.json().get("id") == sid for r in answers), [r.text for r in answers]
            # one creates it; the other answers as for the same id again (200), or replays the create (201)
            assert statuses in ([200, 201], [201, 201]), [r.text for r in answers]
            if not keyed:
                assert statuses == [200, 201], [r.text for r in answers]
            else:
                assert sorted(r.headers.get("idempotent-replayed", "") for r in answers) == ["", "true"]
            assert sid in await _session_ids(http, a)
