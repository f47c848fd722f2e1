"""An operator's takeover is durable across the cluster: real nodes on PostgreSQL and a Redis of the test's own. Taken
over through one node while another runs the session (the routing seam sends each command to the owner), the
session stays held when its node drains or dies: the node that adopts it asks the model for nothing, and the
hand-back, sent to any node, has the agent answer the user's last input."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from .cluster_support import FORWARDED, SECRET, RedisServer, cluster_node, drain_stop, retried, start_all, until

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.timeout(240)]


async def _events(http: httpx.AsyncClient, url: str, sid: str) -> list[dict[str, Any]]:
    r = await http.get(f"{url}/v1/sessions/{sid}/export")
    assert r.status_code == 200, r.text
    return list(r.json()["events"])


async def _generations(http: httpx.AsyncClient, url: str, sid: str) -> int:
    return sum(1 for e in await _events(http, url, sid) if e["type"] == "generation.started")


@pytest.mark.parametrize("how", ["drain", "kill"])
async def test_a_held_session_stays_held_when_its_node_goes(
    how: str, tmp_path: Path, database_url: str, redis: RedisServer
) -> None:
    env = {"SWITCHBOARD_CLUSTER_SECRET": SECRET}
    a, b = (cluster_node(tmp_path, database_url, f"node-{x}", redis.url, **env) for x in "ab")
    await start_all([a, b])
    try:
        turns = [{"text": "Welcome to the desk."}, {"text": "The agent again: your refund is on its way."}]
        llm = {"provider": "scripted", "turns": turns}
        async with httpx.AsyncClient(timeout=30) as http:
            r = await http.post(
                f"{a.url}/v1/sessions", json={"agent": "tester", "llm": llm}, headers={FORWARDED: SECRET}
            )
            assert r.status_code == 201 and r.json()["owner_node"] == "node-a", r.text
            sid = r.json()["id"]
            base_b = f"{b.url}/v1/sessions/{sid}"
            assert (await http.post(f"{base_b}/input", json={"text": "hi"})).status_code == 202
            await until(lambda: _spoke(http, b.url, sid, "Welcome to the desk."))

            held = await http.post(f"{base_b}/takeover", json={})  # sent to node-b, applied by node-a
            assert held.status_code == 200, held.text
            assert (await http.get(f"{base_b}")).json()["takeover"]["operator"] == "anonymous"
            asked = await _generations(http, b.url, sid)

            if how == "drain":
                await asyncio.to_thread(drain_stop, a)  # SIGTERM: node-a hands the session over and exits
            else:
                a.kill()  # node-b adopts it once node-a's lease runs out

            async def adopted() -> bool:
                session = (await http.get(base_b)).json()
                return session["owner_node"] == "node-b" and session["state"] == "active"

            await until(adopted, timeout_s=60)
            session = (await http.get(base_b)).json()
            assert session["takeover"]["operator"] == "anonymous"
            assert session["takeover"]["since"] == held.json()["since"]
            r = await retried(lambda: http.post(f"{base_b}/input", json={"text": "is anybody there?"}))
            assert r.status_code == 202 and r.json()["speech_id"] is None, r.text
            r = await retried(lambda: http.post(f"{base_b}/takeover/say", json={"text": "Yes, a person is here."}))
            assert r.status_code == 202, r.text
            await until(lambda: _spoke(http, b.url, sid, "Yes, a person is here."))
            r = await retried(lambda: http.post(f"{base_b}/input", json={"text": "and my refund?"}))
            assert r.status_code == 202, r.text
            assert await _generations(http, b.url, sid) == asked  # held on the new node too: no model turn

            back = await retried(lambda: http.delete(f"{base_b}/takeover"))
            assert back.status_code == 200 and back.json()["speech_id"], back.text
            await until(lambda: _spoke(http, b.url, sid, "The agent again: your refund is on its way."))
            assert (await http.get(base_b)).json()["takeover"] is None
            assert await _generations(http, b.url, sid) == asked + 1  # the reply to the hand-back, and nothing else
    finally:
        for node in (a, b):
            node.kill()


async def _spoke(http: httpx.AsyncClient, url: str, sid: str, text: str) -> bool:
    r = await http.get(f"{url}/v1/sessions/{sid}/chat", params={"limit": 1000})
    return r.status_code == 200 and any(
        i.get("role") == "assistant" and i.get("text") == text for i in r.json()["items"]
    )
