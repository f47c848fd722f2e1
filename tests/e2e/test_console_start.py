"""A newcomer's first minutes in the console, in Chromium against a real server with auth on: an empty service says
how to start, "New session" starts one with the tab's key and opens it, and a reply interrupted before any of its
words were heard says so instead of showing an empty card."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .console_support import api_keys, console_server, create_session, signed_in_page, wait_until
from .server import Server

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.timeout(240)]

KEY = "first-hour-key-0123456789"
KEYS = api_keys(
    (KEY, "newcomer", ["sessions:read", "sessions:write", "sessions:control", "tools:cancel", "events:read"])
)
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(autouse=True)
def no_leaked_tasks() -> None:
    """These tests run no event loop of their own (see test_console.py)."""


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with console_server(tmp_path_factory, "start", KEYS) as server:
        yield server


@pytest.fixture
def client(srv: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=10, headers=AUTH) as c:
        yield c


@pytest.fixture
def page(browser: Any, srv: Server) -> Iterator[Any]:
    with signed_in_page(browser, srv, KEY) as p:
        yield p


def test_an_empty_console_says_how_to_start_and_new_session_starts_and_opens_one(
    srv: Server, client: httpx.Client, page: Any
) -> None:
    assert client.get("/v1/sessions").json()["items"] == []  # the first test of the module: nothing yet
    empty = page.wait_for_selector("#sessions-empty:visible")
    assert "New session" in empty.inner_text()
    assert "New session" in page.inner_text("#session-view")
    page.click("#new-session-open")
    page.wait_for_selector("#new-session-agent option[value='tester']", state="attached")
    page.select_option("#new-session-agent", "tester")
    page.fill("#new-session-text", "Hello from the console")
    page.click("#new-session-start")
    # the new session opens: its timeline shows it started and the first message
    page.wait_for_selector("[data-type='session.started']")
    page.wait_for_selector(".row:has-text('Hello from the console')")
    sid = page.evaluate("new URLSearchParams(location.hash.slice(1)).get('session')")
    session = client.get(f"/v1/sessions/{sid}").json()
    assert session["agent"] == "tester"
    items = client.get(f"/v1/sessions/{sid}/chat").json()["items"]
    assert [i["text"] for i in items if i.get("role") == "user"] == ["Hello from the console"]
    page.wait_for_selector(f"#sessions tr:has-text('{sid}')")
    assert page.is_hidden("#new-session-form") and page.is_hidden("#sessions-empty")


def test_a_reply_interrupted_before_any_word_was_heard_says_so(srv: Server, client: httpx.Client, page: Any) -> None:
    # the model takes its time to answer: the operator interrupts while it is still thinking
    sid = create_session(client, [{"text": "You will never hear this.", "ttft_ms": 30000}])
    page.goto(f"{srv.url}/console/#session={sid}")
    page.wait_for_selector("[data-type='session.started']")
    client.post(f"/v1/sessions/{sid}/input", json={"text": "hello?"})
    page.wait_for_selector(".row.speech[data-state='thinking']")
    page.click("#op-interrupt-now")
    row = page.wait_for_selector(".row.speech.interrupted")
    wait_until(lambda: "interrupted before any words were heard" in row.inner_text(), what="the card's text")
    assert row.query_selector(".badge.state").inner_text() == "interrupted"
    # as in the chat, where nothing was committed for it
    items = client.get(f"/v1/sessions/{sid}/chat").json()["items"]
    assert not [i for i in items if i.get("role") == "assistant"]
