"""What the cluster benchmarks share: a fresh PostgreSQL database, a redis-server of their own, ``switchboard serve``
nodes on loopback (real processes), percentiles and the machine's load.

Each benchmark creates its own database (``bench_cluster_<hex>``) on ``SWITCHBOARD_TEST_PG_URL`` and drops it at the
end, starts its own redis-server on a free port, and stops every process it started, whatever happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
from sqlalchemy.engine import make_url

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.e2e.cluster_support import TOKEN_SECRET, RedisServer  # noqa: E402
from tests.e2e.server import Server  # noqa: E402  (the e2e tests' server process and redis-server)

ATTEMPTS = 10
RETRIED: Counter[str] = Counter()  # 503 answers retried (documented retries), by problem code
# what a node logs when it lets go of its sessions after late renewals, or finds another node buried it
LEASE_LOSSES = ("lease not renewed in time", "re-registered after losing its lease", "lost its lease; rejoining")
PG_URL = os.environ.get("SWITCHBOARD_TEST_PG_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test")


def pct(values: list[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank) of ``values``."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def loadavg() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def _dsn(database: str) -> str:
    return make_url(PG_URL).set(drivername="postgresql", database=database).render_as_string(hide_password=False)


@contextlib.asynccontextmanager
async def pg_database() -> AsyncIterator[str]:
    """A fresh database for one benchmark; yields its SQLAlchemy URL."""
    name = f"bench_cluster_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(_dsn(make_url(PG_URL).database or "postgres"))
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    try:
        yield make_url(PG_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        admin = await asyncpg.connect(_dsn(make_url(PG_URL).database or "postgres"))
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()


class Node(Server):
    """One ``switchboard serve`` process of the cluster (``tests/e2e/server.py``'s ``Server``), on a fixed loopback
    port kept across restarts, started and awaited without blocking the benchmark's loop."""

    def __init__(self, node_id: str, workdir: Path, database_url: str, redis_url: str, **env: str) -> None:
        super().__init__(
            workdir,
            database_url=database_url,
            # this checkout's package first (a copy of the repository benchmarks its own code, not the installed one)
            PYTHONPATH=os.pathsep.join([str(ROOT / "service"), str(ROOT)]),
            SWITCHBOARD_REDIS_URL=redis_url,
            SWITCHBOARD_NODE_ID=node_id,
            **{"SWITCHBOARD_TOKEN_SECRET": TOKEN_SECRET, **env},
        )
        self.node_id = node_id
        self.log_path = workdir / f"{node_id}.log"

    async def ready(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=1.0) as client:
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"{self.node_id} exited ({self.proc.returncode}): {self.logs()[-2000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{self.url}/readyz")).status_code == 200:
                        return
                await asyncio.sleep(0.05)
        raise RuntimeError(f"{self.node_id} did not become ready: {self.logs()[-2000:]}")

    async def relaunch(self) -> Node:
        """Start the process (again) and wait until it is ready."""
        self.launch()
        await self.ready()
        return self

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    async def stopped(self, timeout_s: float = 60.0) -> int | None:
        """Wait for the process to end (after a signal); SIGKILL it past ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.proc is not None and self.proc.poll() is None:
            if time.monotonic() >= deadline:
                self.kill()
            await asyncio.sleep(0.05)
        return self.proc.returncode if self.proc is not None else None


@contextlib.asynccontextmanager
async def cluster(count: int, **env: str) -> AsyncIterator[list[Node]]:
    """``count`` nodes (``node-1``...) on a fresh database and a redis-server of their own. The first one migrates
    the database before the others start."""
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        workdir = Path(tmp)
        redis = RedisServer(workdir)
        redis.start()
        nodes: list[Node] = []
        try:
            async with pg_database() as database_url:
                nodes = [Node(f"node-{k + 1}", workdir, database_url, redis.url, **env) for k in range(count)]
                await nodes[0].relaunch()
                for node in nodes[1:]:
                    node.launch()
                await asyncio.gather(*(node.ready() for node in nodes[1:]))
                try:
                    yield nodes
                finally:
                    print(f"documented retries (503) by code: {dict(RETRIED) or 'none'}")
                    losses = lease_losses(nodes)
                    print(f"lease losses in the nodes' logs (late renewals under load): {len(losses)}")
                    for line in losses[:10]:
                        print(f"  {line}")
                    stalls = sum(node.logs().count("event loop stalled for") for node in nodes)
                    print(f"event-loop stalls past the renewal bound (renewals held back): {stalls}")
                    for node in nodes:
                        node.signal(signal.SIGTERM)
                    await asyncio.gather(*(node.stopped(30) for node in nodes))
        finally:
            for node in nodes:
                node.kill()
            redis.stop()


async def retrying(client: httpx.AsyncClient, method: str, url: str, **kw: Any) -> httpx.Response:
    """A request, sent again after a 503 (a documented retry: the session is moving, being recovered, or the node it
    was placed on went away), after its ``Retry-After``; each retry counted in ``RETRIED``."""
    for _ in range(ATTEMPTS):
        r = await client.request(method, url, **kw)
        if r.status_code != 503:
            return r
        RETRIED[str(r.json().get("code"))] += 1
        await asyncio.sleep(float(r.headers.get("retry-after", "1")))
    return r


def lease_losses(nodes: list[Node]) -> list[str]:
    """The times the nodes let go of their sessions for a late renewal or found themselves buried (their logs)."""
    return [
        f"{node.node_id}: {line[:23]} {what}"
        for node in nodes
        for line in node.logs().splitlines()
        for what in LEASE_LOSSES
        if what in line
    ]


async def create_sessions(nodes: list[Node], count: int, *, concurrency: int = 8) -> list[str]:
    """``count`` idle sessions of the built-in demo agent, created round-robin on the nodes (each placed on the
    least-loaded node by the service itself)."""
    sem = asyncio.Semaphore(concurrency)
    created: list[str] = []
    async with httpx.AsyncClient(timeout=30) as client:

        async def one(k: int) -> None:
            async with sem:
                r = await retrying(client, "POST", f"{nodes[k % len(nodes)].url}/v1/sessions", json={"agent": "demo"})
                if r.status_code != 201:
                    raise RuntimeError(f"creating a session: {r.status_code} {r.text}")
                created.append(r.json()["id"])

        await asyncio.gather(*(one(k) for k in range(count)))
    return created


async def node_loads(client: httpx.AsyncClient, node: Node) -> dict[str, dict[str, Any]]:
    r = await client.get(f"{node.url}/v1/cluster/nodes")
    r.raise_for_status()
    return {n["id"]: n for n in r.json()["items"]}


def summary(values: list[float], unit: str = "ms", scale: float = 1000.0) -> str:
    return (
        f"p50 {pct(values, 50) * scale:.1f} {unit}, p99 {pct(values, 99) * scale:.1f} {unit}, "
        f"max {max(values) * scale:.1f} {unit} (n={len(values)})"
    )
