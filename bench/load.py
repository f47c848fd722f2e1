"""Load: N concurrent sessions with concurrent inputs, interrupts, cancels, says, reads and WebSocket subscribers
against a real ``switchboard serve`` on loopback; afterwards the invariants are checked on every session, and p50/p99
latency and error counts are reported per operation.

The workload is ``tests.e2e.traffic.run_load`` (the CI test ``tests/e2e/test_load.py`` runs it small). Each session
has a scripted model mixing long speech, instant, slow, cancellable and background tools; a worker per session issues
``--ops`` commands (input 40 %, interrupt 20 %, cancel a running tool 15 %, say 10 %, read the chat 15 %) with a
random think time, stopping at ``--duration-s`` whatever is left. One subscriber per session and one multi-session
subscriber stream every event meanwhile. Then every session is closed and checked: valid chat, one terminal status
and one output per tool call, a gap-free log equal to what the live subscribers received.

Run: ``.venv/bin/python bench/load.py [--sessions 50] [--ops 60] [--duration-s 60] [--database-url URL]``
Exits non-zero on a 5xx, a transport error, or a broken invariant. Latencies are measured at the client, over HTTP
keep-alive connections (httpx), including the client's own overhead; the server and the client share the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.server import Server  # noqa: E402
from tests.e2e.traffic import LoadConfig, run_load  # noqa: E402


async def main(args: argparse.Namespace) -> int:
    print(f"python {platform.python_version()} on {platform.system()} {platform.machine()}, {os.cpu_count()} cpus")
    with tempfile.TemporaryDirectory(prefix="sb-load-") as tmp:
        env = {"SWITCHBOARD_LOG_LEVEL": "WARNING", "SWITCHBOARD_MAX_SESSIONS": str(max(1000, args.sessions))}
        server = Server(Path(tmp), database_url=args.database_url, **env)
        await asyncio.to_thread(server.start)
        try:
            cfg = LoadConfig(
                sessions=args.sessions, ops_per_session=args.ops, duration_s=args.duration_s, seed=args.seed
            )
            started = time.monotonic()
            async with asyncio.timeout(args.timeout_s):
                report = await run_load(server, cfg)
            print(f"\n{args.sessions} sessions x {args.ops} commands in {time.monotonic() - started:.1f} s")
            print(report.recorder.table())
            summary = report.summary()
            print(f"\nevents checked: {report.events}; tool calls: {dict(report.tool_calls)}")
            print(f"5xx: {summary['server_errors']}, transport errors: {summary['transport_errors']}")
            print("invariants: every session OK (valid chat, one terminal status per call, gap-free log)")
            print("RESULT " + json.dumps(summary))
            return 0 if summary["server_errors"] == 0 and summary["transport_errors"] == 0 else 1
        finally:
            await asyncio.to_thread(server.stop)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--ops", type=int, default=60, help="commands per session")
    parser.add_argument("--duration-s", type=float, default=60.0, help="stop issuing commands after this")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--database-url", default=None, help="default: SQLite in a temp dir")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="stop after this long, whatever happens")
    sys.exit(asyncio.run(main(parser.parse_args())))
