"""Memory per idle event stream: what each open WebSocket costs the server, to size the stream caps.

A real ``switchboard serve`` process (SQLite in a temp dir, loopback, auth off) is started; a client process opens
``--streams`` WebSockets on ``/v1/events?cursor=now`` (nothing to replay, nothing live: idle streams) and holds them.
The server's resident memory (``VmRSS``) is read before and after, once it has settled. Reported: RSS before and after,
and the difference per stream. One more stream over the server's cap is then opened to show its 4429 close.

Run: ``.venv/bin/python bench/ws_idle_memory.py [--streams 1000]`` (Linux: reads /proc). Every wait is bounded and
every process it started is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONNECT_CONCURRENCY = 50
SETTLE_S = 2.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def wait_ready(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{url}/readyz", timeout=1) as r:
                if r.status == 200:
                    return
        time.sleep(0.2)
    raise RuntimeError("the server did not become ready")


# -- role: client (holds the streams) ------------------------------------------------------------------------------


async def hold(url: str, streams: int) -> None:
    """Open ``streams`` idle streams, print OPEN, hold them until stdin closes; then try one more and print its
    close code."""
    from websockets.asyncio.client import connect

    gate = asyncio.Semaphore(CONNECT_CONCURRENCY)

    async def one() -> object:
        async with gate:
            return await connect(f"{url}/v1/events?cursor=now", ping_interval=None, open_timeout=60)

    conns = await asyncio.gather(*(one() for _ in range(streams)))
    print("OPEN", flush=True)
    await asyncio.to_thread(sys.stdin.read)
    extra = await connect(f"{url}/v1/events?cursor=now", ping_interval=None, open_timeout=60)
    with contextlib.suppress(Exception):
        async with asyncio.timeout(5):
            await extra.recv()
    print("EXTRA", extra.close_code, extra.close_reason, flush=True)
    for conn in conns:
        await conn.close()  # type: ignore[attr-defined]


# -- role: driver ----------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--role", choices=["driver", "client"], default="driver")
    parser.add_argument("--url", default="")
    args = parser.parse_args()
    if args.role == "client":
        asyncio.run(hold(args.url, args.streams))
        return

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "SWITCHBOARD_DATABASE_URL": f"sqlite+aiosqlite:///{tmp}/bench.db",
            "SWITCHBOARD_LOG_LEVEL": "WARNING",
            "SWITCHBOARD_WS_MAX_STREAMS": str(args.streams),
            "SWITCHBOARD_WS_MAX_STREAMS_PER_CREDENTIAL": str(args.streams),
            "SWITCHBOARD_MAX_CONNECTIONS_PER_CLIENT": "0",  # every stream comes from 127.0.0.1
        }
        cmd = [sys.executable, "-m", "switchboard.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
        server = subprocess.Popen(cmd, env=env, cwd=tmp)
        client: subprocess.Popen[str] | None = None
        try:
            wait_ready(url)
            time.sleep(SETTLE_S)
            before = rss_kb(server.pid)
            client = subprocess.Popen(
                [sys.executable, __file__, "--role", "client", "--url", url.replace("http", "ws"), "--streams",
                 str(args.streams)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
            )  # fmt: skip
            assert client.stdin is not None and client.stdout is not None
            line = client.stdout.readline().strip()
            if line != "OPEN":
                raise RuntimeError(f"the client did not open its streams: {line!r}")
            time.sleep(SETTLE_S)
            after = rss_kb(server.pid)
            client.stdin.close()
            extra = client.stdout.readline().strip()
            client.wait(timeout=60)
        finally:
            for proc in (client, server):
                if proc is not None and proc.poll() is None:
                    proc.terminate()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=10)
                    if proc.poll() is None:
                        proc.kill()
    per_stream = (after - before) / args.streams
    print(f"idle streams: {args.streams}")
    print(f"server RSS: {before / 1024:.1f} MB before, {after / 1024:.1f} MB after")
    print(f"per idle stream: {per_stream:.1f} KB")
    print(f"one stream over the cap: {extra}")


if __name__ == "__main__":
    main()
