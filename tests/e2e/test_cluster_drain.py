"""A drain hands a session over with what it owes: real nodes on PostgreSQL and a Redis of the test's own. An input
accepted while its reply was still thinking (before the model's first token) is answered by the node that adopts the
session, as it would be after a SIGKILL; a drain never loses more than a crash."""

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


async def test_an_input_whose_reply_is_still_thinking_is_answered_after_a_drain(
    tmp_path: Path, database_url: str, redis: RedisServer
) -> None:
    env = {"SWITCHBOARD_CLUSTER_SECRET": SECRET}
    a, b = (cluster_node(tmp_path, database_url, f"node-{x}", redis.url, **env) for x in "ab")
    await start_all([a, b])
    try:
        slow = {"text": "Here is your answer.", "ttft_ms": 4000}  # the model takes its time, before and after
        llm = {"provider": "scripted", "turns": [slow], "fallback": slow}
        async with httpx.AsyncClient(timeout=30) as http:
            r = await http.post(
                f"{a.url}/v1/sessions", json={"agent": "tester", "llm": llm}, headers={FORWARDED: SECRET}
            )
            assert r.status_code == 201 and r.json()["owner_node"] == "node-a", r.text
            sid = r.json()["id"]
            accepted = await http.post(f"{a.url}/v1/sessions/{sid}/input", json={"text": "What is the answer?"})
            assert accepted.status_code == 202, accepted.text
            speech_id = accepted.json()["speech_id"]
            async with asyncio.timeout(WAIT_S):  # thinking: the model has been asked, nothing heard yet
                while (await http.get(f"{a.url}/v1/sessions/{sid}")).json()["agent_state"] != "thinking":
                    await asyncio.sleep(0.05)

            await asyncio.to_thread(drain_stop, a)  # SIGTERM: node-a hands the session over and exits

            async with asyncio.timeout(60):
                while not any(
                    i.get("role") == "assistant" and i.get("text") == "Here is your answer."
                    for i in await _chat(http, b.url, sid)
                ):
                    await asyncio.sleep(0.1)
            speech = (await http.get(f"{b.url}/v1/sessions/{sid}/speeches/{speech_id}")).json()
            assert speech["state"] == "done" and not speech["interrupted"], speech
            assert (await http.get(f"{b.url}/v1/sessions/{sid}")).json()["owner_node"] == "node-b"
    finally:
        for node in (a, b):
            node.kill()
