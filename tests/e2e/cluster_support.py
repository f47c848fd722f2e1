"""What the cluster tests share: a redis-server of their own, cluster nodes, stream clients that resume on another
node when theirs goes away, and a load of operator commands sent to any node with the documented retries."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import websockets

from tests import waiting
from tests.retryable import RETRYABLE
from tests.waiting import WAIT_S

from .server import Server, free_port

LEASE_S = 8.0  # long enough for a loaded test machine (production default: 2 s)
SECRET = "cluster-secret-for-the-e2e-tests-0123456789"
TOKEN_SECRET = "token-secret-of-the-e2e-cluster-0123456789"  # every node's: a token minted on one works on all
FORWARDED = "x-switchboard-forwarded"
# 503 codes a client retries (docs/cluster.md): the session is moving between nodes, this node is stopping, or another
# request with the same Idempotency-Key is still being applied (and `unavailable`: not done in time on a loaded
# machine)


class RedisServer:
    """A redis-server of this test's own on a free loopback port, to stop and start again."""

    def __init__(self, tmp_path: Path) -> None:
        self.port = free_port()
        self.dir = tmp_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen([*args, "--dir", str(self.dir)], stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(WAIT_S)


def cluster_node(tmp_path: Path, database_url: str, node_id: str, redis_url: str, **env: str) -> Server:
    env = {"SWITCHBOARD_TOKEN_SECRET": TOKEN_SECRET, "SWITCHBOARD_LEASE_S": str(LEASE_S), **env}
    return Server(
        tmp_path, database_url=database_url, SWITCHBOARD_REDIS_URL=redis_url, SWITCHBOARD_NODE_ID=node_id, **env
    )


async def start_all(nodes: Sequence[Server]) -> None:
    """The first node migrates the database; the others then start together."""
    await asyncio.to_thread(nodes[0].start, 90)
    await asyncio.gather(*(asyncio.to_thread(node.start, 90) for node in nodes[1:]))


def drain_stop(node: Server, timeout_s: float = 60.0) -> None:
    """SIGTERM, and wait for the node to hand its sessions over and exit."""
    assert node.proc is not None
    node.proc.send_signal(signal.SIGTERM)
    node.proc.wait(timeout_s)


async def retried(request: Callable[[], Awaitable[httpx.Response]]) -> httpx.Response:
    """``request()``'s answer, sent again after ``Retry-After`` while it is a 503 a client is told to retry (a busy
    node's deadline, a session moving), as any client of a cluster does; within the shared ceiling."""
    async with asyncio.timeout(WAIT_S):
        while True:
            r = await request()
            if r.status_code != 503 or r.json().get("code") not in RETRYABLE:
                return r
            await asyncio.sleep(min(1.0, float(r.headers.get("retry-after", "1"))))


async def until(check: Any, timeout_s: float = WAIT_S, every_s: float = 0.1) -> Any:
    return await waiting.until(check, timeout_s, every_s)


def up(nodes: Sequence[Server]) -> list[Server]:
    return [n for n in nodes if n.proc is not None and n.proc.poll() is None]


class ResumingStream:
    """A WebSocket event stream that, when its node goes away, resumes on another with the position it reached:
    ``since`` on a session stream, ``cursor`` on the multi-session stream."""

    def __init__(self, nodes: Sequence[Server], path: str, key: str, first: Server) -> None:
        self.nodes = nodes
        self.path = path
        self.key = key
        self.frames: list[dict[str, Any]] = []
        self.position = 0
        self.connections: list[str] = []
        self._node = first
        self._task = asyncio.create_task(self._run())

    @classmethod
    def session(cls, nodes: Sequence[Server], sid: str, first: Server) -> ResumingStream:
        return cls(nodes, f"/v1/sessions/{sid}/events", "since", first)

    @classmethod
    def multi(cls, nodes: Sequence[Server], first: Server) -> ResumingStream:
        return cls(nodes, "/v1/events", "cursor", first)

    async def _run(self) -> None:
        while True:
            url = f"{self._node.ws_url}{self.path}?{self.key}={self.position}"
            try:
                async with websockets.connect(url, open_timeout=10) as ws:
                    self.connections.append(self._node.url)
                    async for raw in ws:
                        frame = json.loads(raw)
                        self.frames.append(frame)
                        self.position = frame["seq"] if self.key == "since" else frame["cursor"]
            except (OSError, websockets.WebSocketException, TimeoutError):
                pass
            await asyncio.sleep(0.2)
            live = up(self.nodes)
            others = [n for n in live if n is not self._node]
            self._node = random.choice(others or live or list(self.nodes))

    def of(self, sid: str) -> list[dict[str, Any]]:
        return [f for f in self.frames if f["session_id"] == sid]

    async def wait_for(self, check: Any, timeout_s: float = WAIT_S) -> None:
        async def seen() -> bool:
            return bool(check(self.frames))

        await until(seen, timeout_s, 0.05)

    async def aclose(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


def assert_gap_free(frames: list[dict[str, Any]], sids: Sequence[str]) -> None:
    """Each session's events exactly once and in order, from seq 1."""
    for sid in sids:
        seqs = [f["seq"] for f in frames if f["session_id"] == sid]
        assert seqs == list(range(1, len(seqs) + 1)), (sid, seqs)


class Load:
    """Operator input sent to the sessions through any node that is up, retrying what docs/cluster.md says to retry
    (503 with a retryable code, a node that refused the connection); any other 5xx is recorded."""

    def __init__(self, nodes: Sequence[Server], sids: Sequence[str]) -> None:
        self.nodes = nodes
        self.sids = list(sids)
        self.accepted: dict[str, list[str]] = {sid: [] for sid in sids}
        self.errors: list[str] = []
        self.retries = 0
        self.longest_s = 0.0  # the longest an input took to be accepted, retries included (unavailability)
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._run())

    async def send(self, client: httpx.AsyncClient, sid: str, text: str) -> None:
        key = uuid.uuid4().hex
        started = time.monotonic()
        deadline = started + 60
        while time.monotonic() < deadline:
            node = random.choice(up(self.nodes) or list(self.nodes))
            try:
                r = await client.post(
                    f"{node.url}/v1/sessions/{sid}/input",
                    json={"text": text, "interrupt": False},
                    headers={"Idempotency-Key": key},  # a retry after a cut connection is applied once
                    timeout=30,
                )
            except httpx.TransportError:
                self.retries += 1
                await asyncio.sleep(0.2)
                continue
            if r.status_code == 202:
                self.accepted[sid].append(text)
                self.longest_s = max(self.longest_s, time.monotonic() - started)
                return
            if r.status_code == 503 and r.json().get("code") in RETRYABLE:
                self.retries += 1
                await asyncio.sleep(float(r.headers.get("retry-after", "1")) / 4)
                continue
            self.errors.append(f"{r.status_code} {r.text}")
            return
        self.errors.append(f"input to {sid} not accepted within 60 s")

    async def _run(self) -> None:
        n = 0
        async with httpx.AsyncClient(timeout=WAIT_S) as client:
            while not self._stop.is_set():
                n += 1
                await asyncio.gather(*(self.send(client, sid, f"n{n} {sid}") for sid in self.sids))
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.5):  # bound: the pace between rounds, expected to run out
                        await self._stop.wait()

    async def aclose(self) -> None:
        self._stop.set()
        await self._task
