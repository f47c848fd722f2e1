"""A stopped server exits within its bounds, whatever its tools do.

On SIGTERM uvicorn ends the process by the signal itself once it has shut down; on SIGINT (Ctrl-C) the process ends
its event loop, which cancels and waits for every task still running: a tool body abandoned because it ignores
cancellation kept the process alive for ever."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.waiting import WAIT_S

from .server import Server

pytestmark = pytest.mark.e2e

# the tool's body gets 1 s to end after its cancel (TOOL_ABANDON_GRACE_S), the rest of the process 5 s (EXIT_GRACE_S)
EXIT_BOUND_S = 15.0


async def test_ctrl_c_stops_a_server_whose_tool_ignores_cancellation_and_names_the_tool(tmp_path: Path) -> None:
    agents = "tests.agents_fixture:AGENTS,tests.agents_fixture:STUBBORN_AGENTS"
    server = Server(tmp_path, SWITCHBOARD_AGENTS=agents).start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
            turns = [{"text": "", "tool_calls": [{"name": "deaf", "arguments": {}}]}]
            r = await client.post(
                "/v1/sessions", json={"agent": "stubborn", "llm": {"provider": "scripted", "turns": turns}}
            )
            assert r.status_code == 201, r.text
            sid = r.json()["id"]
            assert (await client.post(f"/v1/sessions/{sid}/input", json={"text": "go"})).status_code == 202
            async with asyncio.timeout(WAIT_S):
                while not (await client.get(f"/v1/sessions/{sid}/tool-calls?status=running")).json()["items"]:
                    await asyncio.sleep(0.05)
        assert server.proc is not None
        stopped = time.monotonic()
        server.proc.send_signal(signal.SIGINT)
        try:
            server.proc.wait(EXIT_BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {EXIT_BOUND_S:g} s after Ctrl-C:\n{server.logs()}")
        assert time.monotonic() - stopped < EXIT_BOUND_S
        assert "tool deaf ignores cancellation" in server.logs()
        assert "ignore cancellation 5 s after the server stopped; exiting without them: tool-body:deaf" in server.logs()
    finally:
        server.kill()
