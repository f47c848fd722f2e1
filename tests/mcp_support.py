"""The MCP server of the tests (``tests/mcp_server.py``) run as a process of its own, and what it logged."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from tests.ports import free_port
from tests.waiting import until, wait_until

SERVER_SCRIPT = str(Path(__file__).resolve().parent / "mcp_server.py")


class ServerLog:
    """What the test server wrote: one line per call, cancellation and exit."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def lines(self) -> list[str]:
        return self.path.read_text().splitlines() if self.path.exists() else []

    async def shows(self, line: str) -> None:
        await until(lambda: line in self.lines())


def _answers(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@contextmanager
def running_http_server(
    tmp_path: Path, env: Mapping[str, str] | None = None
) -> Iterator[tuple[str, ServerLog, subprocess.Popen[bytes]]]:
    """The server over streamable HTTP on a loopback port (``env`` added to its environment): its endpoint, its log
    and its process."""
    port = free_port()
    log = ServerLog(tmp_path / "server.log")
    proc = subprocess.Popen(
        [sys.executable, SERVER_SCRIPT, "http", str(port), str(log.path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )
    try:
        wait_until(lambda: _answers(port) or proc.poll() is not None)
        assert proc.poll() is None, "the test MCP server did not start"
        yield f"http://127.0.0.1:{port}/mcp", log, proc
    finally:
        proc.terminate()
        proc.wait()
