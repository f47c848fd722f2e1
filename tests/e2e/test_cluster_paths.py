"""A path or query that cannot be sent on to the node that runs the session (a decoded control, an invalid
percent-escape) is answered 400 ``invalid_path`` by the node it reached, before anything is forwarded: never a 500
with a traceback. Two real nodes on PostgreSQL and a Redis of the test's own."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import websockets

from tests.waiting import WAIT_S

from .cluster_support import FORWARDED, SECRET, RedisServer, cluster_node, start_all

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.timeout(240)]

BAD_ESCAPES = ["a%zzb", "a%b", "a%"]
BAD_IDS = ["a%00b", "a%0Ab", "a%0d%0aX", "a%1B[2Jb", "a%7Fb", "a%C2%85b", *BAD_ESCAPES]


async def _sent_as_written(http: httpx.AsyncClient, method: str, base: str, target: str) -> httpx.Response:
    """``target`` sent exactly as written, not re-escaped by the client."""
    url = httpx.URL(base).copy_with(raw_path=target.encode())
    return await http.request(method, url, json={} if method == "POST" else None)


async def test_a_path_the_owner_cannot_be_sent_is_a_400_on_the_node_it_reached(
    tmp_path: Path, database_url: str, redis: RedisServer
) -> None:
    owner, other = (
        cluster_node(tmp_path, database_url, f"node-{x}", redis.url, SWITCHBOARD_CLUSTER_SECRET=SECRET) for x in "ab"
    )
    await start_all([owner, other])
    try:
        async with httpx.AsyncClient(timeout=30) as http:
            body = {"id": "p1", "agent": "tester"}
            created = await http.post(f"{owner.url}/v1/sessions", json=body, headers={FORWARDED: SECRET})
            assert created.status_code == 201 and created.json()["owner_node"] == "node-a", created.text
            refused = [("GET", f"/v1/sessions/p1/speeches/{bad}") for bad in BAD_IDS]  # a read the owner answers
            refused += [("POST", f"/v1/sessions/p1/tool-calls/{bad}/cancel") for bad in BAD_IDS]  # a command
            refused += [("GET", f"/v1/sessions/p1/speeches/s1?x={bad}") for bad in BAD_ESCAPES]
            for method, target in refused:
                r = await _sent_as_written(http, method, other.url, target)
                assert r.status_code == 400, (method, target, r.status_code, r.text)
                assert r.headers["content-type"] == "application/problem+json"
                assert r.json()["code"] == "invalid_path"
            # a query value that decodes to a control is a URL still: sent on as it came, the owner answers it
            for bad in BAD_IDS[:6]:
                r = await _sent_as_written(http, "GET", other.url, f"/v1/sessions/p1/speeches/s1?x={bad}")
                assert r.status_code == 404 and r.json()["code"] == "speech_not_found", r.text
            # a path that decodes to a slash is one segment on the owner (sent on as it came), not two
            r = await http.get(f"{other.url}/v1/sessions/p1/speeches/a%2Fb")
            assert r.status_code == 404 and r.json()["code"] != "invalid_path", r.text
            assert (await http.get(f"{other.url}/v1/sessions/p1")).json()["owner_node"] == "node-a"
        edge = f"{other.ws_url}/v1/sessions/p1/media?edge_id=e1&connection=1&x=%zz"
        async with websockets.connect(edge) as ws:
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), WAIT_S)
        assert closed.value.rcvd is not None
        assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (4400, "invalid_path")
    finally:
        await asyncio.gather(*(asyncio.to_thread(node.stop) for node in (owner, other)))
    assert "Traceback" not in other.logs() and "InvalidURL" not in other.logs()
