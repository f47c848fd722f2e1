"""The console's Talk panel in a real browser (Debian's Chromium via Playwright) as a session's media edge."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from websockets.sync.client import connect

from tests.waiting import WAIT_S

from .console_support import checked_page, create_session, wait_until
from .media_support import KEY, KEYS
from .server import Server

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

ANSWER = (
    "Your train to Geneva leaves from platform seven at a quarter past nine, and it stops in Lausanne, Morges and "
    "Nyon before it arrives in Geneva at ten to eleven."
)


@pytest.fixture(autouse=True)
def no_leaked_tasks() -> None:
    """Replaces the suite's asyncio task check: Playwright's sync API runs its own loop in this thread."""


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    init = f"sessionStorage.setItem('switchboard.apiKey', {json.dumps(KEY)})"
    with checked_page(browser, timeout_ms=15000, init_script=init, viewport={"width": 1400, "height": 1000}) as pg:
        yield pg


def talk_states(page: Any) -> list[list[str]]:
    """Every [state, text] the Talk panel's status has shown since this call, in order (recorded in the page)."""
    return page.evaluate("() => window.talkStates")  # type: ignore[no-any-return]


def record_talk_states(page: Any) -> None:
    page.evaluate(
        """() => {
            const el = document.querySelector('#talk-state');
            window.talkStates = [[el.dataset.state, el.textContent]];
            new MutationObserver(() => window.talkStates.push([el.dataset.state, el.textContent]))
                .observe(el, { attributes: true, childList: true, characterData: true, subtree: true });
        }"""
    )


def media_frames(page: Any) -> list[dict[str, Any]]:
    """Every frame the page sends on a media WebSocket, in order."""
    sent: list[dict[str, Any]] = []

    def watch(ws: Any) -> None:
        if "/media" in ws.url:
            ws.on("framesent", lambda payload: sent.append(json.loads(payload)))

    page.on("websocket", watch)
    return sent


def test_talk_speaks_the_agent_and_a_barge_in_commits_what_was_heard(
    media_srv: Server, media_client: httpx.Client, page: Any
) -> None:
    sid = create_session(media_client, [{"text": ANSWER}, {"text": "Sure, go on."}])
    sent = media_frames(page)
    urls: list[str] = []
    page.on("websocket", lambda ws: urls.append(ws.url))
    page.goto(f"{media_srv.url}/console/#session={sid}")
    page.wait_for_selector('[data-type="session.started"]')

    page.click("#talk-connect")
    page.wait_for_selector('#talk-state[data-state="connected"]')
    # headless Chromium usually has no voice: the panel says how it times the agent's words instead
    mode = page.get_attribute("#talk-voice", "data-mode")
    note = page.inner_text("#talk-voice")
    assert mode in ("voice", "timed") and note
    if mode == "timed":
        assert "words per second" in note

    page.fill("#talk-text", "When does my train leave?")
    page.press("#talk-text", "Enter")
    page.wait_for_selector('.talk-log li.user:has-text("When does my train leave?")')
    # the agent answers and is heard word by word
    page.wait_for_selector('#talk-speech[data-state="playing"]')
    page.wait_for_function("() => Number(document.querySelector('#talk-speech').dataset.playedChars) >= 20")
    speech_id = page.get_attribute("#talk-speech", "data-speech-id")

    page.click("#talk-barge")
    entry = page.wait_for_selector(f'.talk-log li.interrupted[data-speech-id="{speech_id}"]')
    heard = entry.query_selector(".heard").inner_text().strip()
    rest = entry.query_selector(".unheard").inner_text().strip()
    assert heard and rest and f"{heard} {rest}" == ANSWER
    assert page.get_attribute("#talk-speech", "data-state") == "interrupted"

    speech = wait_until(
        lambda: (s := media_client.get(f"/v1/sessions/{sid}/speeches/{speech_id}").json())["state"] == "done" and s,
        what="the speech to end",
    )
    assert speech["interrupted"] is True and speech["played_text"] == heard
    # the timeline shows the interruption too, with the same heard text
    row = page.wait_for_selector(f'.row.speech.interrupted[data-speech-id="{speech_id}"]')
    assert row.query_selector(".heard").inner_text().strip() == heard

    # on the wire: progress only forward, the last one before the barge-in is what was heard, then the stop
    mine = [f for f in sent if f.get("speech_id") in (speech_id, None)]
    kinds = [f["type"] for f in mine]
    barge = kinds.index("user.speech_started")
    progress = [f["played_chars"] for f in mine[:barge] if f["type"] == "playback.progress"]
    assert progress == sorted(set(progress)) and progress[-1] == len(heard)
    assert kinds[0] == "user.transcript" and kinds[1] == "playback.started"
    assert {"type": "playback.finished", "speech_id": speech_id, "interrupted": True} in mine[barge:]
    # the key never travels in a URL: the media socket carries a session token
    assert all(KEY not in u for u in urls)
    assert any("/media?token=sbt_" in u for u in urls)


def test_another_edge_replaces_the_browser_which_says_so(
    media_srv: Server, media_client: httpx.Client, page: Any
) -> None:
    sid = create_session(media_client, [])
    page.goto(f"{media_srv.url}/console/#session={sid}")
    page.click("#talk-connect")
    page.wait_for_selector('#talk-state[data-state="connected"]')
    assert page.is_enabled("#talk-barge") and page.is_enabled("#talk-text")
    headers = {"Authorization": f"Bearer {KEY}"}
    with connect(f"{media_srv.ws_url}/v1/sessions/{sid}/media", additional_headers=headers):
        page.wait_for_selector('#talk-state[data-state="failed"]')
        assert "replaced this browser" in page.inner_text("#talk-state")
        assert page.is_disabled("#talk-barge") and page.is_disabled("#talk-text")
        assert page.inner_text("#talk-connect") == "Connect audio"


def test_talk_reconnects_by_itself_after_a_graceful_restart_and_speaks_again(tmp_path: Path, page: Any) -> None:
    """A graceful restart suspends the session and closes its edge (1012 or 4410): the panel reconnects by itself (a new
    token each attempt, including the ones made while the service is down) once the service is back on the same
    address and has recovered the session, and the agent is heard there again."""
    srv = Server(tmp_path, SWITCHBOARD_API_KEYS=KEYS).start()
    try:
        with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=10) as client:
            sid = create_session(client, [{"text": ANSWER}])
        urls: list[str] = []
        page.on("websocket", lambda ws: "/media" in ws.url and urls.append(ws.url))
        page.goto(f"{srv.url}/console/#session={sid}")
        page.click("#talk-connect")
        page.wait_for_selector('#talk-state[data-state="connected"]')
        record_talk_states(page)

        srv.stop()  # SIGTERM: the session is suspended, the edge closed with 4410
        page.wait_for_selector('#talk-state[data-state="reconnecting"]')
        assert page.inner_text("#talk-connect") == "Disconnect audio" and page.is_disabled("#talk-text")
        srv.start()  # the same port and database: the session is recovered
        # the panel tries for ~35 s; a restart on a loaded machine takes well under that, but more than 20 s at times
        page.wait_for_selector('#talk-state[data-state="connected"]', timeout=60000)

        states = talk_states(page)
        first = states.index(next(s for s in states if s[0] == "reconnecting"))
        # uvicorn says "service restart" (1012) before the suspended session's own 4410 can: either starts it
        reason = states[first][1]
        assert "attempt 1 of 18" in reason and ("restarting" in reason or "not active here" in reason), states
        assert states[-1][0] == "connected" and "failed" not in [s[0] for s in states], states
        tokens = [u.split("token=", 1)[1] for u in urls]
        assert len(tokens) >= 2 and len(set(tokens)) == len(tokens), urls

        page.fill("#talk-text", "Are you still there?")
        page.press("#talk-text", "Enter")
        entry = page.wait_for_selector(".talk-log li.agent[data-speech-id]", timeout=WAIT_S * 1000)
        assert entry.query_selector(".heard").inner_text().strip() == ANSWER
    finally:
        srv.stop()


def test_a_replaced_browser_does_not_reconnect(media_srv: Server, media_client: httpx.Client, page: Any) -> None:
    """Only a 4410 reconnects: replaced by another edge (4409), the panel stays failed and opens nothing more."""
    sid = create_session(media_client, [])
    urls: list[str] = []
    page.on("websocket", lambda ws: "/media" in ws.url and urls.append(ws.url))
    page.goto(f"{media_srv.url}/console/#session={sid}")
    page.click("#talk-connect")
    page.wait_for_selector('#talk-state[data-state="connected"]')
    record_talk_states(page)
    headers = {"Authorization": f"Bearer {KEY}"}
    with connect(f"{media_srv.ws_url}/v1/sessions/{sid}/media", additional_headers=headers):
        page.wait_for_selector('#talk-state[data-state="failed"]')
        time.sleep(2.5)  # longer than the first two pauses of a reconnection
        assert [s[0] for s in talk_states(page)] == ["connected", "failed"]
        assert len(urls) == 1


def test_a_closed_session_is_not_reconnected_to(media_srv: Server, media_client: httpx.Client, page: Any) -> None:
    """A session that has ended answers 1000 (`session closed`) at connect, not 4410: the panel says the session has
    closed and opens nothing more."""
    sid = create_session(media_client, [])
    assert media_client.delete(f"/v1/sessions/{sid}").status_code == 204
    urls: list[str] = []
    page.on("websocket", lambda ws: "/media" in ws.url and urls.append(ws.url))
    page.goto(f"{media_srv.url}/console/#session={sid}")
    page.wait_for_selector("#talk-state")
    record_talk_states(page)
    page.click("#talk-connect")
    page.wait_for_selector('#talk-state:has-text("The session has closed.")')
    time.sleep(2.5)  # longer than the first two pauses of a reconnection
    assert "reconnecting" not in [s[0] for s in talk_states(page)] and len(urls) == 1, (talk_states(page), urls)


def test_reconnecting_is_bounded_and_disconnect_cancels_it(tmp_path: Path, page: Any) -> None:
    """While the service is away, the panel tries 18 times with a pause (about two minutes: the page runs on a fake
    clock, moved on by hand past each pause), then gives up and says so; the operator's Disconnect cancels a pending
    attempt."""
    page.clock.install()  # time flows as usual until the test moves it on
    srv = Server(tmp_path, SWITCHBOARD_API_KEYS=KEYS).start()
    try:
        with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=10) as client:
            sid = create_session(client, [])
        page.goto(f"{srv.url}/console/#session={sid}")
        page.click("#talk-connect")
        page.wait_for_selector('#talk-state[data-state="connected"]')

        srv.stop()  # a graceful stop (1012, or the suspended session's 4410), and the service stays away
        page.wait_for_selector('#talk-state[data-state="reconnecting"]')
        page.click("#talk-connect")  # "Disconnect audio" while reconnecting
        assert page.get_attribute("#talk-state", "data-state") == "idle"
        record_talk_states(page)
        time.sleep(3)  # past the pending pause (0.5 s) and the next ones (1 s, 2 s)
        assert [s[0] for s in talk_states(page)] == ["idle"], talk_states(page)  # nothing attempted since

        srv.start()
        page.click("#talk-connect")
        page.wait_for_selector('#talk-state[data-state="connected"]')
        record_talk_states(page)
        srv.stop()
        seen = 0
        for _ in range(200):  # bound: each round moves the page's clock past the longest pause
            if page.get_attribute("#talk-state", "data-state") == "failed":
                break
            shown = len(talk_states(page))
            if shown > seen:  # an attempt was shown: let it fail (a refused connection) before the next pause
                seen = shown
                time.sleep(0.2)
                continue
            page.clock.fast_forward(8000)
            time.sleep(0.05)
        assert "Gave up reconnecting after 18 attempts" in page.inner_text("#talk-state"), talk_states(page)
        assert page.inner_text("#talk-connect") == "Connect audio"
        attempts = [int(m) for s in talk_states(page) if (m := s[1].partition("(attempt ")[2].split(" ")[0]).isdigit()]
        assert sorted(set(attempts)) == list(range(1, 19))
    finally:
        srv.stop()


class MediaRoute:
    """Every media WebSocket of the page passes through here to the real service, frames recorded each way; the
    connection can be lost right after the service took a final transcript, before its `transcript.taken` reached
    the page (the node that ran the session went away: the edge is closed 4410, as a relaying node does)."""

    def __init__(self, page: Any) -> None:
        self.urls: list[str] = []
        self.up: list[list[dict[str, Any]]] = []  # per connection: the page's frames
        self.withheld: list[dict[str, Any]] = []
        self.lose_next_taken = False
        page.route_web_socket(re.compile(r"/v1/sessions/[^/]+/media"), self._route)

    def _route(self, ws: Any) -> None:
        server = ws.connect_to_server()
        up: list[dict[str, Any]] = []
        self.urls.append(ws.url)
        self.up.append(up)

        def to_server(message: str | bytes) -> None:
            up.append(json.loads(message))
            server.send(message)

        def to_page(message: str | bytes) -> None:
            frame = json.loads(message)
            if frame["type"] == "transcript.taken" and self.lose_next_taken:
                self.lose_next_taken = False
                self.withheld.append(frame)
                server.close()
                ws.close(code=4410, reason="session owner unreachable")
                return
            ws.send(message)

        ws.on_message(to_server)
        server.on_message(to_page)


def test_talk_sends_a_line_again_with_its_id_until_the_service_says_it_took_it(
    media_srv: Server, media_client: httpx.Client, page: Any
) -> None:
    """The connection is lost after the service took a typed line and before its `transcript.taken` reached the page:
    the panel reconnects and sends the line again first, with the same id; the chat holds it once and the panel's
    log shows it taken. Each connection carries the page's edge id and its attempt's number."""
    sid = create_session(media_client, [{"text": "Booked."}])
    route = MediaRoute(page)
    page.goto(f"{media_srv.url}/console/#session={sid}")
    page.click("#talk-connect")
    page.wait_for_selector('#talk-state[data-state="connected"]')

    route.lose_next_taken = True
    page.fill("#talk-text", "A table for four.")
    page.press("#talk-text", "Enter")
    page.wait_for_selector('#talk-state[data-state="reconnecting"]')
    entry = page.wait_for_selector('.talk-log li.user[data-state="taken"]', timeout=WAIT_S * 1000)
    [lost] = route.withheld
    assert entry.get_attribute("data-transcript-id") == lost["id"]
    first, second = route.up[0], route.up[1]
    said = [f for f in first if f["type"] == "user.transcript"]
    assert said == [{"type": "user.transcript", "text": "A table for four.", "final": True, "id": lost["id"]}]
    assert second[0] == said[0]  # sent again first on the new connection, the same id
    assert uuid.UUID(lost["id"]).version == 4
    chat = media_client.get(f"/v1/sessions/{sid}/chat").json()["items"]
    assert [i["text"] for i in chat if i["type"] == "message" and i["role"] == "user"] == ["A table for four."]

    # a line beyond the service's text limit is refused for good: shown as given up, never sent again
    page.fill("#talk-text", "x" * 8001)
    page.press("#talk-text", "Enter")
    page.wait_for_selector('.talk-log li.user[data-state="dropped"]')
    page.wait_for_selector('.talk-log li.note:has-text("is given up (text_too_long)")')

    queries = [parse_qs(urlsplit(u).query) for u in route.urls]
    assert [q["connection"] for q in queries] == [["1"], ["2"]]
    assert len({q["edge_id"][0] for q in queries}) == 1 and len(queries[0]["edge_id"][0]) == 22
    assert all(q["token"][0].startswith("sbt_") for q in queries)


def test_talk_sends_a_line_refused_over_budget_again_after_the_wait_it_was_given(tmp_path: Path, page: Any) -> None:
    """The credential's transcript budget holds one line (a burst of 100 characters, 50 more a second): the second
    line typed at once is refused `rate_limited`, kept, sent again on the same connection after `retry_after_s`, and
    taken; the chat holds each line once."""
    srv = Server(tmp_path, SWITCHBOARD_API_KEYS=KEYS, SWITCHBOARD_MEDIA_TRANSCRIPT_CHARS_PER_S="50").start()
    try:
        with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=10) as client:
            sid = create_session(client, [{"text": "Noted."}, {"text": "Noted again."}])
            sent = media_frames(page)
            page.goto(f"{srv.url}/console/#session={sid}")
            page.click("#talk-connect")
            page.wait_for_selector('#talk-state[data-state="connected"]')
            for line in ("A table for four.", "At eight."):
                page.fill("#talk-text", line)
                page.press("#talk-text", "Enter")
            page.wait_for_selector('.talk-log li.note:has-text("rate_limited")')
            wait_until(lambda: len(page.query_selector_all('.talk-log li.user[data-state="taken"]')) == 2)
            said = [(f["text"], f["id"]) for f in sent if f["type"] == "user.transcript"]
            first, second = said[0], said[1]
            assert said == [first, second, second], said  # the refused line again, with its id, and nothing else
            chat = client.get(f"/v1/sessions/{sid}/chat").json()["items"]
            users = [i["text"] for i in chat if i["type"] == "message" and i["role"] == "user"]
            assert users == ["A table for four.", "At eight."]
    finally:
        srv.stop()
