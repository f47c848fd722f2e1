"""A tool that ignores its cancellation, cancelled over REST and from the console, against a real server: the call
stays listed as running, `cancelling`, until it ends (here: until its session closes, which lets its body go)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .console_support import checked_page, server_events, wait_until
from .server import Server

pytestmark = pytest.mark.e2e

AGENTS = "tests.agents_fixture:AGENTS,tests.agents_fixture:STUBBORN_AGENTS"


@pytest.fixture(autouse=True)
def no_leaked_tasks() -> None:
    """Replaces the suite's asyncio task check: the server is another process, and Playwright's sync API keeps an
    event loop running in this thread."""


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(tmp_path_factory.mktemp("cancelling"), SWITCHBOARD_AGENTS=AGENTS).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def client(srv: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        yield c


def deaf_call(server: Server, client: httpx.Client) -> tuple[str, str]:
    """A session whose tool ignores every request to stop, and that call, running."""
    turns = [{"text": "", "tool_calls": [{"name": "deaf", "arguments": {}}]}]
    r = client.post("/v1/sessions", json={"agent": "stubborn", "llm": {"provider": "scripted", "turns": turns}})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    assert client.post(f"/v1/sessions/{sid}/input", json={"text": "go"}).status_code == 202
    # its body runs once it is reported started (a call cancelled before that never runs)
    started = wait_until(
        lambda: [e for e in server_events(server, sid, idle_s=0.05) if e["type"] == "tool.started"], what="tool.started"
    )
    return sid, started[0]["data"]["call_id"]


def test_a_rest_cancel_of_a_tool_that_ignores_it_answers_cancelling_and_the_call_stays_listed(
    srv: Server, client: httpx.Client
) -> None:
    sid, call_id = deaf_call(srv, client)
    cancel = f"/v1/sessions/{sid}/tool-calls/{call_id}/cancel"
    r = client.post(cancel)
    assert r.status_code == 200 and r.json()["status"] == "cancelling", r.text
    listed = client.get(f"/v1/sessions/{sid}/tool-calls?status=running").json()["items"]
    assert [(c["call_id"], c["status"]) for c in listed] == [(call_id, "cancelling")]
    everywhere = client.get("/v1/tool-calls?status=running").json()["items"]
    assert (sid, call_id) in [(c["session_id"], c["call_id"]) for c in everywhere]
    assert client.post(cancel).json()["status"] == "cancelling"  # again: at once, nothing changes

    assert client.delete(f"/v1/sessions/{sid}").status_code == 204  # the close lets the body go
    assert client.get(f"/v1/sessions/{sid}/tool-calls/{call_id}").json()["status"] == "cancelled"
    tool_events = [(e["type"], e["data"].get("status")) for e in server_events(srv, sid) if e["type"] != "chat.item"]
    tool_events = [t for t in tool_events if t[0].startswith("tool.")]
    assert tool_events == [("tool.started", None), ("tool.cancelling", None), ("tool.ended", "cancelled")]


@pytest.mark.browser
def test_the_console_shows_a_cancelling_call_as_running_until_it_ends(
    srv: Server, client: httpx.Client, browser: Any
) -> None:
    with checked_page(browser, viewport={"width": 1400, "height": 900}) as page:
        sid, call_id = deaf_call(srv, client)
        page.goto(f"{srv.url}/console/#session={sid}")
        page.click(f'.row.tool[data-call-id="{call_id}"] button.cancel')
        page.wait_for_selector(f'.row.tool[data-call-id="{call_id}"][data-status="cancelling"]')
        assert page.query_selector(f'.row.tool[data-call-id="{call_id}"] button.cancel') is None
        page.wait_for_selector(f'#running-tools li[data-call-id="{call_id}"] .status-cancelling')
        assert client.delete(f"/v1/sessions/{sid}").status_code == 204
        page.wait_for_selector(f'.row.tool[data-call-id="{call_id}"][data-status="cancelled"]')
        page.wait_for_selector(f'#running-tools li[data-call-id="{call_id}"]', state="detached")
        assert page.is_hidden(".error-box")
