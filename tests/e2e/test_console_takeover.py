"""The console in Chromium for an operator who takes a session over: the Take over button, the box to speak as the
agent, the user's input shown (and not answered) while held, the Hand back button, and a second operator told who
holds the session (and able to take it anyway)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .console_support import api_keys, console_server, create_session, open_session, signed_in_page, wait_until
from .server import Server

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.timeout(240)]

KEY = "day-desk-key-0123456789ab"
OTHER = "night-desk-key-0123456789"
SCOPES = ["sessions:read", "sessions:write", "sessions:control", "events:read"]
KEYS = api_keys((KEY, "day-desk", SCOPES), (OTHER, "night-desk", SCOPES))
# a speech that outlasts what the operator does before taking over, however loaded the machine (60 s at 10 words a
# second): the takeover is what ends it
LONG = " ".join(f"word{i}" for i in range(600))


@pytest.fixture(autouse=True)
def no_leaked_tasks() -> None:
    """These tests run no event loop of their own (see test_console.py)."""


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with console_server(tmp_path_factory, "takeover", KEYS) as server:
        yield server


@pytest.fixture
def client(srv: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=10, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


@pytest.fixture
def page(browser: Any, srv: Server) -> Iterator[Any]:
    with signed_in_page(browser, srv, KEY) as p:
        yield p


def test_take_over_speak_as_the_agent_and_hand_back(page: Any, srv: Server, client: httpx.Client) -> None:
    sid = create_session(client, [{"text": LONG}, {"text": "The agent answers your refund question."}])
    open_session(page, srv, sid)
    assert page.is_hidden("#op-handback") and page.is_hidden("#op-takeover-text")
    page.fill("#op-text", "tell me everything")
    page.click("#op-send")
    page.wait_for_selector(".row.speech[data-state='speaking']")

    page.click("#op-takeover")
    page.wait_for_selector("[data-type='session.taken_over']")
    page.wait_for_selector(".row.speech.interrupted")
    page.wait_for_selector(".takeover[data-held='true']")
    assert "Held by day-desk" in page.inner_text(".takeover-status")
    assert client.get(f"/v1/sessions/{sid}").json()["takeover"]["operator"] == "day-desk"

    # the user speaks while the session is held: shown in the timeline, no reply is generated
    client.post(f"/v1/sessions/{sid}/input", json={"text": "hello? my refund?"})
    page.wait_for_selector(".row.user:has-text('hello? my refund?')")
    page.fill("#op-takeover-text", "Hi, I am a person from the desk.")
    page.click("#op-takeover-say")
    page.wait_for_selector("[data-type='operator.spoke']", state="attached")
    page.wait_for_selector(".row.operator[data-action='takeover_say']")
    assert page.input_value("#op-takeover-text") == ""
    generations = page.eval_on_selector_all("[data-type='generation.started']", "els => els.length")
    assert generations == 1  # the first reply only

    client.post(f"/v1/sessions/{sid}/input", json={"text": "thanks, and the refund?"})
    page.wait_for_selector(".row.user:has-text('thanks, and the refund?')")
    page.click("#op-handback")
    page.wait_for_selector("[data-type='session.handed_back']")
    page.wait_for_selector(".takeover[data-held='false']")
    page.wait_for_selector(".row.speech:has-text('The agent answers your refund question.')")
    assert client.get(f"/v1/sessions/{sid}").json()["takeover"] is None


def test_a_second_operator_is_told_who_holds_it_and_may_take_it_anyway(
    page: Any, srv: Server, client: httpx.Client
) -> None:
    sid = create_session(client, [])
    other = {"Authorization": f"Bearer {OTHER}"}
    open_session(page, srv, sid)
    r = client.post(f"/v1/sessions/{sid}/takeover", json={}, headers=other)
    assert r.status_code == 200, r.text
    page.wait_for_selector(".takeover[data-held='true']")
    assert "Held by night-desk" in page.inner_text(".takeover-status")
    # this console does not hold it: handing back is refused, and it says why
    page.click("#op-handback")
    page.wait_for_selector(".error-box:visible:has-text(\"held by 'night-desk'\")")
    client.delete(f"/v1/sessions/{sid}/takeover", headers=other)
    page.wait_for_selector(".takeover[data-held='false']")
    client.post(f"/v1/sessions/{sid}/takeover", json={}, headers=other)
    page.wait_for_selector(".takeover[data-held='true']")
    # taken again meanwhile by the other desk, while this console showed it free: Take over answers 409, then force
    page.evaluate("() => { document.querySelector('#op-takeover').hidden = false; }")
    page.click("#op-takeover")
    page.wait_for_selector("#op-takeover-force:visible")
    page.click("#op-takeover-force")
    wait_until(lambda: "Held by day-desk" in page.inner_text(".takeover-status"), what="held by this desk")
    held = client.get(f"/v1/sessions/{sid}").json()["takeover"]
    assert held["operator"] == "day-desk" and held["displaced"] == "night-desk"
