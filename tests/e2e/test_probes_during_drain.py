"""What the Kubernetes probes of deploy/kubernetes see while a node drains: a real cluster node on PostgreSQL and Redis,
stopped by SIGTERM while a tool that cannot be cancelled holds its hand-over open. Readiness (`/readyz`) fails, so no
new request reaches it; liveness (`/healthz`) holds, so it is not restarted in the middle of handing its sessions
over."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest

from tests.waiting import WAIT_S

from .cluster_support import SECRET, RedisServer, cluster_node, start_all, until

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.timeout(240)]


async def test_a_draining_node_fails_readiness_and_passes_liveness(
    tmp_path: Path, database_url: str, redis: RedisServer
) -> None:
    node = cluster_node(
        tmp_path,
        database_url,
        "node-a",
        redis.url,
        SWITCHBOARD_CLUSTER_SECRET=SECRET,
        # the hand-over gives the running tool this long to end: the drain lasts while the test looks at it
        SWITCHBOARD_SHUTDOWN_TOOL_GRACE_S=str(WAIT_S),
        SWITCHBOARD_DRAIN_TIMEOUT_S=str(2 * WAIT_S),
    )
    await start_all([node])
    try:
        async with httpx.AsyncClient(timeout=WAIT_S) as http:
            assert (await http.get(f"{node.url}/readyz")).status_code == 200
            slow = {"name": "slow", "arguments": {"seconds": 3 * WAIT_S}}  # `slow` cannot be cancelled
            llm = {"provider": "scripted", "turns": [{"text": "On it.", "tool_calls": [slow]}]}
            created = await http.post(f"{node.url}/v1/sessions", json={"agent": "tester", "llm": llm})
            assert created.status_code == 201, created.text
            sid = created.json()["id"]
            accepted = await http.post(f"{node.url}/v1/sessions/{sid}/input", json={"text": "Take your time."})
            assert accepted.status_code == 202, accepted.text

            async def tool_running() -> bool:
                r = await http.get(f"{node.url}/v1/sessions/{sid}/tool-calls", params={"status": "running"})
                return bool(r.json()["items"])

            await until(tool_running)
            assert node.proc is not None
            node.proc.send_signal(signal.SIGTERM)

            async def not_ready() -> httpx.Response | None:
                r = await http.get(f"{node.url}/readyz")
                return r if r.status_code == 503 else None

            readiness = await until(not_ready)
            assert readiness.json()["status"] == "draining" and readiness.headers["retry-after"] == "1"
            liveness = await http.get(f"{node.url}/healthz")
            assert liveness.status_code == 200 and liveness.json()["status"] == "ok"
            assert node.proc.poll() is None  # still draining: the tool holds the hand-over
            assert (await http.get(f"{node.url}/readyz")).status_code == 503
    finally:
        node.kill()
