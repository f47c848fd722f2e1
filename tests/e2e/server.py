"""A real ``switchboard serve`` process on a free loopback port, and a real WebSocket client."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import websockets

from tests.ports import free_port
from tests.waiting import WAIT_S

ROOT = Path(__file__).resolve().parents[2]


class Server:
    def __init__(
        self, tmp_path: Path, *, database_url: str | None = None, command: list[str] | None = None, **env: str
    ) -> None:
        self.tmp_path = tmp_path
        self.command = command or [sys.executable, "-m", "switchboard.cli"]
        self.port = free_port()
        self.database_url = database_url or f"sqlite+aiosqlite:///{tmp_path}/e2e.db"
        self.env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "SWITCHBOARD_DATABASE_URL": self.database_url,
            "SWITCHBOARD_AGENTS": "tests.agents_fixture:AGENTS",
            "SWITCHBOARD_WORDS_PER_SECOND": "50",
            "SWITCHBOARD_LOG_LEVEL": "WARNING",
            "SWITCHBOARD_SCRIPTED_MODEL": "allow",  # the tests script their sessions' models, with auth on too
            # a backstop for a request that hangs, not a claim of speed: a create took over 11 s on a loaded machine
            # (the tests of the deadline set their own)
            "SWITCHBOARD_REQUEST_TIMEOUT_S": str(WAIT_S),
            **env,
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = tmp_path / f"server-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def launch(self) -> subprocess.Popen[bytes]:
        """Start the process without waiting for it to be ready."""
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [*self.command, "serve", "--host", "127.0.0.1", "--port", str(self.port)],
                env=self.env,
                cwd=self.tmp_path,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return self.proc

    def start(self, timeout: float = 60.0) -> Server:
        self.proc = self.launch()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=0.5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"server did not become ready:\n{self.logs()}")

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(WAIT_S)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)  # bound: SIGTERM's grace, then SIGKILL
            except subprocess.TimeoutExpired:
                self.kill()


class EventStream:
    """Collects frames from a session's event WebSocket."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.frames: list[dict[str, Any]] = []
        self._task = asyncio.create_task(self._read())
        self.closed: tuple[int, str] | None = None

    @classmethod
    async def open(
        cls, server: Server, sid: str, *, since: int = 0, types: str | None = None, **kw: Any
    ) -> EventStream:
        url = f"{server.ws_url}/v1/sessions/{sid}/events?since={since}"
        if types:
            url += f"&types={types}"
        ws = await websockets.connect(url, **kw)
        return cls(ws)

    async def _read(self) -> None:
        try:
            async for raw in self.ws:
                self.frames.append(json.loads(raw))
        except websockets.ConnectionClosed:
            pass
        finally:
            if self.ws.close_code is not None:
                self.closed = (self.ws.close_code, self.ws.close_reason or "")

    def types(self) -> list[str]:
        return [f["type"] for f in self.frames]

    async def wait_for(
        self, type: str, pred: Callable[[dict[str, Any]], bool] = lambda f: True, timeout: float = WAIT_S
    ) -> dict[str, Any]:
        async with asyncio.timeout(timeout):
            while True:
                for f in self.frames:
                    if f["type"] == type and pred(f["data"]):
                        return f
                if self._task.done():
                    raise AssertionError(f"stream closed ({self.closed}) before {type}; got {self.types()}")
                await asyncio.sleep(0.005)

    async def close(self) -> None:
        await self.ws.close()
        await self._task
