"""Leases judged on one clock, the database's: three real cluster nodes, one of them with its wall clock running ahead
(libfaketime); it buries no healthy node, takes none of their sessions, and a call that cannot be cancelled on a
healthy node runs to its end there."""

from __future__ import annotations

import asyncio
import glob
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from sqlalchemy.engine import make_url

from .cluster_support import FORWARDED, SECRET, TOKEN_SECRET, RedisServer, retried, start_all
from .server import Server

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.timeout(240)]

# The report: a node 1.6 s ahead with a 2 s lease buried the healthy nodes again and again. The same share of a
# longer lease, so that a loaded test machine keeps the healthy nodes' own renewals on time: a node this far ahead
# sees a healthy lease pass 0.8 s after each renewal, and renewals come every second.
LEASE_S = 4.0
SKEW_S = 0.8 * LEASE_S
CALL_S = 4 * LEASE_S  # the call that must run to its end where it started
FAKETIME_LIBS = "/usr/lib/*/faketime/libfaketimeMT.so.1"  # Debian's libfaketime (threads: the lease's own)


def ahead(skew_s: float) -> dict[str, str]:
    """The environment of a process whose wall clock runs ``skew_s`` ahead (its monotonic clock, which asyncio and the
    lease's own durations use, untouched), checked on a Python child first."""
    found = sorted(glob.glob(FAKETIME_LIBS))
    if not found:
        if os.environ.get("CI") == "true":
            pytest.fail("libfaketime is missing (apt-get install faketime libfaketime)")
        pytest.skip("libfaketime is missing (apt-get install faketime libfaketime)")
    env = {"LD_PRELOAD": found[0], "FAKETIME": f"+{skew_s}s", "DONT_FAKE_MONOTONIC": "1"}
    probe = "import time; print(time.time(), time.monotonic())"
    before = time.time()
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, **env}, capture_output=True, check=True)
    wall, monotonic = map(float, out.stdout.split())
    assert skew_s - 1.0 < wall - before < skew_s + 5.0, "libfaketime does not move the child's wall clock"
    assert abs(monotonic - time.monotonic()) < 5.0, "libfaketime moved the child's monotonic clock too"
    return env


def node(tmp_path: Path, database_url: str, redis: RedisServer, node_id: str, **env: str) -> Server:
    return Server(
        tmp_path,
        database_url=database_url,
        SWITCHBOARD_REDIS_URL=redis.url,
        SWITCHBOARD_NODE_ID=node_id,
        SWITCHBOARD_LEASE_S=str(LEASE_S),
        SWITCHBOARD_CLUSTER_SECRET=SECRET,
        SWITCHBOARD_TOKEN_SECRET=TOKEN_SECRET,
        **env,
    )


async def test_a_node_whose_clock_runs_ahead_takes_no_healthy_nodes_session(
    tmp_path: Path, database_url: str, redis: RedisServer
) -> None:
    fast_env = ahead(SKEW_S)
    nodes = [
        node(tmp_path, database_url, redis, "node-a"),
        node(tmp_path, database_url, redis, "node-b"),
        node(tmp_path, database_url, redis, "node-fast", **fast_env),
    ]
    a = nodes[0]
    dsn = make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False)
    db = await asyncpg.connect(dsn)
    try:
        await start_all(nodes)
        async with httpx.AsyncClient(timeout=30) as http:
            call = {"name": "slow", "arguments": {"seconds": CALL_S}}
            llm = {
                "provider": "scripted",
                "turns": [{"text": "On it.", "tool_calls": [call]}],
                "fallback": {"text": "Ok."},
            }
            # forwarded, the create is placed where it arrives: on node-a
            r = await http.post(
                f"{a.url}/v1/sessions", json={"agent": "tester", "llm": llm}, headers={FORWARDED: SECRET}
            )
            assert r.status_code == 201 and r.json()["owner_node"] == "node-a", r.text
            sid = r.json()["id"]
            r = await retried(lambda: http.post(f"{a.url}/v1/sessions/{sid}/input", json={"text": "go"}))
            assert r.status_code == 202, r.text

            owners: set[tuple[Any, ...]] = set()
            dead: set[str] = set()
            status_sql = "SELECT status, output FROM tool_calls WHERE session_id = $1"
            async with asyncio.timeout(CALL_S + 60):
                while True:
                    owners.add(
                        tuple(await db.fetchrow("SELECT owner_node, owner_epoch FROM sessions WHERE id = $1", sid))
                    )
                    dead |= {row[0] for row in await db.fetch("SELECT id FROM nodes WHERE state = 'dead'")}
                    found = await db.fetchrow(status_sql, sid)
                    if found is not None and found[0] != "running":
                        break
                    await asyncio.sleep(0.1)
            assert owners == {("node-a", 1)}, f"the session moved: {owners}; nodes found dead: {dead}"
            assert dead == set()
            assert tuple(found) == ("completed", f"slept {CALL_S}")
    finally:
        await db.close()
        for n in nodes:
            n.stop()
