"""The console's Talk panel in a real browser (Debian's Chromium via Playwright) as a session's media edge."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from websockets.sync.client import connect

from .console_support import checked_page, create_session, wait_until
from .media_support import KEY
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
        timeout=15,
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
