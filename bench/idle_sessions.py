"""Idle sessions: how fast sessions are created over HTTP, and what each idle one costs the server.

    .venv/bin/python bench/idle_sessions.py                      # 10,000 sessions over HTTP, 3 runs
    .venv/bin/python bench/idle_sessions.py --mode heap --sessions 2000     # in-process: tracemalloc, per line

``http`` (default): a real ``switchboard serve`` (SQLite in a temp dir, loopback, auth off) is started per run; a
client in this process creates ``--sessions`` sessions of the built-in ``demo`` agent with ``POST /v1/sessions``,
``--concurrency`` requests in flight (one keep-alive connection each). Reported per run: creates per second (wall
clock, first request to last answer), the server's CPU time per create (from /proc), its resident memory (``VmRSS``)
before and after, once settled, divided by the number of sessions, and its asyncio tasks per session (the
``switchboard_asyncio_tasks`` gauge of ``/metrics``, after minus before).

``heap``: a ``SessionHost`` on a SQLite store in this process creates the sessions through ``SessionHost.create``
with ``tracemalloc`` on, and prints what the live sessions hold (the snapshot's difference, by source line) and
their tasks. It is the tool to see where the memory of an idle session goes; RSS, which also holds the allocator's
free lists, is the ``http`` mode's figure.

Budget (DESIGN.md): <= 10 KiB per idle session and >= 1,000 creates/s.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.server import Server  # noqa: E402

SETTLE_S = 2.0
BUDGET_KIB = 10.0
BUDGET_CREATES_S = 1000.0


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tasks_alive(client: httpx.Client) -> int:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("switchboard_asyncio_tasks "):
            return int(float(line.split()[1]))
    raise RuntimeError("no switchboard_asyncio_tasks gauge")


@dataclass
class Run:
    creates_s: float
    cpu_ms: float  # server CPU per create
    kib: float  # RSS per session
    tasks: float  # tasks per session
    load: float

    def __str__(self) -> str:
        return (
            f"{self.creates_s:7.0f} creates/s  cpu {self.cpu_ms:.2f} ms/create  {self.kib:5.1f} KiB/session"
            f"  {self.tasks:.2f} tasks/session  [load {self.load:.1f}]"
        )


CREATE_BODY = b'{"agent":"demo"}'


async def raw_worker(host: str, port: int, ids: Iterator[int]) -> None:
    """Creates over one keep-alive HTTP/1.1 connection, one request at a time, parsed by hand: a few microseconds of
    client CPU per create, so the server is what the run measures (httpx costs ~1.5 ms per request)."""
    reader, writer = await asyncio.open_connection(host, port)
    request = (
        f"POST /v1/sessions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(CREATE_BODY)}\r\n\r\n"
    ).encode() + CREATE_BODY
    try:
        for _ in ids:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            body = await reader.readexactly(length)
            if status != 201:
                raise RuntimeError(f"create answered {status}: {body.decode(errors='replace')}")
    finally:
        writer.close()


async def httpx_worker(url: str, ids: Iterator[int]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=1)) as client:
        for _ in ids:
            r = await client.post("/v1/sessions", json={"agent": "demo"})
            if r.status_code != 201:
                raise RuntimeError(f"create answered {r.status_code}: {r.text}")


async def create_all(url: str, sessions: int, concurrency: int, client: str = "raw") -> float:
    """Create ``sessions`` demo sessions, ``concurrency`` at a time (one connection each); returns the wall time."""
    ids = iter(range(sessions))
    host, port = url.removeprefix("http://").rsplit(":", 1)
    t0, c0 = time.perf_counter(), time.process_time()
    if client == "raw":
        await asyncio.gather(*(raw_worker(host, int(port), ids) for _ in range(concurrency)))
    else:
        await asyncio.gather(*(httpx_worker(url, ids) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    print(f"  client: {wall:.1f} s wall, {time.process_time() - c0:.1f} s CPU", flush=True)
    return wall


def http_run(sessions: int, concurrency: int, source: str | None, spy: str | None = None, kind: str = "raw") -> Run:
    with tempfile.TemporaryDirectory(prefix="sb-bench-idle-") as tmp:
        env = {"SWITCHBOARD_MAX_SESSIONS": str(sessions + 10)}
        if source:  # the server of another checkout (its ``service`` directory) first on the path
            env["PYTHONPATH"] = os.pathsep.join([source, str(ROOT)])
        server = Server(Path(tmp), **env)
        server.start()
        try:
            assert server.proc is not None
            pid = server.proc.pid
            with httpx.Client(base_url=server.url, timeout=60) as client:
                client.post("/v1/sessions", json={"agent": "demo"}).raise_for_status()  # warm: imports, first rows
                time.sleep(SETTLE_S)
                rss0, tasks0, cpu0 = rss_kib(pid), tasks_alive(client), cpu_s(pid)
                profiler = None
                if spy:  # py-spy (if installed) samples the server while it creates
                    cmd = [str(Path(sys.executable).parent / "py-spy"), "record", "-p", str(pid), "-r", "200", "-f"]
                    profiler = subprocess.Popen([*cmd, "raw", "-o", spy, "--nonblocking"], stdout=subprocess.DEVNULL)
                wall = asyncio.run(create_all(server.url, sessions, concurrency, kind))
                if profiler is not None:
                    profiler.send_signal(signal.SIGINT)
                    profiler.wait(30)
                cpu1 = cpu_s(pid)
                time.sleep(SETTLE_S)
                rss1, tasks1 = rss_kib(pid), tasks_alive(client)
        finally:
            server.stop()
    return Run(
        creates_s=sessions / wall,
        cpu_ms=(cpu1 - cpu0) * 1000 / sessions,
        kib=(rss1 - rss0) / sessions,
        tasks=(tasks1 - tasks0) / sessions,
        load=os.getloadavg()[0],
    )


async def heap(sessions: int, top: int) -> None:
    from switchboard.control.host import SessionHost
    from switchboard.control.hub import EventHub
    from switchboard.control.session_config import SessionConfig
    from switchboard.control.settings import Settings
    from switchboard.integrations.demo import AGENTS, DEFAULT_LLMS
    from switchboard.runtime.agent import AgentRegistry
    from switchboard.store import Store

    with tempfile.TemporaryDirectory(prefix="sb-bench-idle-") as tmp:
        url = f"sqlite+aiosqlite:///{tmp}/idle.db"
        store = Store.from_url(url)
        await store.migrate()
        await store.start()
        host = SessionHost(
            store=store,
            registry=AgentRegistry(dict(AGENTS)),
            hub=EventHub(),
            settings=Settings(database_url=url, max_sessions=sessions + 10),
            default_llms=dict(DEFAULT_LLMS),  # as ``switchboard serve`` runs the demo agent
        )
        try:
            await host.create(SessionConfig(agent="demo"), {})  # warm
            await asyncio.sleep(0.5)
            gc.collect()
            tasks0 = len(asyncio.all_tasks())
            tracemalloc.start(8)
            before = tracemalloc.take_snapshot()
            gate = asyncio.Semaphore(64)

            async def one() -> None:
                async with gate:
                    await host.create(SessionConfig(agent="demo"), {})

            await asyncio.gather(*(one() for _ in range(sessions)))
            await asyncio.sleep(SETTLE_S)
            gc.collect()
            after = tracemalloc.take_snapshot()
            tasks1 = len(asyncio.all_tasks())
            tracemalloc.stop()
            stats = after.compare_to(before, "lineno")
            total = sum(s.size_diff for s in stats)
            print(f"{sessions} idle sessions: {total / sessions / 1024:.2f} KiB each (tracemalloc), "
                  f"{(tasks1 - tasks0) / sessions:.2f} tasks each")  # fmt: skip
            for s in stats[:top]:
                frame = s.traceback[0]
                print(f"  {s.size_diff / sessions:8.0f} B/session  {s.count_diff / sessions:6.2f} blocks  "
                      f"{frame.filename.split('site-packages/')[-1].split('service/')[-1]}:{frame.lineno}")  # fmt: skip
        finally:
            await host.aclose()
            await store.aclose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["http", "heap"], default="http")
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=64, help="creates in flight (http)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--source", help="http: run the server from this directory (another checkout's service/)")
    parser.add_argument(
        "--baseline", metavar="DIR", help="http: also run the server of DIR (another checkout's service/), alternately"
    )
    parser.add_argument(
        "--client", choices=["raw", "httpx"], default="raw", help="http: raw keep-alive HTTP/1.1 (cheap) or httpx"
    )
    parser.add_argument("--spy", metavar="FILE", help="http: py-spy the server during the creates (one run)")
    parser.add_argument("--top", type=int, default=25, help="source lines listed (heap)")
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    if args.mode == "heap":
        asyncio.run(heap(args.sessions, args.top))
        return 0
    # each run: this checkout's server, and the baseline's if asked, in alternating order (neither always first)
    codes = {"this": args.source} if args.baseline is None else {"before": args.baseline, "after": args.source}
    runs: dict[str, list[Run]] = {code: [] for code in codes}
    for n in range(args.runs):
        for code in list(codes)[:: 1 if n % 2 == 0 else -1]:
            runs[code].append(http_run(args.sessions, args.concurrency, codes[code], args.spy, args.client))
            print(f"run {n + 1} {code}: {runs[code][-1]}", flush=True)
    ok = True
    for code, done in runs.items():
        rate = statistics.median(r.creates_s for r in done)
        kib = statistics.median(r.kib for r in done)
        print(
            f"\n{code}: {args.sessions} sessions, {args.concurrency} in flight, median of {len(done)}: "
            f"{rate:.0f} creates/s, {statistics.median(r.cpu_ms for r in done):.2f} ms CPU/create, "
            f"{kib:.1f} KiB/session, {statistics.median(r.tasks for r in done):.2f} tasks/session"
        )
        ok = rate >= BUDGET_CREATES_S and kib <= BUDGET_KIB  # the last code's: this checkout's
    print(f"budget (>= {BUDGET_CREATES_S:.0f} creates/s, <= {BUDGET_KIB:.0f} KiB/session): {'met' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
