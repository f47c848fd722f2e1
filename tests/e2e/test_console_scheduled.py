"""The console in Chromium: the Coach box (a note for the agent's next reply only, in the timeline and the audit
trail, never in the transcript) and the "when" choice beside the inject box (input that waits for the agent to be
idle, listed as pending with a Cancel button, then applied)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .console_support import api_keys, console_server, create_session, signed_in_page, wait_until
from .server import Server

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.timeout(240)]

KEY = "coach-desk-key-0123456789"
KEYS = api_keys(
    (KEY, "coach-desk", ["sessions:read", "sessions:write", "sessions:control", "tools:cancel", "events:read"])
)
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(autouse=True)
def no_leaked_tasks() -> None:
    """These tests run no event loop of their own (see test_console.py)."""


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with console_server(tmp_path_factory, "coach", KEYS) as server:
        yield server


@pytest.fixture
def client(srv: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=10, headers=AUTH) as c:
        yield c


@pytest.fixture
def page(browser: Any, srv: Server) -> Iterator[Any]:
    with signed_in_page(browser, srv, KEY) as p:
        yield p


def chat(client: httpx.Client, sid: str) -> list[dict[str, Any]]:
    return list(client.get(f"/v1/sessions/{sid}/chat").json()["items"])


def test_coach_and_inject_when_idle(page: Any, srv: Server, client: httpx.Client) -> None:
    # a speech that outlasts everything the operator does while it plays, however loaded the machine (60 s at 10
    # words a second); the test interrupts it when it needs the agent idle
    long = " ".join(f"word{i}" for i in range(600))
    sid = create_session(client, [{"text": long}, {"text": "Noted: {{coach}}"}], sid="coached")
    page.goto(f"{srv.url}/console/#session={sid}")
    page.wait_for_selector("[data-type='session.started']")
    page.fill("#op-text", "talk to me")
    page.click("#op-send")
    page.wait_for_selector(".row.speech[data-state='speaking']")

    # input that waits for the agent to finish: it is listed as pending, the speech is not cut off
    page.select_option("#op-when", "idle")
    page.fill("#op-text", "are you done?")
    page.click("#op-send")
    page.wait_for_selector("#op-scheduled li[data-kind='input']")
    assert "when idle" in page.inner_text("#op-scheduled")
    assert page.input_value("#op-when") == "now"  # the next command is for now unless chosen again

    # a "when" that needs a call id says so, and sends nothing
    page.select_option("#op-when", "after_tool")
    page.fill("#op-text", "x")
    page.click("#op-say")
    page.wait_for_selector(".error-box:has-text('id of the tool call')")
    page.select_option("#op-when", "now")
    page.fill("#op-text", "")

    # a scheduled say, then cancelled from the list
    page.select_option("#op-when", "after_speech")
    page.fill("#op-text", "never said")
    page.click("#op-say")
    page.wait_for_selector("#op-scheduled li[data-kind='say']")
    page.click("#op-scheduled li[data-kind='say'] .cancel-scheduled")
    page.wait_for_selector("#op-scheduled li[data-kind='say']", state="detached")

    # the coach box: a note for the next reply only
    page.fill("#op-coach", "offer the refund")
    page.click("#op-coach-send")
    page.wait_for_selector(".row.coach:has-text('offer the refund')")
    page.wait_for_selector("#op-coach-status:has-text('next reply')")

    page.wait_for_selector(".row.operator[data-action='coach']")
    page.wait_for_selector(".row.operator[data-action='schedule']")
    page.wait_for_selector(".row.operator[data-action='cancel_scheduled']")

    # the speech plays on, the input still waiting for its end; the test ends it
    assert page.is_visible("#op-scheduled li[data-kind='input']")
    stop = client.post(f"/v1/sessions/{sid}/interrupt", json={})
    assert stop.status_code == 200 and stop.json()["interrupted"], stop.text

    def answered() -> bool:
        items = chat(client, sid)
        return any(it.get("text") == "Noted: offer the refund" for it in items)

    wait_until(answered, what="the reply the note was given to")
    items = chat(client, sid)
    assert [it["text"] for it in items if it.get("role") == "user"] == ["talk to me", "are you done?"]
    roles = [it.get("role") for it in items if it.get("type") == "message"]
    assert roles[:3] == ["user", "assistant", "user"]  # the scheduled input waited for the end of the speech
    assert not any(it.get("role") == "system" for it in items)  # the note is not in the transcript
    assert "never said" not in json.dumps(items)
    page.wait_for_selector("#op-scheduled-empty:visible")
