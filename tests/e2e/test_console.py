"""The operator console in a real browser (Debian's Chromium via Playwright) against a real server."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.sync.client import connect

from tests.waiting import WAIT_S

from .console_support import (
    checked_page,
    create_session,
    row_seqs,
    server_events,
    wait_until,
)
from .server import Server

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

LONG = " ".join(f"word{i}" for i in range(120))
ADMIN_KEY = "admin-key-0123456789abcdef"
KEYS = json.dumps(
    [
        {
            "key": ADMIN_KEY,
            "scopes": ["sessions:read", "sessions:write", "sessions:control", "tools:cancel", "events:read"],
        }
    ]
)


@pytest.fixture(autouse=True)
def no_leaked_tasks() -> None:
    """Replaces the suite's asyncio task check: these tests run no event loop of their own (the server is another
    process), and Playwright's sync API keeps one running in this thread, which an async fixture cannot share."""


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(tmp_path_factory.mktemp("console"), SWITCHBOARD_WORDS_PER_SECOND="20").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def client(srv: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        yield c


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    with checked_page(browser, viewport={"width": 1400, "height": 900}) as pg:
        yield pg


def open_session(page: Any, server: Server, sid: str, fragment: str = "") -> None:
    page.goto(f"{server.url}/console/#session={sid}{fragment}")
    page.wait_for_selector('[data-type="session.started"], [data-type="session.recovered"]')


def assert_rows_match_log(page: Any, events: list[dict[str, Any]]) -> None:
    seqs = row_seqs(page)
    assert seqs == [e["seq"] for e in events], "every event is one row, in seq order, none twice"
    assert seqs == list(range(1, len(seqs) + 1))


def test_console_is_served_and_redirects(srv: Server, client: httpx.Client) -> None:
    r = client.get("/console")
    assert r.status_code in (307, 308) and r.headers["location"].endswith("/console/")
    page = client.get("/console/")
    assert page.status_code == 200 and '<script type="module" src="./main.js">' in page.text
    for asset in (
        "main.js",
        "api.js",
        "stream.js",
        "timeline.js",
        "session_view.js",
        "overview.js",
        "talk.js",
        "takeover.js",
        "speaker.js",
        "new_session.js",
        "console.css",
    ):
        assert client.get(f"/console/{asset}").status_code == 200, asset


def test_multi_session_stream_from_now_skips_history(srv: Server, client: httpx.Client) -> None:
    """The overview loads a snapshot, so it follows /v1/events from the live tail (cursor=now), not from 0."""
    old = create_session(client, [])
    assert server_events(srv, old)[0]["type"] == "session.started"  # durable, so history from now on
    with connect(f"{srv.ws_url}/v1/events?cursor=now&types=session.*") as ws:
        ws.send(json.dumps({"type": "ping"}))
        assert json.loads(ws.recv(timeout=WAIT_S)) == {"type": "pong"}  # subscribed: nothing missed from here on
        new = create_session(client, [])
        frames = [json.loads(ws.recv(timeout=WAIT_S))]
        while frames[-1]["session_id"] != new:
            frames.append(json.loads(ws.recv(timeout=WAIT_S)))
    assert all(f["session_id"] != old for f in frames), "no history is replayed"
    assert frames[-1]["type"] == "session.started" and isinstance(frames[-1]["cursor"], int)


def test_timeline_fills_as_a_scripted_session_runs(srv: Server, client: httpx.Client, page: Any) -> None:
    turns = [
        {"text": "Let me count.", "tool_calls": [{"name": "progress", "arguments": {"steps": 6, "step_s": 0.2}}]},
        {"text": "Counting in the background."},
        {"text": "Done: {{tool_output:progress}}"},
    ]
    sid = create_session(client, turns)
    open_session(page, srv, sid)
    # the overview lists the session
    page.wait_for_selector(f'#sessions tr[data-session-id="{sid}"]')
    client.post(f"/v1/sessions/{sid}/input", json={"text": "count for me"})

    page.wait_for_selector('.row.user:has-text("count for me")')
    tool = page.wait_for_selector('.row.tool[data-status="running"]')
    assert '"steps":6' in tool.query_selector(".args").inner_text()
    # the running call is listed in the overview too
    page.wait_for_selector(f'#running-tools li[data-session-id="{sid}"]')
    values = set()

    def progressed() -> bool:
        value = page.evaluate("() => document.querySelector('.row.tool progress')?.value ?? null")
        if value is not None:
            values.add(round(value, 3))
        return page.evaluate("() => document.querySelector('.row.tool').dataset.status") == "completed"

    wait_until(progressed, interval=0.05, what="the tool to complete")
    intermediate = sorted(v for v in values if 0 < v < 1)
    assert len(intermediate) >= 2, f"the progress bar should advance step by step, saw {sorted(values)}"
    assert tool.query_selector(".output").inner_text() == "all 6 steps done"
    assert tool.query_selector("progress").get_attribute("aria-label") == "Progress of progress"
    page.wait_for_selector('.row.speech:has-text("Done: all 6 steps done")')
    assert page.inner_text(".row.speech >> nth=0").count("Let me count.") == 1
    page.wait_for_selector(f'#running-tools li[data-session-id="{sid}"]', state="detached")

    events = server_events(srv, sid)
    page.wait_for_function(f"() => document.querySelector('.session-view').dataset.lastSeq == {events[-1]['seq']}")
    assert_rows_match_log(page, events)
    # detail rows are in the DOM but hidden until "Show every event"
    assert not page.is_visible('[data-type="agent.state"] >> nth=0')
    page.check("#show-all")
    assert page.is_visible('[data-type="agent.state"] >> nth=0')


def test_interrupt_strikes_through_the_unheard_rest(srv: Server, client: httpx.Client, page: Any) -> None:
    sid = create_session(client, [{"text": LONG}])
    open_session(page, srv, sid)
    client.post(f"/v1/sessions/{sid}/input", json={"text": "talk to me"})
    page.wait_for_selector('.row.speech[data-state="speaking"]')
    page.wait_for_timeout(300)  # a few words are heard
    page.click("#op-interrupt-now")
    row = page.wait_for_selector(".row.speech.interrupted[data-unheard='yes']")
    assert row.query_selector(".badge.state").inner_text() == "interrupted"
    heard = row.query_selector(".heard").inner_text().strip()
    rest = row.query_selector("del.unheard").inner_text().strip()
    assert heard and rest
    assert f"{heard} {rest}".split() == LONG.split(), "what was heard plus the struck-through rest is the full text"
    speech_id = row.get_attribute("data-speech-id")
    speech = client.get(f"/v1/sessions/{sid}/speeches/{speech_id}").json()
    assert speech["interrupted"] is True and speech["played_text"] == heard
    assert page.is_hidden(".error-box")


def test_cancel_from_the_timeline_and_from_the_running_list(srv: Server, client: httpx.Client, page: Any) -> None:
    turns = [
        {
            "text": "Searching twice.",
            "tool_calls": [
                {"name": "search", "arguments": {"query": "trains", "seconds": 30}},
                {"name": "search", "arguments": {"query": "planes", "seconds": 30}},
                {"name": "slow", "arguments": {"seconds": 1.0}},
            ],
        },
        {"text": "Still searching."},
    ]
    sid = create_session(client, turns)
    open_session(page, srv, sid)
    client.post(f"/v1/sessions/{sid}/input", json={"text": "search"})
    page.wait_for_selector(".row.tool >> nth=2")
    slow = page.query_selector('.row.tool:has(.tool-name:text-is("slow"))')
    assert slow.query_selector("button.cancel") is None, "a call that cannot be cancelled offers no Cancel"

    trains = page.wait_for_selector('.row.tool:has-text("trains") button.cancel')
    trains.click()
    page.wait_for_selector('.row.tool[data-status="cancelled"]:has-text("trains")')
    planes_id = page.get_attribute('.row.tool:has-text("planes")', "data-call-id")
    page.click(f'#running-tools li[data-call-id="{planes_id}"] button.cancel')
    page.wait_for_selector('.row.tool[data-status="cancelled"]:has-text("planes")')
    calls = {
        c["arguments"].get("query"): c["status"] for c in client.get(f"/v1/sessions/{sid}/tool-calls").json()["items"]
    }
    assert calls["trains"] == "cancelled" and calls["planes"] == "cancelled"
    page.wait_for_selector('.row.tool[data-status="completed"]:has(.tool-name:text-is("slow"))')
    assert page.is_hidden(".error-box")


def test_dropped_websocket_resumes_with_contiguous_rows(srv: Server, client: httpx.Client, page: Any) -> None:
    turns = [{"text": "Counting.", "tool_calls": [{"name": "progress", "arguments": {"steps": 40, "step_s": 0.03}}]}]
    sid = create_session(client, turns)
    open_session(page, srv, sid)
    client.post(f"/v1/sessions/{sid}/input", json={"text": "count"})
    for _ in range(3):  # drop the socket under the app while events keep coming
        page.wait_for_timeout(200)
        page.wait_for_function("() => window.switchboard.view.stream.ws?.readyState === WebSocket.OPEN")
        page.evaluate("() => window.switchboard.view.stream.ws.close()")
    page.wait_for_selector('.row.tool[data-status="completed"]', timeout=WAIT_S * 1000)
    events = server_events(srv, sid)
    page.wait_for_function(f"() => document.querySelector('.session-view').dataset.lastSeq == {events[-1]['seq']}")
    assert_rows_match_log(page, events)
    stats = page.evaluate("() => { const s = window.switchboard.view.stream; return [s.connects, s.gaps]; }")
    assert stats[0] >= 4 and stats[1] == 0, stats


def test_too_slow_4008_resumes_from_the_last_seq(srv: Server, client: httpx.Client, page: Any) -> None:
    """The first event stream is closed with 4008 after a few frames, as the service does with a slow consumer."""
    urls: list[str] = []

    def slow_once(ws: Any) -> None:
        urls.append(ws.url)
        upstream = ws.connect_to_server()
        if len(urls) > 1:
            return  # later connections pass straight through

        def forward(message: str | bytes) -> None:
            ws.send(message)
            seq = json.loads(message)["seq"]
            if seq == 10:
                ws.close(code=4008, reason=f"too slow; resume with since={seq}")
                upstream.close()

        upstream.on_message(forward)

    page.route_web_socket(re.compile(r"/v1/sessions/[^/]+/events"), slow_once)
    turns = [{"text": "Counting.", "tool_calls": [{"name": "progress", "arguments": {"steps": 10, "step_s": 0.05}}]}]
    sid = create_session(client, turns)
    open_session(page, srv, sid)
    client.post(f"/v1/sessions/{sid}/input", json={"text": "count"})
    page.wait_for_selector('.row.tool[data-status="completed"]', timeout=WAIT_S * 1000)
    events = server_events(srv, sid)
    page.wait_for_function(f"() => document.querySelector('.session-view').dataset.lastSeq == {events[-1]['seq']}")
    assert_rows_match_log(page, events)
    assert page.evaluate("() => window.switchboard.view.stream.slowCloses") == 1
    assert [u.split("since=")[1].split("&")[0] for u in urls] == ["0", "10"]


def test_stale_frames_are_dropped_not_shown_twice(srv: Server, client: httpx.Client, page: Any) -> None:
    sid = create_session(client, [{"text": "Hello there."}])
    open_session(page, srv, sid)
    client.post(f"/v1/sessions/{sid}/input", json={"text": "hi"})
    page.wait_for_selector('.row.speech[data-state="done"]')
    events = server_events(srv, sid)
    page.wait_for_function(f"() => document.querySelector('.session-view').dataset.lastSeq == {events[-1]['seq']}")
    # replay old frames on the live socket, as a server resuming from an older seq would
    page.evaluate(
        "(frames) => { const s = window.switchboard.view.stream; for (const f of frames) s._onFrame(s.ws, f); }",
        [json.dumps(e) for e in events[:5]],
    )
    page.wait_for_timeout(100)
    assert page.evaluate("() => window.switchboard.view.stream.duplicates") == 5
    assert_rows_match_log(page, events)


def test_double_click_and_retry_apply_once(srv: Server, client: httpx.Client, page: Any) -> None:
    sid = create_session(client, [], llm_extra={"fallback": {"text": "Noted."}})
    open_session(page, srv, sid)
    keys: list[str] = []
    page.on(
        "request",
        lambda r: keys.append(r.headers.get("idempotency-key", "")) if r.url.endswith("/input") else None,
    )
    page.fill("#op-text", "once please")
    page.dblclick("#op-send")
    page.wait_for_selector('.row.user:has-text("once please")')
    page.wait_for_timeout(200)
    assert page.is_hidden(".error-box"), "the second click of a double click is not an operator mistake"

    # the first attempt reaches the service but its answer is lost: the retry carries the same key
    lost = {"done": False}

    def lose_first_answer(route: Any) -> None:
        response = route.fetch()
        if not lost["done"]:
            lost["done"] = True
            assert response.status == 202
            route.abort("connectionreset")
        else:
            route.fulfill(response=response)

    page.route("**/input", lose_first_answer)
    page.fill("#op-text", "exactly once")
    page.click("#op-send")
    page.wait_for_selector('.row.user:has-text("exactly once")')
    wait_until(lambda: page.input_value("#op-text") == "", what="the composer to clear after success")
    page.wait_for_timeout(300)

    inputs = [e["data"]["text"] for e in server_events(srv, sid) if e["type"] == "user.input"]
    assert inputs.count("once please") == 1 and inputs.count("exactly once") == 1, inputs
    assert all(keys) and len(keys) >= 3, keys
    assert keys[-1] == keys[-2], "a retry reuses the key of its first attempt"
    assert len(set(keys)) == 2, "one key per operator intention"
    assert page.is_hidden(".error-box")


def test_api_errors_are_shown_in_plain_words(srv: Server, client: httpx.Client, page: Any) -> None:
    sid = create_session(client, [{"text": LONG}], allow_interruptions=False)
    open_session(page, srv, sid)
    client.post(f"/v1/sessions/{sid}/input", json={"text": "talk"})
    row = page.wait_for_selector('.row.speech[data-state="speaking"]')
    page.click("#op-interrupt-now")
    error = page.wait_for_selector(".error-box:visible")
    speech_id = row.get_attribute("data-speech-id")
    assert error.inner_text() == f"Interrupting failed: speech {speech_id} does not allow interruptions"
    page.click("#op-force")  # the operator may still force it; a success clears the error
    page.wait_for_selector(".row.speech.interrupted")
    page.wait_for_selector(".error-box", state="hidden")

    page.click("#op-close")
    page.click("#op-close-confirm")
    page.wait_for_selector('[data-type="session.closed"]')
    page.wait_for_selector(".controls p:has-text('This session has ended')")
    assert page.is_disabled("#op-send") and page.is_disabled("#op-interrupt-now")


def test_recovered_session_shows_a_divider(tmp_path: Path, browser: Any) -> None:
    server = Server(tmp_path).start()
    try:
        with httpx.Client(base_url=server.url, timeout=WAIT_S) as c:
            turns = [{"text": "Long job.", "tool_calls": [{"name": "slow", "arguments": {"seconds": 30}}]}]
            sid = create_session(c, turns)
            c.post(f"/v1/sessions/{sid}/input", json={"text": "go"})
            wait_until(lambda: any(e["type"] == "tool.started" for e in server_events(server, sid, idle_s=0.1)))
    finally:
        server.kill()
    restarted = Server(tmp_path, database_url=server.database_url).start()
    context = browser.new_context()
    try:
        page = context.new_page()
        open_session(page, restarted, sid)
        divider = page.wait_for_selector('.row.divider[role="separator"]')
        assert "recovered after a restart" in divider.inner_text()
        assert "1 running tool call(s) ended interrupted" in divider.inner_text()
        page.wait_for_selector('.row.tool[data-status="interrupted"]')
        events = server_events(restarted, sid)
        page.wait_for_function(f"() => document.querySelector('.session-view').dataset.lastSeq == {events[-1]['seq']}")
        assert_rows_match_log(page, events)
    finally:
        context.close()
        restarted.stop()


def test_five_thousand_events_render_and_live_events_only_append(srv: Server, page: Any) -> None:
    page.goto(f"{srv.url}/console/")
    page.wait_for_selector("#sessions-title")
    result = page.evaluate(
        """async () => {
        const { Timeline } = await import("./timeline.js");
        const list = document.createElement("ol");
        list.className = "timeline";
        const scroller = document.createElement("div");
        scroller.style.height = "600px";
        scroller.style.overflow = "auto";
        scroller.append(list);
        document.body.append(scroller);
        const at = new Date().toISOString();
        const events = [];
        let seq = 0;
        const push = (type, data) => events.push({ seq: ++seq, session_id: "perf", type, at, data });
        push("session.started", { agent: "tester" });
        for (let i = 0; events.length < 5000; i++) {
          const sp = `sp_${i}`, call = `call_${i}`;
          push("user.input", { item_id: `u${i}`, text: `question ${i}`, final: true });
          push("speech.created", { speech_id: sp, source: "reply" });
          push("generation.started", { speech_id: sp, step: 0, preemptive: false });
          push("agent.state", { state: "speaking" });
          push("speech.started", { speech_id: sp });
          push("tool.started", { call_id: call, name: "progress", arguments: { i }, cancellable: i % 2 === 0 });
          for (let k = 1; k <= 8; k++) push("tool.progress", { call_id: call, message: `step ${k}`, progress: k / 8 });
          push("chat.item", { item: { type: "message", role: "assistant", text: `answer ${i}`, interrupted: false } });
          push("tool.ended", { call_id: call, status: "completed", output: "done", is_error: false });
          push("speech.done", { speech_id: sp, interrupted: false });
        }
        events.length = 5000;
        const tl = new Timeline({ list, scroller, fetchSpeech: null, onCancel: () => {}, onChange: null });
        tl.ingest(events);
        await new Promise((resolve) => requestAnimationFrame(() => requestAnimationFrame(resolve)));
        void list.offsetHeight;  // include layout
        const first = list.firstElementChild;
        const removed = [];
        const observer = new MutationObserver((ms) => ms.forEach((m) => removed.push(...m.removedNodes)));
        observer.observe(list, { childList: true });
        tl.ingest([{ seq: 5001, session_id: "perf", type: "user.input", at, data: { text: "live", final: true } }]);
        await new Promise((resolve) => requestAnimationFrame(() => requestAnimationFrame(resolve)));
        return { rows: list.children.length, same: list.firstElementChild === first,
                 removed: removed.length, last: list.lastElementChild.dataset.seq };
    }"""
    )
    assert result["rows"] == 5001 and result["last"] == "5001"
    assert result["same"] and result["removed"] == 0, "a live event appends; nothing is re-rendered"


@pytest.fixture(scope="module")
def auth_srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(tmp_path_factory.mktemp("console-auth"), SWITCHBOARD_API_KEYS=KEYS).start()
    try:
        yield server
    finally:
        server.stop()


def test_auth_on_key_stays_out_of_urls(auth_srv: Server, browser: Any) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=auth_srv.url, headers=admin, timeout=WAIT_S) as c:
        sid = create_session(c, [{"text": "Hello operator."}])
    context = browser.new_context()
    page = context.new_page()
    urls: list[str] = []
    authorized: list[str] = []
    page.on("request", lambda r: (urls.append(r.url), r.headers.get("authorization") and authorized.append(r.url)))
    page.on("websocket", lambda ws: urls.append(ws.url))
    try:
        page.goto(f"{auth_srv.url}/console/")
        page.wait_for_selector("#auth-form:visible")
        assert "needs an API key" in page.inner_text("#notice")
        page.fill("#auth-key", ADMIN_KEY)
        page.press("#auth-key", "Enter")
        page.click(f'#sessions tr[data-session-id="{sid}"] a')
        page.wait_for_selector('[data-type="session.started"]')
        page.fill("#op-text", "hello")
        page.click("#op-send")
        page.wait_for_selector('.row.speech[data-state="done"]:has-text("Hello operator.")')
        assert page.evaluate("() => sessionStorage.getItem('switchboard.apiKey')") == ADMIN_KEY
        assert page.evaluate("() => localStorage.length") == 0
    finally:
        context.close()
    assert not [u for u in urls if ADMIN_KEY in u], "the API key never appears in a URL"
    session_sockets = [u for u in urls if u.startswith("ws") and f"/v1/sessions/{sid}/events" in u]
    assert session_sockets and all("token=sbt_" in u for u in session_sockets)
    assert any(u.endswith(f"/v1/sessions/{sid}/input") for u in authorized)


def test_embedded_with_a_session_token_is_read_only(auth_srv: Server, browser: Any) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=auth_srv.url, headers=admin, timeout=WAIT_S) as c:
        sid = create_session(c, [{"text": "Watched from a dashboard."}])
        c.post(f"/v1/sessions/{sid}/input", json={"text": "hi"})
        token = c.post(f"/v1/sessions/{sid}/tokens", json={}).json()["token"]
    context = browser.new_context()
    page = context.new_page()
    try:
        open_session(page, auth_srv, sid, f"&token={token}")
        page.wait_for_selector('.row.speech:has-text("Watched from a dashboard.")')
        assert page.query_selector("#op-send") is None, "a read-only token gets no controls"
        assert page.is_hidden(".sidebar") and page.is_hidden("#auth-form") and page.is_hidden("#notice")
        assert page.is_hidden(".auth-bar")
    finally:
        context.close()


def test_a_link_with_a_token_does_not_replace_the_tabs_api_key(auth_srv: Server, browser: Any) -> None:
    """Anyone could send a logged-in operator a console link carrying a token of their own choosing: the tab then
    went on under that token (read-only, on the link author's session) instead of the operator's key."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=auth_srv.url, headers=admin, timeout=WAIT_S) as c:
        sid = create_session(c, [{"text": "The operator's own session."}])
        other = create_session(c, [{"text": "Someone else's session."}])
        token = c.post(f"/v1/sessions/{other}/tokens", json={}).json()["token"]
    context = browser.new_context()
    page = context.new_page()
    sent: list[str] = []
    page.on("request", lambda r: sent.append(r.headers.get("authorization", "")))
    try:
        page.goto(f"{auth_srv.url}/console/")
        page.wait_for_selector("#auth-form:visible")
        page.fill("#auth-key", ADMIN_KEY)
        page.press("#auth-key", "Enter")
        page.wait_for_selector(f'#sessions tr[data-session-id="{sid}"]')
        sent.clear()
        page.goto(f"{auth_srv.url}/console/#session={sid}&token={token}")
        page.reload()  # the link opened in this tab: the page starts again with the token in its address
        page.wait_for_selector('[data-type="session.started"]')
        assert page.query_selector("#op-send") is not None, "the operator keeps their controls"
        assert "session token" in page.inner_text("#notice")
        assert not [h for h in sent if token in h], "the link's token was never used"
        assert any(ADMIN_KEY in h for h in sent)
    finally:
        context.close()
