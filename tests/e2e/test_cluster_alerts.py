"""Alerts in a cluster: two real nodes on PostgreSQL and a Redis of the test's own, both with the same sink (a real
receiver on 127.0.0.1 that verifies every message with the ``standardwebhooks`` library). A tool that failed alerts
once, from the node running the session; the session is drained to the other node, which finds the alert open and
does not send it again; the session closes there, and the "cleared" is sent once."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from tests.alert_receiver import AlertReceiver
from tests.waiting import WAIT_S

from .cluster_support import FORWARDED, SECRET, RedisServer, cluster_node, drain_stop, start_all

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.timeout(240)]


async def test_an_alert_is_sent_once_across_two_nodes_and_a_drain(
    tmp_path: Path, database_url: str, redis: RedisServer
) -> None:
    async with AlertReceiver() as receiver:
        sinks = [{"name": "ops", "url": receiver.url, "secret": receiver.secret, "reasons": ["tool_failed"]}]
        env = {
            "SWITCHBOARD_CLUSTER_SECRET": SECRET,
            "SWITCHBOARD_ALERT_SINKS": json.dumps(sinks),
            "SWITCHBOARD_ALERT_INTERVAL_S": "0.2",
        }
        a, b = (cluster_node(tmp_path, database_url, f"node-{x}", redis.url, **env) for x in "ab")
        await start_all([a, b])
        try:
            llm = {"provider": "scripted", "turns": [{"tool_calls": [{"name": "fail", "arguments": {}}]}]}
            async with httpx.AsyncClient(timeout=WAIT_S) as http:
                r = await http.post(
                    f"{a.url}/v1/sessions", json={"agent": "tester", "llm": llm}, headers={FORWARDED: SECRET}
                )
                assert r.status_code == 201 and r.json()["owner_node"] == "node-a", r.text
                sid = r.json()["id"]
                assert (await http.post(f"{a.url}/v1/sessions/{sid}/input", json={"text": "go"})).status_code == 202
                opened = await receiver.next()
                assert opened.type == "alert.opened" and opened.data["session_id"] == sid
                assert opened.data["reason"] == "tool_failed"

                await asyncio.to_thread(drain_stop, a)  # node-a hands the session over and exits

                async with asyncio.timeout(WAIT_S):  # node-b runs it, with its alert open (found, not opened)
                    while True:
                        owner = (await http.get(f"{b.url}/v1/sessions/{sid}")).json().get("owner_node")
                        metrics = (await http.get(f"{b.url}/metrics")).text
                        if owner == "node-b" and "\nswitchboard_alerts_open 1.0" in metrics:
                            break
                        await asyncio.sleep(0.1)
                items = (await http.get(f"{b.url}/v1/alerts")).json()["items"]
                assert [i["id"] for i in items] == [opened.data["alert_id"]]

                assert (await http.delete(f"{b.url}/v1/sessions/{sid}")).status_code == 204
                cleared = await receiver.next()
                assert cleared.type == "alert.cleared" and cleared.data["alert_id"] == opened.data["alert_id"]
            # a sink's deliveries go in order: anything node-b had opened again would have come before its clear
            assert [m.type for m in receiver.messages] == ["alert.opened", "alert.cleared"]
            assert receiver.bad_signatures == 0
        finally:
            for node in (a, b):
                node.kill()
