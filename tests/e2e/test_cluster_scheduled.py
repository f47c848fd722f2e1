"""A drain hands over the scheduled commands and coaching notes a session holds: real nodes on PostgreSQL and a Redis
of the test's own. A command scheduled through another node (forwarded to the session's) and a note, both accepted
before node-a drains, are applied once by node-b, which adopts the session."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.waiting import WAIT_S

from .cluster_support import FORWARDED, SECRET, RedisServer, cluster_node, drain_stop, start_all

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.timeout(240)]


async def _chat(http: httpx.AsyncClient, url: str, sid: str) -> list[dict[str, Any]]:
    r = await http.get(f"{url}/v1/sessions/{sid}/chat", params={"limit": 1000})
    assert r.status_code == 200, r.text
    return list(r.json()["items"])


async def _state(http: httpx.AsyncClient, url: str, sid: str, command_id: str) -> str:
    r = await http.get(f"{url}/v1/sessions/{sid}/scheduled/{command_id}")
    assert r.status_code == 200, r.text
    return str(r.json()["state"])


async def test_a_drain_hands_over_what_is_scheduled_and_it_applies_once(
    tmp_path: Path, database_url: str, redis: RedisServer
) -> None:
    env = {"SWITCHBOARD_CLUSTER_SECRET": SECRET}
    a, b = (cluster_node(tmp_path, database_url, f"node-{x}", redis.url, **env) for x in "ab")
    await start_all([a, b])
    try:
        # the reply is still thinking at the drain, however loaded the machine (a minute, longer than the requests
        # before the drain could take): the drain is what ends it
        slow = {"text": "Thinking done.", "ttft_ms": 60_000}
        # node-b generates the owed reply anew (the script goes on where it was: the fallback), with the note
        llm = {"provider": "scripted", "turns": [slow], "fallback": {"text": "Noted: {{coach}}"}}
        async with httpx.AsyncClient(timeout=WAIT_S) as http:
            r = await http.post(
                f"{a.url}/v1/sessions", json={"agent": "tester", "llm": llm}, headers={FORWARDED: SECRET}
            )
            assert r.status_code == 201 and r.json()["owner_node"] == "node-a", r.text
            sid = r.json()["id"]
            assert (await http.post(f"{a.url}/v1/sessions/{sid}/input", json={"text": "hello"})).status_code == 202
            async with asyncio.timeout(WAIT_S):
                while (await http.get(f"{a.url}/v1/sessions/{sid}")).json()["agent_state"] != "thinking":
                    await asyncio.sleep(0.05)
            # through node-b: forwarded to node-a, which runs the session
            body = {"text": "are you still there?", "when": {"at": "idle"}}
            scheduled = await http.post(f"{b.url}/v1/sessions/{sid}/input", json=body)
            assert scheduled.status_code == 202, scheduled.text
            command_id = scheduled.json()["scheduled"]["id"]
            note = await http.post(f"{b.url}/v1/sessions/{sid}/coach", json={"note": "mention the refund"})
            assert note.status_code == 202, note.text
            note_id = note.json()["id"]
            assert await _state(http, b.url, sid, command_id) == "pending"  # read by any node, from the database

            await asyncio.to_thread(drain_stop, a)  # SIGTERM: node-a hands the session over and exits

            async with asyncio.timeout(60):
                while await _state(http, b.url, sid, command_id) != "applied":
                    await asyncio.sleep(0.1)
                while await _state(http, b.url, sid, note_id) != "applied":
                    await asyncio.sleep(0.1)
                while len([i for i in await _chat(http, b.url, sid) if i.get("role") == "assistant"]) < 2:
                    await asyncio.sleep(0.1)
            chat = await _chat(http, b.url, sid)
            users = [i["text"] for i in chat if i.get("role") == "user"]
            assert users == ["hello", "are you still there?"], chat
            said = [i["text"] for i in chat if i.get("role") == "assistant"]
            assert said == ["Noted: mention the refund", "Noted: <none>"], said
            assert not any(i.get("role") == "system" for i in chat)
            assert (await http.get(f"{b.url}/v1/sessions/{sid}")).json()["owner_node"] == "node-b"
    finally:
        for node in (a, b):
            node.kill()
