"""A short soak for CI, as a leak check (not a speed check): steady traffic for ~15 s, sessions opened and closed
one after another with subscribers, tools, inputs and interrupts; once every session is closed, the server's asyncio
task count, event subscribers, WebSocket connections and live sessions are back at their baseline.
``bench/soak.py`` runs the same traffic for minutes and reports the memory and task slopes."""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest

from tests.waiting import WAIT_S

from .server import Server
from .traffic import quiesce, steady_traffic

pytestmark = pytest.mark.e2e

SOAK_S = float(os.environ.get("SWITCHBOARD_SOAK_TEST_S", "15"))
RETURNING = ("tasks", "subscribers", "ws_connections", "sessions_live")


@pytest.fixture
def soak_server(tmp_path) -> Iterator[Server]:
    srv = Server(tmp_path).start()
    try:
        yield srv
    finally:
        srv.stop()


async def test_steady_traffic_leaves_no_task_or_subscriber_behind(soak_server: Server):
    async with httpx.AsyncClient(base_url=soak_server.url, timeout=WAIT_S) as client:
        # warm up once (first-use imports, pools, caches), so that the baseline is the steady state
        await steady_traffic(soak_server, duration_s=0.5, lanes=1)
        idle = {"subscribers": 0.0, "ws_connections": 0.0, "sessions_live": 0.0}
        baseline = await quiesce(client, idle, tuple(idle))
        report = await steady_traffic(soak_server, duration_s=SOAK_S, lanes=3)
        print(f"\nsoak: {report.sessions} sessions in {SOAK_S:g} s\n{report.recorder.table()}")
        assert report.recorder.server_errors == 0 and report.recorder.transport_errors == 0, report.recorder.rows()
        assert report.sessions >= 10, report.sessions  # the traffic did run
        after = await quiesce(client, baseline, RETURNING)
        for key in RETURNING:
            assert after[key] <= baseline[key], (key, baseline, after)
        assert after["subscribers"] == 0 and after["ws_connections"] == 0 and after["sessions_live"] == 0, after
        print(f"baseline {baseline}\nafter    {after}")
    logs = soak_server.logs()
    assert "Traceback" not in logs, logs[-3000:]
