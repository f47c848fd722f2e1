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
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
from sqlalchemy.engine import make_url

ROOT = Path(__file__).resolve().parents[1]
CREATE_ATTEMPTS = 5
PG_URL = os.environ.get("SWITCHBOARD_TEST_PG_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


class RedisServer:
    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen([*args, "--dir", str(self.workdir)], stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


class Node:
    """One ``switchboard serve`` process of the cluster, on a fixed loopback port (kept across restarts)."""

    def __init__(self, node_id: str, workdir: Path, database_url: str, redis_url: str, **env: str) -> None:
        self.node_id = node_id
        self.port = free_port()
        self.workdir = workdir
        self.env = {
            **os.environ,
            # this checkout's package first (a copy of the repository benchmarks its own code, not the installed one)
            "PYTHONPATH": os.pathsep.join([str(ROOT / "service"), str(ROOT)]),
            "SWITCHBOARD_DATABASE_URL": database_url,
            "SWITCHBOARD_REDIS_URL": redis_url,
            "SWITCHBOARD_NODE_ID": node_id,
            "SWITCHBOARD_LOG_LEVEL": "WARNING",
            "SWITCHBOARD_SCRIPTED_MODEL": "allow",
            **env,
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / f"{node_id}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def launch(self) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "switchboard.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port)],
                env=self.env,
                cwd=self.workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

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

    async def start(self) -> Node:
        self.launch()
        await self.ready()
        return self

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)

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
                await nodes[0].start()
                for node in nodes[1:]:
                    node.launch()
                await asyncio.gather(*(node.ready() for node in nodes[1:]))
                try:
                    yield nodes
                finally:
                    for node in nodes:
                        node.signal(signal.SIGTERM)
                    await asyncio.gather(*(node.stopped(30) for node in nodes))
        finally:
            for node in nodes:
                node.kill()
            redis.stop()


async def create_sessions(nodes: list[Node], count: int, *, concurrency: int = 8) -> list[str]:
    """``count`` idle sessions of the built-in demo agent, created round-robin on the nodes (each placed on the
    least-loaded node by the service itself)."""
    sem = asyncio.Semaphore(concurrency)
    created: list[str] = []
    async with httpx.AsyncClient(timeout=30) as client:

        async def one(k: int) -> None:
            async with sem:
                for _ in range(CREATE_ATTEMPTS):
                    r = await client.post(f"{nodes[k % len(nodes)].url}/v1/sessions", json={"agent": "demo"})
                    if r.status_code != 503:  # a documented retry (Retry-After): the node placed on went away
                        break
                    print(f"creating a session: 503, retrying: {r.text}", file=sys.stderr)
                    await asyncio.sleep(float(r.headers.get("retry-after", "1")))
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
