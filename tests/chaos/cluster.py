"""The cluster under test: three ``switchboard serve`` nodes in cluster mode on a fresh PostgreSQL database of the
run's own, with a redis-server of the run's own, each reached by the nodes through a fault proxy, a webhook backend
that answers 202 for the long tool, and a non-sticky balancer in front of the nodes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import asyncpg
from sqlalchemy.engine import make_url

from tests.e2e.cluster_support import RedisServer
from tests.e2e.server import Server
from tests.waiting import WAIT_S
from tests.webhook_backend import FakeBackend

from .proxy import Balancer, FaultProxy

PG_URL = os.environ.get("SWITCHBOARD_TEST_PG_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test")
FAKETIME_LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1"
CLUSTER_SECRET = "chaos-cluster-secret-0123456789abcdefghij"
TOKEN_SECRET = "chaos-token-secret-0123456789abcdefghijklm"
WEBHOOK_SECRET = "chaos-webhook-secret-0123456789abcdef"
API_KEY = "chaos-key-0123456789abcdef"
SCOPES = [
    "sessions:read",
    "sessions:write",
    "sessions:control",
    "tools:cancel",
    "tools:report",
    "events:read",
    "media:connect",
    "metrics:read",
]
NODE_START_S = 120.0  # a node's start (the first one migrates) on a loaded machine
DRAIN_WAIT_S = 90.0
START_ATTEMPTS = 3

AGENTS_FILE = """
- name: hooks
  instructions: You run tools on a backend.
  tools:
    - kind: webhook
      name: lookup
      description: Look something up at once.
      parameters: {{type: object, properties: {{what: {{type: string}}}}, required: [what]}}
      url: {url}/tools/lookup
      timeout_s: 30
      secret_env: CHAOS_WEBHOOK_SECRET
    - kind: webhook
      name: refund
      description: A refund the backend reports later.
      parameters: {{type: object, properties: {{order: {{type: string}}}}, required: [order]}}
      url: {url}/tools/refund
      cancel_url: {url}/tools/refund/cancel
      timeout_s: 120
      secret_env: CHAOS_WEBHOOK_SECRET
      allow_cancellation: true
"""


@dataclass
class Node:
    id: str
    server: Server
    paused: bool = False
    skew_s: float = 0.0
    starts: int = 0

    @property
    def pid(self) -> int | None:
        proc = self.server.proc
        return proc.pid if proc is not None and proc.poll() is None else None

    @property
    def running(self) -> bool:
        return self.pid is not None


def admin_dsn() -> str:
    return make_url(PG_URL).set(drivername="postgresql").render_as_string(hide_password=False)


def check_faketime(skew_s: float) -> None:
    """libfaketime must move a Python child's wall clock by ``skew_s`` (and leave its monotonic clock alone)."""
    code = "import time; print(time.time())"
    env = {**os.environ, **faketime_env(skew_s)}
    before = time.time()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    after = time.time()
    seen = float(out.stdout.strip())
    if not before + skew_s - 0.5 <= seen <= after + skew_s + 0.5:
        raise RuntimeError(f"libfaketime did not skew a Python child by {skew_s} s: {seen - after:+.2f} s")


def faketime_env(skew_s: float) -> dict[str, str]:
    """The environment that starts a process with its wall clock ``skew_s`` off (its monotonic clock untouched)."""
    return {"LD_PRELOAD": FAKETIME_LIB, "FAKETIME": f"{skew_s:+.1f}s", "DONT_FAKE_MONOTONIC": "1"}


class ChaosCluster:
    def __init__(self, workdir: Path, seed: int, lease_s: float) -> None:
        self.workdir = workdir
        self.seed = seed
        self.lease_s = lease_s
        self.dbname = f"sbchaos_{uuid.uuid4().hex[:10]}"
        url = make_url(PG_URL)
        self._pg = url
        self.admin_dsn = admin_dsn()
        # the harness and the checker read the database directly, never through the fault proxy
        self.dsn = url.set(drivername="postgresql", database=self.dbname).render_as_string(hide_password=False)
        self.redis = RedisServer(workdir)
        self.pg_proxy = FaultProxy(url.host or "127.0.0.1", url.port or 5432)
        self.redis_proxy = FaultProxy("127.0.0.1", self.redis.port)
        self.backend = FakeBackend(WEBHOOK_SECRET)
        self.backend.answers["refund"] = [(202, None)]
        self.backend.answers["lookup"] = [(200, {"output": "looked up"})]
        self.nodes: list[Node] = []
        self.balancer: Balancer | None = None
        self.start_failures: list[str] = []  # starts that exited (e.g. the database reset under a node's start)
        self._db_created = False

    # -- lifecycle ----------------------------------------------------------------------------------------------

    async def start(self, balancer: Balancer) -> None:
        for skew in (1.6, -1.6):
            await asyncio.to_thread(check_faketime, skew)
        admin = await asyncpg.connect(self.admin_dsn, timeout=10)
        try:
            await admin.execute(f'CREATE DATABASE "{self.dbname}"')
            self._db_created = True
        finally:
            await admin.close()
        await asyncio.to_thread(self.redis.start)
        await self.pg_proxy.start()
        await self.redis_proxy.start()
        await self.backend.__aenter__()
        agents = self.workdir / "agents.yaml"
        agents.write_text(AGENTS_FILE.format(url=self.backend.url()))
        db_url = self._pg.set(host="127.0.0.1", port=self.pg_proxy.port, database=self.dbname)
        env = {
            "SWITCHBOARD_REDIS_URL": f"redis://127.0.0.1:{self.redis_proxy.port}/0",
            "SWITCHBOARD_LEASE_S": str(self.lease_s),
            "SWITCHBOARD_CLUSTER_SECRET": CLUSTER_SECRET,
            "SWITCHBOARD_TOKEN_SECRET": TOKEN_SECRET,
            "SWITCHBOARD_API_KEYS": json.dumps([{"key": API_KEY, "scopes": SCOPES}]),
            "SWITCHBOARD_AGENTS_FILE": str(agents),
            "SWITCHBOARD_WRITE_RATE_PER_S": "1000",
            "SWITCHBOARD_WRITE_BURST": "1000",
            "SWITCHBOARD_READ_RATE_PER_S": "1000",  # one key for every client and the checker's reads
            "SWITCHBOARD_READ_BURST": "1000",
            "SWITCHBOARD_WORDS_PER_SECOND": "20",
            "CHAOS_WEBHOOK_SECRET": WEBHOOK_SECRET,
            "SWITCHBOARD_REQUEST_TIMEOUT_S": "10",  # the product's default, under the clients' 20 s (not the tests')
        }
        for name in ("a", "b", "c"):
            node_dir = self.workdir / f"node-{name}"
            node_dir.mkdir(exist_ok=True)
            server = Server(
                node_dir,
                database_url=db_url.render_as_string(hide_password=False),
                SWITCHBOARD_NODE_ID=f"node-{name}",
                **env,
            )
            self.nodes.append(Node(f"node-{name}", server))
        self.balancer = balancer
        await balancer.start()
        await self.start_node(self.nodes[0])  # it migrates the database; the others then start together
        await asyncio.gather(*(self.start_node(n) for n in self.nodes[1:]))

    async def aclose(self) -> None:
        for node in self.nodes:
            if node.paused and node.pid is not None:
                os.kill(node.pid, signal.SIGCONT)
            await asyncio.to_thread(node.server.kill)
        if self.balancer is not None:
            await self.balancer.aclose()
        await self.pg_proxy.aclose()
        await self.redis_proxy.aclose()
        with contextlib.suppress(Exception):
            await self.backend.__aexit__(None, None, None)
        self.redis_thaw()
        await asyncio.to_thread(self.redis.stop)
        if self._db_created:
            admin = await asyncpg.connect(self.admin_dsn, timeout=10)
            try:
                await admin.execute(f'DROP DATABASE IF EXISTS "{self.dbname}" WITH (FORCE)')
            finally:
                await admin.close()

    # -- nodes --------------------------------------------------------------------------------------------------

    def routable_ports(self) -> list[int]:
        """The nodes a balancer would send to: running and not frozen."""
        return [n.server.port for n in self.nodes if n.running and not n.paused]

    async def start_node(self, node: Node, skew_s: float = 0.0) -> None:
        for var in ("LD_PRELOAD", "FAKETIME", "DONT_FAKE_MONOTONIC"):
            node.server.env.pop(var, None)
        if skew_s:
            node.server.env.update(faketime_env(skew_s))
        node.skew_s = skew_s
        node.paused = False
        for attempt in range(START_ATTEMPTS):  # as a supervisor restarts a process that exited at its start
            node.starts += 1
            try:
                await asyncio.to_thread(node.server.start, NODE_START_S)
                return
            except RuntimeError as err:
                self.start_failures.append(f"{node.id}: {str(err).splitlines()[0]}")
                if attempt == START_ATTEMPTS - 1:
                    raise
                await asyncio.sleep(1.0)

    async def busiest(self) -> Node:
        """The running node that owns the most sessions (the first of them on a tie)."""
        conn = await self.connect()
        try:
            rows = await conn.fetch(
                "SELECT owner_node, count(*) AS n FROM sessions WHERE state NOT IN ('closed', 'failed') "
                "GROUP BY owner_node"
            )
        finally:
            await conn.close()
        owned = {r["owner_node"]: r["n"] for r in rows}
        running = [n for n in self.nodes if n.running and not n.paused] or self.nodes
        return max(running, key=lambda n: owned.get(n.id, 0))

    def kill(self, node: Node) -> None:
        if node.pid is not None:
            os.kill(node.pid, signal.SIGKILL)
            assert node.server.proc is not None
            node.server.proc.wait(WAIT_S)
        node.paused = False

    def pause(self, node: Node) -> None:
        if node.pid is not None:
            os.kill(node.pid, signal.SIGSTOP)
            node.paused = True

    def resume(self, node: Node) -> None:
        if node.pid is not None:
            os.kill(node.pid, signal.SIGCONT)
        node.paused = False

    async def drain(self, node: Node) -> None:
        """SIGTERM: the node hands its sessions over and exits (killed if it takes far longer than it may)."""
        proc = node.server.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, DRAIN_WAIT_S)
        except subprocess.TimeoutExpired:
            self.kill(node)

    # -- redis --------------------------------------------------------------------------------------------------

    def redis_freeze(self) -> None:
        if self.redis.proc is not None and self.redis.proc.poll() is None:
            os.kill(self.redis.proc.pid, signal.SIGSTOP)

    def redis_thaw(self) -> None:
        if self.redis.proc is not None and self.redis.proc.poll() is None:
            os.kill(self.redis.proc.pid, signal.SIGCONT)

    async def redis_restart(self) -> None:
        """Kill the (frozen) redis-server and start a new, empty one on the same port."""
        if self.redis.proc is not None and self.redis.proc.poll() is None:
            self.redis.proc.kill()
            await asyncio.to_thread(self.redis.proc.wait, 30)
        await asyncio.to_thread(self.redis.start)

    # -- the database, read directly ----------------------------------------------------------------------------

    async def connect(self) -> asyncpg.Connection:
        return await asyncpg.connect(self.dsn, timeout=10)

    def logs(self) -> str:
        return "\n".join(f"== {n.id}\n{n.server.logs()[-4000:]}" for n in self.nodes)
