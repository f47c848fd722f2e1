"""Load, small enough for CI: concurrent sessions with concurrent inputs, interrupts, cancels, says, reads and
WebSocket subscribers against a real server; afterwards every session must hold the invariants (``check_session``:
valid chat, one terminal status and one output per tool call, a gap-free log that the live subscribers received
exactly). Latencies are printed, never asserted: ``bench/load.py`` runs the same workload bigger, for figures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .server import Server
from .traffic import LoadConfig, run_load

pytestmark = pytest.mark.e2e


@pytest.fixture
def load_server(tmp_path) -> Iterator[Server]:
    srv = Server(tmp_path).start()
    try:
        yield srv
    finally:
        srv.stop()


async def test_concurrent_sessions_keep_every_invariant(load_server: Server):
    cfg = LoadConfig(sessions=6, ops_per_session=25, duration_s=12.0)
    report = await run_load(load_server, cfg)
    print("\n" + report.recorder.table())
    print(f"events checked: {report.events}; tool calls: {dict(report.tool_calls)}")
    assert report.recorder.server_errors == 0, report.recorder.rows()
    assert report.recorder.transport_errors == 0, report.recorder.rows()
    assert len(report.checks) == cfg.sessions
    ops = {row["op"]: row for row in report.recorder.rows()}
    # the workload did what it says: commands of every kind were accepted, tool calls ran and some were cancelled
    for op in ("input", "interrupt", "say", "close"):
        assert ops[op]["2xx"] > 0, ops[op]
    assert sum(report.tool_calls.values()) >= cfg.sessions, report.tool_calls
    assert "Traceback" not in load_server.logs(), load_server.logs()[-3000:]
