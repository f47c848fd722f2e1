"""The MCP endpoint's protocol (the official SDK) starts with the first request that reaches it: importing the
application, the agents file or the command line imports nothing of the SDK (it was a fifth of a server's start),
first requests at once start it once, and the application's end stops it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

from switchboard.api.mcp.server import McpService
from tests.waiting import WAIT_S

from .conftest import Api

HEADERS = {"accept": "application/json, text/event-stream", "content-type": "application/json"}


def _service(api: Api) -> McpService:
    found = [r.endpoint for r in api.app.router.routes if isinstance(getattr(r, "endpoint", None), McpService)]
    assert len(found) == 1
    return found[0]


async def _list_tools(api: Api, n: int) -> dict[str, Any]:
    body = {"jsonrpc": "2.0", "id": n, "method": "tools/list", "params": {}}
    r = await api.client.post("/mcp", json=body, headers=HEADERS)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_the_server_and_the_command_line_import_nothing_of_the_sdk() -> None:
    probe = (
        "import sys\n"
        "import switchboard.api.app, switchboard.cli.main, switchboard.integrations.agents_file\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mcp', 'mcp_types')))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


async def test_first_requests_at_once_start_one_protocol_and_all_are_answered(api: Api) -> None:
    service = _service(api)
    assert service._task is None  # nothing started before a request came
    answers = await asyncio.gather(*(_list_tools(api, n) for n in range(5)))
    names = {tool["name"] for tool in answers[0]["result"]["tools"]}
    assert {"list_sessions", "inject_input", "interrupt"} <= names, names
    assert all(a["result"] == answers[0]["result"] for a in answers)
    started = service._task
    assert started is not None and not started.done()
    await _list_tools(api, 9)
    assert service._task is started  # one protocol for every request after it


async def test_a_first_caller_that_goes_away_leaves_the_protocol_starting_for_the_next(api: Api) -> None:
    service = _service(api)
    first = asyncio.create_task(_list_tools(api, 1))
    while service._task is None:  # its request reached the endpoint and started the protocol
        await asyncio.sleep(0)
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    answer = await _list_tools(api, 2)
    assert answer["result"]["tools"], answer


async def test_the_applications_end_stops_the_protocol(api: Api) -> None:
    await _list_tools(api, 1)
    service = _service(api)
    task = service._task
    assert task is not None
    async with service.run():  # another lifespan's block, left at once: the same as the application's end
        pass
    assert task.done() and service._task is None
