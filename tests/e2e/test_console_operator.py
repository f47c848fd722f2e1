"""The console in Chromium for an operator's shift: the audit trail in the timeline, export, what has been heard so
far while the agent speaks, and progress bars that never make up a percentage."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.waiting import WAIT_S

from .console_support import api_keys, console_server, create_session, open_session, signed_in_page, wait_until
from .server import Server

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.timeout(240)]

KEY = "night-desk-key-0123456789"
KEYS = api_keys(
    (KEY, "night-desk", ["sessions:read", "sessions:write", "sessions:control", "tools:cancel", "events:read"])
)
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(autouse=True)
def no_leaked_tasks() -> None:
    """These tests run no event loop of their own (see test_console.py)."""


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with console_server(tmp_path_factory, "operator", KEYS) as server:
        yield server


@pytest.fixture
def client(srv: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=10, headers=AUTH) as c:
        yield c


@pytest.fixture
def page(browser: Any, srv: Server) -> Iterator[Any]:
    with signed_in_page(browser, srv, KEY, accept_downloads=True) as p:
        yield p


def operator_rows(page: Any) -> list[tuple[str, str]]:
    rows = page.eval_on_selector_all(
        ".timeline .row.operator",
        "els => els.map(e => [e.dataset.action, e.querySelector('.who').textContent])",
    )
    return [(action, who) for action, who in rows]


def test_the_timeline_shows_who_did_what_and_the_export_downloads_it(
    page: Any, srv: Server, client: httpx.Client, tmp_path: Path
) -> None:
    long = " ".join(f"word{i}" for i in range(80))
    turns = [{"text": long}, {"text": "On it.", "tool_calls": [{"name": "search", "arguments": {"query": "x"}}]}]
    sid = create_session(client, turns, sid="audited", metadata={"caller": "+41 22"})
    open_session(page, srv, sid)
    page.fill("#op-text", "hello")
    page.click("#op-send")
    page.wait_for_selector(".row.speech[data-state='speaking']")
    page.click("#op-interrupt-now")
    page.wait_for_selector(".row.speech.interrupted")
    # a command from elsewhere (a backend, with its own Idempotency-Key) is in the same trail
    client.post(f"/v1/sessions/{sid}/input", json={"text": "search"}, headers={"Idempotency-Key": "crm-42"})
    page.wait_for_selector(".timeline .row.tool[data-status='running']")
    page.click(".timeline .row.tool .cancel")
    page.wait_for_selector(".timeline .row.tool[data-status='cancelled']")
    wait_until(lambda: len(operator_rows(page)) == 4, what="four operator rows")
    assert operator_rows(page) == [
        ("input", "Operator night-desk"),
        ("interrupt", "Operator night-desk"),
        ("input", "Operator night-desk"),
        ("cancel_tool", "Operator night-desk"),
    ]
    assert "Idempotency-Key crm-42" in page.inner_text(".row.operator[data-action='input']:has-text('crm-42')")
    assert "sent “hello”" in page.inner_text(".row.operator[data-action='input']")
    assert "cancelled the tool call search" in page.inner_text(".row.operator[data-action='cancel_tool']")
    # the tool's output in the chat says who cancelled it
    assert "cancelled by the operator night-desk" in page.inner_text(".row.tool[data-status='cancelled']")

    page.click("#op-close")
    page.click("#op-close-confirm")
    page.wait_for_selector("[data-type='session.closed']")
    wait_until(lambda: [a for a, _ in operator_rows(page)][-1:] == ["close"], what="the close row")

    # export works for the closed session, and holds what the timeline shows
    with page.expect_download() as download_info:
        page.click("#op-export")
    download = download_info.value
    assert download.suggested_filename == f"session-{sid}.json"
    target = tmp_path / download.suggested_filename
    download.save_as(target)
    doc = json.loads(target.read_text())
    assert doc["format"] == "switchboard.session-export/1"
    assert doc["session"]["id"] == sid and doc["session"]["state"] == "closed"
    assert doc["session"]["metadata"] == {"caller": "+41 22"}
    actions = [(e["data"]["action"], e["data"]["actor"]) for e in doc["events"] if e["type"] == "operator.action"]
    assert actions == [
        ("input", "night-desk"),
        ("interrupt", "night-desk"),
        ("input", "night-desk"),
        ("cancel_tool", "night-desk"),
        ("close", "night-desk"),
    ]
    assert [c["status"] for c in doc["tool_calls"]] == ["cancelled"]
    assert KEY not in target.read_text()


def test_what_has_been_heard_grows_while_the_agent_speaks(page: Any, srv: Server, client: httpx.Client) -> None:
    words = " ".join(f"word{i}" for i in range(120))  # 12 s at 10 words/s
    sid = create_session(client, [{"text": words}], sid="heard-live")
    open_session(page, srv, sid)
    client.post(f"/v1/sessions/{sid}/input", json={"text": "talk to me"})
    seen: list[str] = []

    def heard_grew() -> bool:
        heard = page.inner_text(".live-heard") if page.query_selector(".live-heard") else ""
        if heard and (not seen or heard != seen[-1]):
            seen.append(heard)
        return len(seen) >= 3

    wait_until(heard_grew, interval=0.1, what="heard text growing")
    # what was heard comes first, in plain text; the rest of what was generated after it, muted
    assert all(words.startswith(h) for h in seen) and [len(h) for h in seen] == sorted(len(h) for h in seen)
    rest = page.inner_text(".live-rest")
    assert rest.endswith("…") and words.endswith(rest.rstrip(" …").strip())
    assert "speech.done" not in page.eval_on_selector_all(
        ".timeline [data-type]", "els => els.map(e => e.dataset.type)"
    )
    client.post(f"/v1/sessions/{sid}/interrupt", json={})
    page.wait_for_selector(".row.speech.interrupted")
    assert page.query_selector(".live-text") is None


def test_progress_without_a_fraction_is_indeterminate_and_a_completed_call_is_full(
    page: Any, srv: Server, client: httpx.Client
) -> None:
    turns = [
        {"text": "Working on it.", "tool_calls": [{"name": "vague", "arguments": {"step_s": 2.0}}]},
        {"text": "Started."},
        {"text": "Done: {{tool_output:vague}}"},
    ]
    sid = create_session(client, turns, sid="vague-bars")
    open_session(page, srv, sid)
    client.post(f"/v1/sessions/{sid}/input", json={"text": "go"})
    bar = ".timeline .row.tool progress"
    running_bar = f"#running-tools li[data-session-id='{sid}'] progress"
    page.wait_for_selector(bar)
    # no fraction reported: an indeterminate bar (no value), in the timeline and in the running list
    wait_until(lambda: "no idea" in page.inner_text(".timeline .row.tool"), what="first report")
    assert page.eval_on_selector(bar, "b => b.hasAttribute('value')") is False
    page.wait_for_selector(running_bar, state="attached")
    assert page.eval_on_selector(running_bar, "b => b.hasAttribute('value')") is False
    wait_until(lambda: page.eval_on_selector(bar, "b => b.value") == 0.67, what="two thirds")
    page.wait_for_selector(".timeline .row.tool[data-status='completed']", timeout=WAIT_S * 1000)
    assert page.eval_on_selector(bar, "b => b.value") == 1, "a completed call is at 100%, not where its last report was"
