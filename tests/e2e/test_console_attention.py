"""The console's attention queue in Chromium, driven by real failures: a model that never answers, a webhook
backend that is down, a session that cannot be recovered after a restart. Also search, sort and the header."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .console_support import create_session, wait_until
from .server import Server, free_port

# two server starts (one to leave a session behind for the second to fail) and a browser: slow on a loaded machine
pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.timeout(240)]

AGENTS_FILE = """
- name: desk
  instructions: Help the caller.
  llm: {{provider: scripted, turns: [{{tool_calls: [{{name: check_order, arguments: {{order_id: A-1}}}}]}}]}}
  tools:
    - kind: webhook
      name: check_order
      description: Check an order.
      parameters: {{type: object, properties: {{order_id: {{type: string}}}}, required: [order_id]}}
      url: http://127.0.0.1:{port}/tools/check_order
      timeout_s: 2
      secret_env: DESK_WEBHOOK_SECRET
"""


@pytest.fixture(autouse=True)
def no_leaked_tasks() -> None:
    """These tests run no event loop of their own (see test_console.py)."""


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("attention")
    agents = tmp / "agents.yaml"
    agents.write_text(AGENTS_FILE.format(port=free_port()))  # nothing listens there: the backend is down
    env = {
        "SWITCHBOARD_AGENTS_FILE": str(agents),
        "DESK_WEBHOOK_SECRET": "desk-secret-0123456789abcdefghijklmn",
        "SWITCHBOARD_ATTENTION_STALL_S": "1",
        "SWITCHBOARD_ATTENTION_SILENCE_S": "1",
        "SWITCHBOARD_AGENTS": "tests.agents_fixture:AGENTS,tests.agents_fixture:RETIRED_AGENTS",
    }
    first = Server(tmp, **env).start(timeout=60)
    try:
        with httpx.Client(base_url=first.url, timeout=10) as client:
            assert client.post("/v1/sessions", json={"id": "gone", "agent": "retired"}).status_code == 201
    finally:
        first.stop()
    # the same database without the retired agent: that session fails on recovery
    env["SWITCHBOARD_AGENTS"] = "tests.agents_fixture:AGENTS"
    server = Server(tmp, database_url=first.database_url, **env).start(timeout=60)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def page(browser: Any, srv: Server) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    p = context.new_page()
    errors: list[str] = []
    p.on("pageerror", lambda e: errors.append(str(e)))
    yield p
    context.close()
    assert not errors, errors


def queue(page: Any) -> dict[str, list[str]]:
    """Session id -> the reason codes the queue shows for it."""
    found: dict[str, list[str]] = page.evaluate(
        """() => Object.fromEntries([...document.querySelectorAll('#attention > li')].map(li =>
            [li.dataset.sessionId, [...li.querySelectorAll('.reasons li')].map(r => r.dataset.code)]))"""
    )
    return found


def test_the_queue_shows_real_failures_with_their_reasons_and_clears_when_resolved(page: Any, srv: Server) -> None:
    with httpx.Client(base_url=srv.url, timeout=10) as client:
        stalled = create_session(client, [{"text": "late", "ttft_ms": 60000}], sid="never-answers")
        client.post(f"/v1/sessions/{stalled}/input", json={"text": "hello?"})
        desk = client.post(
            "/v1/sessions", json={"id": "backend-down", "agent": "desk", "metadata": {"caller": "+41 22"}}
        )
        assert desk.status_code == 201, desk.text
        client.post("/v1/sessions/backend-down/input", json={"text": "where is my order?"})
        create_session(client, [], sid="calm", metadata={"caller": "+33 1"})
        page.goto(f"{srv.url}/console/")

        def settled() -> bool:  # each session enters the queue with its first reason; the others follow
            found = queue(page)
            return {"never-answers", "backend-down", "gone"} <= set(found) and (
                "tool_failed" in found["backend-down"]
                and {"speech_stalled", "silence_after_input"} <= set(found["never-answers"])
            )

        wait_until(settled, what="queue")
        shown = queue(page)
        assert {"speech_stalled", "silence_after_input"} <= set(shown["never-answers"])
        assert "tool_failed" in shown["backend-down"]
        assert shown["gone"] == ["session_failed"]
        assert "calm" not in shown
        text = page.inner_text("#attention")
        assert "Speech stalled" in text and "Tool failed" in text and "unknown agent 'retired'" in text
        assert page.inner_text("#attention-count") == str(len(shown))

        # the failed session's timeline says why, and its header says failed
        page.click("#attention li[data-session-id='gone'] a")
        page.wait_for_selector(".timeline [data-type='session.failed']")
        assert "unknown agent 'retired'" in page.inner_text(".timeline [data-type='session.failed']")
        wait_until(lambda: page.inner_text(".session-head .conn") == "Session failed", what="failed header")

        # resolved: the stalled speech is interrupted, the session closed: it leaves the queue
        client.delete(f"/v1/sessions/{stalled}")
        wait_until(lambda: "never-answers" not in queue(page), what="queue clears")


def test_search_sort_header_and_keys(page: Any, srv: Server) -> None:
    with httpx.Client(base_url=srv.url, timeout=10) as client:
        turns = [{"text": "Hello there, how can I help?", "ttft_ms": 40}]
        create_session(client, turns, sid="alpha-1", metadata={"caller": "+41 79 111"})
        create_session(client, [], sid="beta-2", metadata={"caller": "+44 20 222"})
        client.post("/v1/sessions/alpha-1/input", json={"text": "hi"})
        page.goto(f"{srv.url}/console/")
        page.wait_for_selector("#sessions tr[data-session-id='beta-2']")
        visible = lambda: page.eval_on_selector_all(  # noqa: E731
            "#sessions tr:not([hidden])", "rows => rows.map(r => r.dataset.sessionId)"
        )
        page.fill("#session-filter", "+44")
        wait_until(lambda: visible() == ["beta-2"], what="search by metadata")
        assert "caller: +44 20 222" in page.inner_text("#sessions tr[data-session-id='beta-2']")
        page.fill("#session-filter", "")
        page.click("th[data-sort='id'] button")
        ids = [i for i in visible() if i in ("alpha-1", "beta-2")]
        assert ids == ["alpha-1", "beta-2"]
        page.click("th[data-sort='id'] button")
        assert [i for i in visible() if i in ("alpha-1", "beta-2")] == ["beta-2", "alpha-1"]
        assert page.get_attribute("th[data-sort='id']", "aria-sort") == "descending"

        page.click("#sessions tr[data-session-id='alpha-1'] a")
        wait_until(lambda: "first audio" in page.inner_text(".session-head .latency"), what="latency")
        assert page.inner_text(".session-head .model") == "scripted"
        # keys: j moves to the next visible session; / focuses the message box
        page.click("main")
        page.keyboard.press("j")
        wait_until(lambda: page.evaluate("location.hash") != "#session=alpha-1", what="next session")
        shown = page.evaluate("decodeURIComponent(location.hash.slice('#session='.length))")
        wait_until(lambda: page.inner_text("#session-title") == f"Session {shown}", what="the next session opens")
        wait_until(lambda: page.evaluate("document.activeElement.id") == "session-title", what="its title focused")
        page.keyboard.press("/")
        assert page.evaluate("document.activeElement.id") == "op-text"


def test_the_api_and_console_agree_on_the_queue(page: Any, srv: Server) -> None:
    with httpx.Client(base_url=srv.url, timeout=10) as client:
        page.goto(f"{srv.url}/console/")
        wait_until(lambda: queue(page), what="queue")
        api = {
            s["id"]: [r["code"] for r in s["attention"]]
            for s in client.get("/v1/sessions?attention=true").json()["items"]
        }
        wait_until(lambda: queue(page) == api, what=json.dumps(api))


def test_a_speaking_agents_words_show_before_the_speech_ends(page: Any, srv: Server) -> None:
    words = " ".join(f"word{i}" for i in range(200))  # 4 s at 50 words/s
    with httpx.Client(base_url=srv.url, timeout=10) as client:
        sid = create_session(client, [{"text": words}], sid="live-words")
        page.goto(f"{srv.url}/console/#session={sid}")
        page.wait_for_selector("[data-type='session.started']")
        client.post(f"/v1/sessions/{sid}/input", json={"text": "talk to me"})
        live = wait_until(
            lambda: page.inner_text(".live-text") if page.query_selector(".live-text") else "", what="live"
        )
        assert live.startswith("word0 word1") and "speech.done" not in [
            e for e in page.eval_on_selector_all(".timeline [data-type]", "els => els.map(e => e.dataset.type)")
        ]
        client.post(f"/v1/sessions/{sid}/interrupt", json={})
        page.wait_for_selector(".row.speech.interrupted")
        assert page.query_selector(".live-text") is None
