"""Alerts end to end: a real ``switchboard serve`` process and a real webhook receiver on 127.0.0.1 that verifies every
message with the ``standardwebhooks`` library. A model that does not answer makes the session's speech stall: the sink
gets one ``alert.opened``; the operator interrupts: it gets one ``alert.cleared``. ``GET /v1/alerts``, the metrics and
the command line show it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.alert_receiver import AlertReceiver
from tests.waiting import WAIT_S

from .server import ROOT, Server

pytestmark = [pytest.mark.e2e]


async def delivered(client: httpx.AsyncClient, alert_id: str, transition: str) -> dict[str, object]:
    async with asyncio.timeout(WAIT_S):
        while True:
            items = (await client.get("/v1/alerts", params={"state": "all"})).json()["items"]
            alert = next(a for a in items if a["id"] == alert_id)
            states = [d["state"] for d in alert["deliveries"] if d["transition"] == transition]
            if states == ["delivered"]:
                return dict(alert)
            await asyncio.sleep(0.1)


async def test_a_stalled_speech_is_alerted_once_then_cleared_once(tmp_path: Path) -> None:
    async with AlertReceiver() as receiver:
        sinks = [{"name": "ops", "url": receiver.url, "secret": receiver.secret, "reasons": ["speech_stalled"]}]
        server = Server(
            tmp_path,
            SWITCHBOARD_ALERT_SINKS=json.dumps(sinks),
            SWITCHBOARD_ALERT_INTERVAL_S="0.2",
            SWITCHBOARD_ATTENTION_STALL_S="1",
        )
        await asyncio.to_thread(server.start)
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
                llm = {"provider": "scripted", "turns": [{"text": "late", "ttft_ms": 600_000}]}
                r = await client.post("/v1/sessions", json={"agent": "tester", "llm": llm})
                assert r.status_code == 201, r.text
                sid = r.json()["id"]
                r = await client.post(f"/v1/sessions/{sid}/input", json={"text": "hello"})
                assert r.status_code == 202, r.text
                opened = await receiver.next()
                assert opened.type == "alert.opened"
                assert opened.data["session_id"] == sid and opened.data["reason"] == "speech_stalled"
                alert = await delivered(client, opened.data["alert_id"], "opened")
                assert alert["cleared_at"] is None and alert["agent"] == "tester"
                open_now = (await client.get("/v1/alerts")).json()["items"]
                assert [a["id"] for a in open_now] == [opened.data["alert_id"]]

                r = await client.post(f"/v1/sessions/{sid}/interrupt", json={})
                assert r.status_code == 200, r.text
                cleared = await receiver.next()
                assert cleared.type == "alert.cleared" and cleared.data["alert_id"] == opened.data["alert_id"]
                alert = await delivered(client, opened.data["alert_id"], "cleared")
                assert alert["cleared_at"] is not None
                assert (await client.get("/v1/alerts")).json()["items"] == []
                metrics = (await client.get("/metrics")).text
                for transition in ("opened", "cleared"):
                    labels = f'sink="ops",state="delivered",transition="{transition}"'
                    line = f"switchboard_alert_deliveries_total{{{labels}}} 1.0"
                    assert line in metrics, metrics

                listing = await asyncio.to_thread(
                    subprocess.run,
                    [sys.executable, "-m", "switchboard.cli", "alerts", "--all", "--url", server.url],
                    capture_output=True,
                    text=True,
                    timeout=WAIT_S,
                    cwd=ROOT,
                )
                assert listing.returncode == 0, listing.stderr
                assert opened.data["alert_id"] in listing.stdout and "ops: delivered" in listing.stdout
            assert len(receiver.messages) == 2 and receiver.bad_signatures == 0
        finally:
            await asyncio.to_thread(server.stop)
